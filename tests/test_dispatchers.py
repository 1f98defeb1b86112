"""Every dispatcher of the registry (dispatch/registry.py) against the local one, and the registry's rules.

Conformance, one case list for every entry, built through the registry as training builds it: the MoE
layer's output and every gradient (tokens, router gate, this rank's experts) against the local
dispatcher's on the same tokens with every expert on one rank, on gloo ranks at the EP sizes the entry
takes (deepep through the fake deep_ep at tests/fakes/deep_ep; in bf16, which it needs). Cases: random
routing; padded groups; a zero gate (every token to experts 0..2: zero-token experts, ranks that receive
nothing); one expert taking every token; activation checkpointing (the recompute replays: the same
results to the bit and no collective more than without; or it exchanges again: the same results to the
bit, more collectives, no rows kept); each of the buffers the entry sizes by; the
Triton kernels (under the interpreter on CPU); inductor (slow). On 2 GPUs (marked gpu): NCCL, Triton.
What is particular to one dispatcher (its calls, its layout, its transport) is in its own test file.

The registry: each entry's refusals against the rules stated here apart from it, and the config check,
the machine check, the choice and the build agreeing with its problem(); the shared autograd wrapper.
"""

import collections
import contextlib
import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from numerics import assert_close_to_max
from torch.utils.checkpoint import checkpoint

from spawn_ranks import rank_group, run_ranks
from test_deepep import load_fake_deep_ep
from torchtitan_moe.config.sections import DISPATCH_KEYS, ConfigError, check_dispatch
from torchtitan_moe.dispatch import deepep_backend, registry
from torchtitan_moe.dispatch.backward import with_backward
from torchtitan_moe.dispatch.registry import OVERLAPS, Run
from torchtitan_moe.dispatch.replay import ReplaysExchanges
from torchtitan_moe.dispatch.seam import BUFFERS
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions

DIM, EXPERTS, TOP_K, INTER = 16, 8, 3, 16  # bf16 GEMMs take rows of a multiple of 16 bytes
NAMES = ("out", "grad x", "grad gate", "grad w13", "grad w2")
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier")
MOVING_ROWS = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor")  # the collectives that move a layer's rows


def dtype_of(entry: registry.Entry) -> torch.dtype:
    """The layer's dtype for an entry: bf16 where it takes nothing else (deepep), fp32 otherwise."""
    return torch.bfloat16 if entry.param_dtypes == ("bfloat16",) else torch.float32


# -- the cases ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # the registry entry
    what: str  # random, padded, zero_gate, one_expert, checkpoint, checkpoint_exchange, triton, compiled
    world: int
    padding: str = "none"
    buffers: str = "exact"
    kernels: str = "torch"
    gpus: bool = False

    @property
    def id(self) -> str:
        return f"{self.name}-{self.what}-ep{self.world}-{self.padding}-{self.buffers}" + ("-gpus" if self.gpus else "")

    @property
    def routing(self) -> str:
        return self.what if self.what in ("zero_gate", "one_expert") else "random"


