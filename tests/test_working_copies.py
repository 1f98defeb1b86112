"""The experts' bf16 working copies (experts outside FSDP2, moe/experts.py): the GEMMs read them in forward
and backward with the bits of a cast, they are cast again only when the fp32 weights changed, and our
AdamW writes them in its update (optimizer.attach_working_copies). The two-process training runs
(tests/test_train_cpu.py) check whole steps against the experts under FSDP2, bit for bit."""

import pytest
import torch
from torch import nn

from torchtitan_moe.models.qwen3_moe.parallelize import keep_experts_unsharded
from torchtitan_moe.moe.experts import GroupedExperts, refresh_working_copies, stale_working_copies
from torchtitan_moe.components.optimizer import AdamW, attach_working_copies
from torchtitan_moe.dispatch.seam import ExpertBatch
from torchtitan_moe.compat.torchtitan import OptimizersContainer

E, D, I, N = 4, 16, 8, 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts_and_batch(seed: int = 0, working: bool = True):
    torch.manual_seed(seed)
    experts = GroupedExperts(D, I, E).to(DEVICE)
    experts.init_weights(out_std=0.1)
    if working:
        keep_experts_unsharded(experts, torch.bfloat16)
    offsets = torch.tensor([5, 5, 17, 20], dtype=torch.int32, device=DEVICE)  # an expert without rows, 4 tail rows
    x = torch.randn(N, D).to(DEVICE, torch.bfloat16)
    probs = torch.rand(N, device=DEVICE)
    probs[20:] = 0
    return experts, ExpertBatch(x=x, probs=probs, offsets=offsets, num_rows=torch.tensor(20, device=DEVICE),
                                tokens_per_expert=torch.tensor([5, 0, 12, 3], device=DEVICE), ctx=None)


def cast_reference(experts: GroupedExperts, batch: ExpertBatch):
    """The layer with its weights cast in the forward (autograd keeping the casts): what the copies replace."""
    from torchtitan_moe import ops

    w13, w2 = experts.w13.to(torch.bfloat16), experts.w2.to(torch.bfloat16)
    ab = ops.grouped_mm(batch.x, w13.transpose(-2, -1), batch.offsets)
    h = ops.swiglu_prob(ab, batch.probs, batch.num_rows, backend=experts.kernels)
    return ops.grouped_mm(h, w2.transpose(-2, -1), batch.offsets)


def step_results(experts: GroupedExperts, batch: ExpertBatch, fn) -> list[torch.Tensor]:
    experts.zero_grad()
    y = fn(batch)[:20]
    y.backward(torch.ones_like(y))
    return [y.detach(), experts.w13.grad.clone(), experts.w2.grad.clone()]


def test_the_gemms_read_the_working_copies_with_a_casts_bits():
    experts, batch = experts_and_batch()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours = step_results(experts, batch, experts)
    theirs = step_results(experts, batch, lambda b: cast_reference(experts, b))
    for name, a, b in zip(("y", "dw13", "dw2"), ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours[1].dtype == torch.float32 and ours[1].stride() == experts.w13.stride()
    # backward reads the working copies: no other bf16 tensor of a weight's size is kept
    copies = {experts.working[n].untyped_storage().data_ptr() for n in ("w13", "w2")}
    weight_sized = {t.untyped_storage().data_ptr() for t in saved if t.numel() in (experts.w13.numel(), experts.w2.numel())}
    assert weight_sized == copies, (weight_sized, copies)
    assert experts.current == {"w13", "w2"} and stale_working_copies(experts) == []


@pytest.mark.parametrize("change", ["load_state_dict", "init_weights", "optimizer_step"])
def test_weights_changed_are_cast_again_before_the_next_forward(change):
    experts, batch = experts_and_batch()
    experts(batch)  # copies cast and current
    new, _ = experts_and_batch(seed=1, working=False)
    if change == "load_state_dict":
        experts.load_state_dict(new.state_dict())
    elif change == "init_weights":
        torch.manual_seed(1)
        experts.init_weights(out_std=0.1)
    else:  # torch's AdamW does not write the copies: cast after its step
        optimizers = OptimizersContainer([experts], torch.optim.AdamW, dict(lr=0.5))
        attach_working_copies(optimizers, [experts])
        step_results(experts, batch, experts)
        casts = []
        experts.refresh_working_copies = lambda: casts.append(sorted(experts.current))
        optimizers.step()
        del experts.refresh_working_copies
        assert casts == [[]]  # stale, and cast right after the step
    assert experts.current == set()
    ours = step_results(experts, batch, experts)
    theirs = step_results(experts, batch, lambda b: cast_reference(experts, b))
    for name, a, b in zip(("y", "dw13", "dw2"), ours, theirs):
        assert torch.equal(a, b), name


def test_our_adamw_writes_the_copies_and_the_next_forward_casts_nothing(monkeypatch):
    experts, batch = experts_and_batch()
    other = GroupedExperts(D, I, E).to(DEVICE)  # outside the optimizer's model: no copies attached
    optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5, moments_dtype=torch.bfloat16))
    attach_working_copies(optimizers, [experts, other])
    for _ in range(3):
        step_results(experts, batch, experts)
        optimizers.step()
        assert experts.current == {"w13", "w2"}  # written by the update
        assert stale_working_copies(experts) == []
        for name in ("w13", "w2"):
            assert torch.equal(experts.working[name], getattr(experts, name).detach().to(torch.bfloat16)), name
    casts = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: casts.append(self.shape))
    experts(batch)
    assert casts == []


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_copy_out_of_step_with_its_weight_is_named(kernels):
    # Two layers' experts, one changed behind its back by one element: only that weight is named.
    layers = nn.ModuleDict()
    for i in range(2):
        experts, batch = experts_and_batch(seed=i)
        experts.kernels = kernels
        experts(batch)
        layers[f"moe{i}"] = experts
    assert stale_working_copies(layers) == []
    with torch.no_grad():
        layers["moe1"].w2.data.view(-1)[-1] += 1.0  # .data writes are not seen by the experts
    assert stale_working_copies(layers) == ["moe1.w2"]