def cases(entry: registry.Entry) -> list:
    """Every case of one entry, at the EP sizes up to 4 it takes; those that would build the reference
    itself (the local dispatcher unpadded, on torch kernels) are left out."""
    worlds = [w for w in (1, 2, 4) if entry.takes_ep(w)]
    small, big = worlds[0], worlds[-1]
    buffers = entry.buffers or ("exact",)
    found = [Case(entry.name, "random", small, "none", buffers[0]),
             Case(entry.name, "padded", big, "always", buffers[-1]),
             Case(entry.name, "zero_gate", big, "none", buffers[0]),
             Case(entry.name, "one_expert", small, "always", buffers[-1])]
    found += [Case(entry.name, "checkpoint", w, p, b) for b, w, p in zip(buffers, (small, big), ("always", "none"))]
    found += [Case(entry.name, "checkpoint_exchange", w, p, b) for b, w, p in zip(buffers, (big, small), ("none", "always"))
              if w > 1]
    found += [Case(entry.name, "triton", small, "always", b, "triton") for b in buffers]
    found = [c for c in found if not (c.world == 1 and c.padding == "none" and c.kernels == "torch")]
    params = [pytest.param(c, id=c.id, marks=[interpreter_only] if c.kernels == "triton" else []) for c in found]
    if small > 1:  # the layer compiled by inductor (the exchanges opaque nodes in its graph), on the buffers a
        # compiled run takes (the last: worst_case, no host sync, where it sizes by them); ~40 s of compiling
        compiled = Case(entry.name, "compiled", small, "always", buffers[-1])
        params.append(pytest.param(compiled, id=compiled.id, marks=pytest.mark.slow))
        gpu = Case(entry.name, "checkpoint", 2, "always", buffers[-1], "triton", gpus=True)
        params += [pytest.param(c, id=c.id, marks=[pytest.mark.gpu, two_gpus]) for c in
                   (dataclasses.replace(gpu, what="random", padding="none", buffers=buffers[0]), gpu,
                    dataclasses.replace(gpu, what="checkpoint_exchange", buffers=buffers[0])) if entry.takes_ep(2)]
    return params


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels on CPU tensors need the "
                                      "interpreter; on GPUs the gpu cases run them compiled")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
CASES = [p for entry in registry.DISPATCHERS.values() for p in cases(entry)]


# -- one case ---------------------------------------------------------------------------------------------


def make_layer(case: Case, dtype: torch.dtype, padding: str = "none", kernels: str = "torch") -> MoE:
    """The same weights on every rank, all experts; experts in `dtype`, the router in fp32."""
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding=padding, kernels=kernels,
                        router=RouterOptions(init_std=0.0 if case.routing == "zero_gate" else 0.5, bias_update_rate=0.0)),
                DIM)
    layer.init_weights(out_std=0.1)
    if case.routing == "one_expert":  # the last expert wins every token's choice (the bias picks, it does not weigh)
        layer.router.expert_bias[-1] = 9.0
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach().to(dtype)))
    return layer


def forward_backward(layer, x: torch.Tensor, grad: torch.Tensor, use_checkpoint: bool = False, compiler=None,
                     after_forward=lambda: None):
    """(out, grad x, grad gate, grad w13, grad w2) and the collectives the layer's forward and backward made."""
    model = torch.compile(layer, backend=compiler) if compiler else layer
    x = x.clone().requires_grad_()
    with counting_collectives() as calls:
        out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
        after_forward()
        out.backward(grad)
    grads = (x.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad)
    return (out.detach(), *grads), calls


def rows_in(kept) -> int:
    """Rows of DIM values among what a dispatcher kept (tensors, nested in tuples, lists and its deque)."""
    if isinstance(kept, torch.Tensor):
        return kept.shape[0] if kept.dim() == 2 and kept.shape[1] == DIM else 0
    if isinstance(kept, (tuple, list, collections.deque)):
        return sum(rows_in(k) for k in kept)
    return 0


@contextlib.contextmanager
def counting_collectives():
    """Each torch.distributed collective made in the block appends its name (the fake deep_ep's too)."""
    calls: list = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, lambda *args, _fn=fn, _name=name, **kwargs: calls.append(_name) or _fn(*args, **kwargs))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def subject(case: Case, entry: registry.Entry, dtype: torch.dtype, rank: int, device: torch.device):
    """The layer with this rank's expert shard and its dispatcher, built by the registry."""
    layer = make_layer(case, dtype, case.padding, case.kernels).to(device)
    mine = slice(rank * EXPERTS // case.world, (rank + 1) * EXPERTS // case.world)
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].clone()))
    run = Run(case.world, buffers=case.buffers, param_dtype=str(dtype).removeprefix("torch."), gpus=case.gpus)
    group = dist.group.WORLD if case.world > 1 else None
    kernels, align = layer.dispatch_settings(device)
    layer.set_dispatcher(entry.builder(run, group, device, hidden=DIM)(EXPERTS, align, kernels))
    return layer, mine


def compare(rank: int, case: Case, device: torch.device) -> None:
    entry = registry.get(case.name)
    dtype = dtype_of(entry)
    torch.manual_seed(100 + rank)  # other tokens on every rank
    x, grad = torch.randn(2, 7, DIM, dtype=dtype, device=device), torch.randn(2, 7, DIM, dtype=dtype, device=device)

    # The reference: the local dispatcher, every expert, torch kernels, no padding. Expert gradients under EP
    # gather every rank's tokens: the references' summed over ranks (in fp32).
    ref, _ = forward_backward(make_layer(case, dtype).to(device), x, grad)
    ref_w = [g.float() for g in ref[3:]]
    if case.world > 1:
        for g in ref_w:
            dist.all_reduce(g)

    layer, mine = subject(case, entry, dtype, rank, device)
    use_checkpoint = case.what.startswith("checkpoint")
    recompute = "exchange" if case.what == "checkpoint_exchange" else "replay"
    kept: dict = {}  # "rows": the rows the forward kept for the recompute, counted before the backward
    if use_checkpoint:
        plain, plain_calls = forward_backward(layer, x, grad)
        layer.zero_grad(set_to_none=True)
        layer, _ = subject(case, entry, dtype, rank, device)  # a fresh dispatcher: nothing kept, nothing checked yet
    replays = use_checkpoint and isinstance(layer.dispatcher, ReplaysExchanges)
    if replays:
        layer.dispatcher.keep_exchanges, layer.dispatcher.recompute = True, recompute
    after = (lambda: kept.update(rows=rows_in(layer.dispatcher._kept))) if replays else (lambda: None)
    got, calls = forward_backward(layer, x, grad, use_checkpoint, "inductor" if case.what == "compiled" else None, after)

    # bf16: the ranks' partial sums rounded before they are added, the expert gradients summed in another
    # order; fp32: summation order (and inductor's fusions, the GPUs' GEMM tiles).
    rel = 2**-7 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(NAMES, got, (*ref[:3], ref_w[0][mine], ref_w[1][mine])):
        if not b.any():  # this rank's experts got no token (the zero gate): exact zeros
            assert not a.any(), f"rank {rank}: {name} is not zero"
        else:
            assert_close_to_max(a.float(), b.float(), rel, f"rank {rank}: {name}")
    if isinstance(layer.dispatcher, ReplaysExchanges):
        assert not layer.dispatcher._kept, f"rank {rank}: kept exchanges left after the backward"
    if use_checkpoint:  # the same results; replayed: no exchange again; exchanged again: more, and no rows kept
        for name, a, b in zip(NAMES, got, plain):
            assert torch.equal(a, b), f"rank {rank}: {name} under activation checkpointing differs"
        if recompute == "replay":
            assert calls == plain_calls, f"rank {rank}: collectives {calls} checkpointed, {plain_calls} without"
            assert not replays or kept["rows"] > 0, f"rank {rank}: the forward kept no rows to replay"
        else:  # rows moved (not setup: barriers, all_gather's token check); on GPUs the peer-memory transport's
            # copies are no torch.distributed collective: none to count
            exchanges = [c for c in calls if c in MOVING_ROWS]
            plain_exchanges = [c for c in plain_calls if c in MOVING_ROWS]
            assert len(exchanges) > len(plain_exchanges) or not plain_exchanges, \
                f"rank {rank}: collectives {calls} exchanging again, {plain_calls} without"
            assert not replays or kept["rows"] == 0, \
                f"rank {rank}: the forward kept {kept['rows']} rows for a recompute that exchanges"