def test_compiled_blocks_read_copies_made_by_the_models_pre_forward_hook():
    experts, batch = experts_and_batch()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = experts

        def forward(self, b):
            return self.block(b)

    model = Model()
    model.block.compile(backend="aot_eager", fullgraph=True)
    model.register_forward_pre_hook(refresh_working_copies)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, dict(lr=0.5))
    attach_working_copies(optimizers, [model])
    for _ in range(2):  # the second forward after an update: its copies cast by the hook, outside the graph
        ours = step_results(experts, batch, model)
        theirs = step_results(experts, batch, lambda b: cast_reference(experts, b))
        for name, a, b in zip(("y", "dw13", "dw2"), ours, theirs):
            assert torch.equal(a, b), name
        step_results(experts, batch, model)
        optimizers.step()


def test_a_compiled_forward_without_copies_says_what_to_call():
    experts, batch = experts_and_batch()
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"no working copies yet.*refresh_working_copies\(\)"):
        compiled(batch)


def kept(experts, optimizers, **kwargs):
    from torchtitan_moe.components.optimizer import keep_expert_gradients

    attach_working_copies(optimizers, [experts])
    keep_expert_gradients("bfloat16", optimizers, [experts], **{"accumulation_steps": 1, "pipeline": False, **kwargs})


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_kept_on_the_working_copies_train_as_the_fp32_gradients(compiled):
    """[optimizer] expert_grad_dtype = "bfloat16": the GEMMs' weight gradients stay on the bf16 working copies
    (the masters get none), with the bits of the fp32 gradients they replace (widening is exact); our AdamW
    reads them and steps as it does from the fp32 ones, bit for bit, and each step drops them; the norm the
    clipping uses is the same up to fp32 summation order. Eager and compiled (the copies are graph inputs)."""
    from torchtitan_moe.components.optimizer import total_grad_norm

    runs = {}
    for keep in (False, True):
        experts, batch = experts_and_batch()
        optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5, moments_dtype=torch.bfloat16))
        if keep:
            kept(experts, optimizers)
        else:
            attach_working_copies(optimizers, [experts])
        targets = optimizers.optimizers[0].working_copies
        forward = torch.compile(experts, backend="aot_eager", fullgraph=True) if compiled else experts
        grads, norms = [], []
        for _ in range(3):
            experts.refresh_working_copies()  # the model's pre-forward hook, outside the compiled graph
            optimizers.zero_grad()
            y = forward(batch)[:20]
            y.backward(torch.ones_like(y))
            grads.append([experts.gradient(name).float() for name in experts.WEIGHTS])
            norms.append(total_grad_norm(list(experts.parameters()), ep_enabled=False, working_copies=targets))
            if keep:
                assert experts.w13.grad is None and experts.w2.grad is None
                assert {experts.gradient(n).dtype for n in experts.WEIGHTS} == {torch.bfloat16}
            optimizers.step()
            if keep:
                assert all(copy.grad is None for copy in experts.working.values())  # dropped after the step
        runs[keep] = grads, norms, [p.detach().clone() for p in experts.parameters()]
    (fp32_grads, fp32_norms, fp32_weights), (grads, norms, weights) = runs[False], runs[True]
    for a, b in zip(fp32_grads, grads):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(fp32_weights, weights):
        assert torch.equal(a, b)
    for a, b in zip(fp32_norms, norms):
        assert b.item() == pytest.approx(a.item(), rel=1e-6)