def worker(rank: int, world: int, port: int, case: Case, failures) -> None:
    sys.modules.pop("deep_ep", None)  # the pooled processes may hold the fake from an earlier case
    if case.gpus:
        torch.cuda.set_device(rank)
        device, backend, init = torch.device("cuda", rank), "nccl", {"device_id": torch.device("cuda", rank)}
    else:
        sys.modules["deep_ep"] = load_fake_deep_ep()
        device, backend, init = torch.device("cpu"), "gloo", {}
    with rank_group(rank, world, port, failures, backend, **init):
        compare(rank, case, device)
        deepep_backend.release_buffers()


@pytest.mark.parametrize("case", CASES)
def test_dispatcher_matches_the_local_dispatcher(case):
    entry = registry.get(case.name)
    if case.gpus and entry.missing is not None and entry.missing():
        pytest.skip(f"{case.name}: {entry.missing()}")
    if case.world == 1:  # one rank: nothing to spawn
        compare(0, case, torch.device("cpu"))
    else:
        run_ranks(worker, case.world, case)


# -- the registry's rules ------------------------------------------------------------------------------

# What each dispatcher takes, stated apart from the registry: EP sizes (of 1..16), overlaps, the
# parameters' dtypes (None: any), whether its EP group must sit inside one node.
TAKES = {
    "local": ({1}, {"none"}, None, False),
    "all_to_all": (set(range(2, 17)), set(OVERLAPS), None, False),
    "deepep": ({2, 4, 8}, set(OVERLAPS), {"bfloat16"}, True),
    "all_gather": ({2}, {"none"}, None, False),
}
RUNS = [Run(ep, overlap, buffers, dtype, procs)
        for ep in range(1, 17) for overlap in OVERLAPS for buffers in BUFFERS for dtype in ("bfloat16", "float32")
        for procs in (None, 2, 6, 8)]


def takes(name: str, run: Run) -> bool:
    eps, overlaps, dtypes, one_node = TAKES[name]
    return (run.ep in eps and run.overlap in overlaps and (dtypes is None or run.param_dtype in dtypes)
            and not (one_node and run.procs_per_node is not None and run.procs_per_node % run.ep))


def test_every_dispatcher_is_stated_here():
    assert set(registry.NAMES) == set(TAKES)


@pytest.mark.parametrize("name", registry.NAMES)
def test_problem_refuses_exactly_the_runs_a_dispatcher_does_not_take(name):
    entry = registry.get(name)
    marked = {key: f"<{key}>" for key in registry.PLAIN}
    for run in RUNS:
        problem = entry.problem(run, marked)
        assert (problem is None) == takes(name, run), f"{name}, {run}: {problem}"
        if problem is not None:  # one phrase, naming the refused fact in the words it was given
            assert "\n" not in problem and any(mark in problem for mark in marked.values()), problem


def config(backend: str, run: Run) -> SimpleNamespace:
    return SimpleNamespace(dispatch=SimpleNamespace(backend=backend, overlap=run.overlap, buffers=run.buffers, num_sms=0,
                                                    tuned_file="", recompute="replay"),
                           activation_checkpoint=SimpleNamespace(mode="none", offload_inputs=False),
                           training=SimpleNamespace(mixed_precision_param=run.param_dtype),
                           model=SimpleNamespace(name="qwen3_moe"), kernels=SimpleNamespace(backend="torch"),
                           parallelism=SimpleNamespace(expert_parallel_degree=run.ep))


@pytest.mark.parametrize("name", registry.NAMES)
def test_the_config_check_the_machine_check_and_the_build_agree_with_the_registry(name, monkeypatch):
    from torchtitan_moe.train.machine import check_machine

    entry = registry.get(name)
    monkeypatch.setitem(registry.DISPATCHERS, name, dataclasses.replace(entry, missing=None))  # a library is not asked
    for run in RUNS:
        problem = entry.problem(dataclasses.replace(run, procs_per_node=None), DISPATCH_KEYS)
        cfg = config(name, run)
        refused = problem is not None or (run.overlap != "none" and run.ep == 1)  # chunks need EP > 1, whatever the dispatcher
        try:
            check_dispatch(cfg, run.ep)
            assert not refused, f"{name}, {run}: the config check took it; the registry: {problem}"
        except ConfigError as e:
            assert refused, f"{name}, {run}: the config check refused it ({e}); the registry takes it"
            if problem is not None:
                assert str(e).startswith(f"[dispatch] backend = {name!r} {problem}"), str(e)
            continue
        # The machine check knows the processes per node.
        node_problem = entry.problem(run, DISPATCH_KEYS)
        try:
            check_machine(cfg, run.procs_per_node)
            assert node_problem is None, f"{name}, {run}: the machine check took it; the registry: {node_problem}"
        except ConfigError as e:
            assert node_problem is not None and str(e).startswith(f"[dispatch] backend = {name!r} {node_problem}"), str(e)
    for run in RUNS:  # the build refuses before it makes anything (no group needed to refuse)
        if entry.problem(run) is not None:
            with pytest.raises(ValueError, match=rf"^{name} dispatcher: needs "):
                entry.builder(run, None, torch.device("cpu"))


@pytest.mark.parametrize("overlap, precision", [("none", "bfloat16"), ("chunks", "bfloat16"), ("none", "float32")])
@pytest.mark.parametrize("ep", [2, 4])
def test_auto_picks_the_fastest_dispatcher_the_registry_lets_this_run_use(tmp_path, monkeypatch, ep, overlap, precision):
    from torchtitan_moe.parallel import tuned
    from torchtitan_moe.parallel.choose import choose_dispatcher

    monkeypatch.setitem(sys.modules, "deep_ep", load_fake_deep_ep())
    monkeypatch.setattr(deepep_backend, "check_group", lambda group: None)  # one host, peers reachable
    shape = tuned.Shape("NVIDIA H200", ep, 2048, 8, 128, 8192)
    cfg = config("auto", Run(ep, overlap, "exact", precision))
    run = Run(ep, overlap, "exact", precision)
    ms = {name: 10.0 + i for i, name in enumerate(reversed(registry.NAMES))}  # the last entry the fastest
    for best in registry.NAMES:
        path = tmp_path / f"{best}.json"
        raw = {**dataclasses.asdict(shape), "best": best, "layer_ms": ms,
               "deepep": {"num_sms": 64, "dispatch_chunk": 16, "combine_chunk": 8, "buffer_tokens": 256}}
        path.write_text(json.dumps({"version": 1, "entries": [raw]}))
        cfg.dispatch.tuned_file = str(path)
        choice = choose_dispatcher(cfg, shape, None, None)
        expected = best if registry.get(best).problem(run) is None else next(
            n for n in sorted(ms, key=ms.get) if registry.get(n).problem(run) is None)
        assert choice.backend == expected, (best, choice.reason)
        assert (choice.settings is not None) == registry.get(expected).tuned


# -- the shared machinery -----------------------------------------------------------------------------


def test_with_backward_sends_zeros_for_a_result_without_gradient():
    # The reverse exchange is a collective: a result that got no gradient still sends one (zeros), and the
    # backward learns which inputs need theirs.
    x, p = torch.randn(3, 2, requires_grad=True), torch.randn(3)
    seen = []

    def back(grads, needs):
        seen.append(([None if g is None else g.clone() for g in grads], needs))
        return grads[0][:3] * 2, grads[1][:3]

    a, b = with_backward([torch.randn(4, 2), torch.randn(4)], (x, p), back)
    assert a.requires_grad and b.requires_grad
    weight = torch.randn(4, 2)
    (a * weight).sum().backward()  # b gets no gradient
    (grads, needs), = seen
    assert needs == (True, False)
    assert torch.equal(grads[0], weight)
    assert grads[1] is not None and grads[1].shape == (4,) and not grads[1].any()
    assert torch.equal(x.grad, 2 * weight[:3])