def test_gradients_kept_on_the_working_copies_are_cleared_by_zero_grad():
    experts, batch = experts_and_batch()
    optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5))
    kept(experts, optimizers)
    for _ in range(2):  # a second backward without a step would add to the first: zero_grad drops it
        optimizers.zero_grad()
        y = experts(batch)[:20]
        y.backward(torch.ones_like(y))
    once = experts.gradient("w2").clone()
    optimizers.zero_grad()
    assert experts.gradient("w2") is None
    y = experts(batch)[:20]
    y.backward(torch.ones_like(y))
    assert torch.equal(experts.gradient("w2"), once)


@pytest.mark.parametrize("case, message", [
    ("accumulation", r'expert_grad_dtype = "bfloat16".*accumulates 2 micro-batches'),
    ("pipeline", r"pipeline parallelism"),
    ("torch_adamw", r"needs our AdamW"),
    ("no_copies", r"outside FSDP2.*this run has none"),
])
def test_kept_gradients_are_refused_where_a_step_would_not_read_them(case, message):
    from torchtitan_moe.config.sections import ConfigError

    experts, _ = experts_and_batch(working=case != "no_copies")
    optimizer = torch.optim.AdamW if case == "torch_adamw" else AdamW
    optimizers = OptimizersContainer([experts], optimizer, dict(lr=0.5))
    with pytest.raises(ConfigError, match=message):
        kept(experts, optimizers, accumulation_steps=2 if case == "accumulation" else 1, pipeline=case == "pipeline")
    assert not experts.working_gradients


def test_torchtitans_clip_is_refused_where_the_gradients_are_kept():
    from torchtitan_moe.components.optimizer import clip_in_optimizer

    experts, batch = experts_and_batch()
    optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5))
    kept(experts, optimizers)
    clip = clip_in_optimizer(optimizers, lambda *args: pytest.fail("torchtitan's clip would miss the kept gradients"))
    y = experts(batch)[:20]
    y.backward(torch.ones_like(y))
    assert clip(list(experts.parameters()), 1.0).item() > 0
    with pytest.raises(RuntimeError, match="torchtitan's clip_grad_norm_ does not read"):
        clip(list(experts.parameters()), 1.0, norm_type=1.0)


def test_the_monitors_grad_norm_counts_the_kept_gradients():
    from torchtitan_moe.components.checks.monitors import local_grad_norm

    norms = []
    for keep in (False, True):
        experts, batch = experts_and_batch()
        optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5))
        kept(experts, optimizers) if keep else attach_working_copies(optimizers, [experts])
        y = experts(batch)[:20]
        y.backward(torch.ones_like(y))
        norms.append(local_grad_norm([experts]).item())
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.parametrize("setting, accumulation_steps, keeps", [
    ("auto", 1, True), ("auto", 2, False), ("float32", 1, False), ("bfloat16", 1, True),
])
def test_expert_grad_dtype_auto_keeps_the_gradients_where_a_step_reads_them_and_float32_never(
        setting, accumulation_steps, keeps):
    from torchtitan_moe.components.optimizer import keep_expert_gradients

    experts, batch = experts_and_batch()
    optimizers = OptimizersContainer([experts], AdamW, dict(lr=0.5))
    attach_working_copies(optimizers, [experts])
    assert keep_expert_gradients(setting, optimizers, [experts], accumulation_steps, pipeline=False) is keeps
    assert experts.working_gradients is keeps
    y = experts(batch)[:20]
    y.backward(torch.ones_like(y))
    assert (experts.working["w2"].grad is not None) is keeps  # bf16, on the working copy
    assert (experts.w2.grad is None) is keeps  # else fp32, on the master weight
