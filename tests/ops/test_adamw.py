"""adamw_step_ against a float64 AdamW from the same inputs, and the optimizer against torch.optim.AdamW.

Under TRITON_INTERPRET=1 (set by tests/conftest.py where there is no GPU) the Triton kernel runs on
the CPU; on a GPU it runs compiled.
"""

import pytest
import torch
from ops_helpers import assert_ulp, ulp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from torchtitan_moe.ops.adamw import adamw_foreach_, adamw_step_
from torchtitan_moe.components.optimizer import AdamW

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def exact_step(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """float64 AdamW from the same (already rounded) inputs: the bound every result is held to."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    m_terms = (beta1 * m).abs() + ((1 - beta1) * g).abs()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = lr / (1 - beta1**step) * m / (v.sqrt() / (1 - beta2**step) ** 0.5 + eps)
    return p * (1 - lr * weight_decay) - update, m, v, update, m_terms


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, 5000])
def test_adamw_step_is_one_rounding_of_the_exact_update(n, grad_dtype, moments, backend):
    g0 = torch.Generator().manual_seed(n)
    # Views of larger buffers whose tails hold NaN: a write past n would show there.
    buffers = [torch.full((n + 64,), float("nan"), dtype=d, device=DEVICE) for d in (torch.float32, moments, moments)]
    p, m, v = (b[:n] for b in buffers)
    p.copy_(torch.randn(n, generator=g0))
    m.copy_(torch.randn(n, generator=g0) * 1e-2)
    v.copy_(torch.rand(n, generator=g0) * 1e-4)
    v[: n // 10] = 0  # a fresh moment: the update is then lr-sized
    g = (torch.randn(n, generator=g0) * 1e-2).to(grad_dtype).to(DEVICE)
    exact_p, exact_m, exact_v, update, m_terms = exact_step(p, g, m, v, **HYPER, step=7)

    adamw_step_(p, g, m, v, **HYPER, step=7, seed=n, backend=backend)

    # One rounding to the moments' dtype (for bf16, stochastic: to one of the two neighbours, so within
    # 1 ulp), after fp32 arithmetic whose error scales with the terms (beta1 * m and (1 - beta1) * g
    # can cancel); exp_avg_sq's terms are both >= 0.
    ulps = 1 if moments == torch.bfloat16 else 2
    assert_ulp("exp_avg", m, exact_m, ulps=ulps, slack=4 * ulp(m_terms, torch.float32))
    assert_ulp("exp_avg_sq", v, exact_v, ulps=ulps, slack=4 * ulp(exact_v, torch.float32))
    # The weight: fp32 arithmetic on the decayed weight and the update (computed from the unrounded moments).
    assert_ulp("param", p, exact_p, ulps=2, slack=2 * ulp(exact_p + update, torch.float32) + 16 * ulp(update, torch.float32))
    for name, b in zip(("param", "exp_avg", "exp_avg_sq"), buffers):
        assert b[n:].isnan().all(), f"{name}: written past its end"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_grad_scale_divides_the_gradient_and_leaves_it(moments, backend):
    """grad_scale (clipping folded into the update): the same bits as the update of grad / grad_scale,
    and the gradient itself is not written."""
    g0 = torch.Generator().manual_seed(3)
    p, m, v = torch.randn(3000, generator=g0), torch.randn(3000, generator=g0) * 1e-2, torch.rand(3000, generator=g0) * 1e-4
    g = torch.randn(3000, generator=g0) * 1e-2
    scale = torch.tensor(3.7)
    scaled = [t.clone().to(DEVICE, d) for t, d in ((p, torch.float32), (m, moments), (v, moments))]
    divided = [t.clone() for t in scaled]
    grad = g.to(DEVICE)
    adamw_step_(*scaled[:1], grad, *scaled[1:], **HYPER, step=3, seed=5, grad_scale=scale.to(DEVICE), backend=backend)
    adamw_step_(*divided[:1], grad / scale.to(DEVICE), *divided[1:], **HYPER, step=3, seed=5, backend=backend)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), scaled, divided):
        assert torch.equal(a, b), name
    assert torch.equal(grad, g.to(DEVICE))
    with pytest.raises(ValueError, match="grad_scale must be a 0-dim float32 tensor"):
        adamw_step_(*scaled[:1], grad, *scaled[1:], **HYPER, step=4, grad_scale=scale.reshape(1).to(DEVICE))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_working_copy_is_the_new_param_cast_and_changes_nothing_else(moments, backend):
    """`working` (experts' bf16 copy): the bits of casting the updated param (round to nearest even; the
    interpreter's own cast truncates), nothing written past its end, and param and moments as without it."""
    n = 5000
    g0 = torch.Generator().manual_seed(11)
    p, m, v = torch.randn(n, generator=g0), torch.randn(n, generator=g0) * 1e-2, torch.rand(n, generator=g0) * 1e-4
    g = (torch.randn(n, generator=g0) * 1e-2).to(DEVICE)
    p[:8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 1e38, -0.0, 3.0, 1 + 2**-9])  # ties, tiny, huge
    with_copy = [t.clone().to(DEVICE, d) for t, d in ((p, torch.float32), (m, moments), (v, moments))]
    without = [t.clone() for t in with_copy]
    buffer = torch.full((n + 64,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    adamw_step_(with_copy[0], g, *with_copy[1:], **HYPER, step=2, seed=9, working=buffer[:n], backend=backend)
    adamw_step_(without[0], g, *without[1:], **HYPER, step=2, seed=9, backend=backend)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), with_copy, without):
        assert torch.equal(a, b), name
    assert torch.equal(buffer[:n], with_copy[0].to(torch.bfloat16))
    assert buffer[n:].isnan().all(), "working: written past its end"
    with pytest.raises(ValueError, match=r"working must match param \(\(5000,\)"):
        adamw_step_(with_copy[0], g, *with_copy[1:], **HYPER, step=3, working=buffer[: n - 1], backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_moments_keep_updates_smaller_than_half_a_step_on_average(backend):
    # exp_avg_sq = 1 and g^2 = 1 + 2^-10 / (1 - beta2): the exact new value 1 + 2^-10 is an eighth of the
    # way to the next bf16 number (1 + 2^-7). Rounded to nearest, every element would stay 1 forever.
    n = 1 << 15
    p, m, g = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE, dtype=torch.bfloat16), torch.empty(n, device=DEVICE)
    v = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    g.fill_((1 + 2**-10 / (1 - HYPER["beta2"])) ** 0.5)
    adamw_step_(p, g, m, v, **HYPER, step=1, seed=5, backend=backend)
    assert set(v.unique().tolist()) == {1.0, 1 + 2**-7}
    # the mean is exact to within 5 standard deviations of n coin flips of p = 1/8
    assert abs(v.double().mean().item() - (1 + 2**-10)) < 5 * 2**-7 * (1 / 8 * 7 / 8 / n) ** 0.5
    # the same seed draws the same bits (a run repeats); another seed others
    again, other = torch.ones_like(v), torch.ones_like(v)
    adamw_step_(p.clone(), g, m.clone(), again, **HYPER, step=1, seed=5, backend=backend)
    adamw_step_(p.clone(), g, m.clone(), other, **HYPER, step=1, seed=6, backend=backend)
    assert torch.equal(again, v) and not torch.equal(other, v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_moments_round_each_element_and_each_moment_on_bits_of_their_own(backend):
    # beta = 1/2, old moments 1 + 2^-7 (a bf16 number) and g = 1: both new moments are 1 + 2^-8, halfway
    # between two bf16 numbers, so each rounds up with probability 1/2. The Triton kernel draws one Philox call
    # per four elements: each element its own word, exp_avg its low 16 bits, exp_avg_sq its high 16. Elements
    # that share a word or a call, or two moments that share bits, would round the same way every time.
    n = 1 << 14
    m, v = (torch.full((n,), 1 + 2**-7, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    adamw_step_(torch.zeros(n, device=DEVICE), torch.ones(n, device=DEVICE), m, v, **{**HYPER, "beta1": 0.5,
                "beta2": 0.5}, step=1, seed=11, backend=backend)
    m_up, v_up = (t == 1 + 2**-7 for t in (m, v))
    assert set(m.unique().tolist()) == set(v.unique().tolist()) == {1.0, 1 + 2**-7}

    def agree(a, b):  # the share of pairs rounded the same way: 1/2 for independent coins
        return (a == b).double().mean().item()

    # n coin flips: a share's standard deviation is 1/256 here, the bounds are 8 of them
    assert abs(m_up.double().mean().item() - 0.5) < 1 / 32 and abs(v_up.double().mean().item() - 0.5) < 1 / 32
    assert abs(agree(m_up, v_up) - 0.5) < 1 / 32, "exp_avg and exp_avg_sq round on the same bits"
    for lag in (1, 2, 3, 4):  # within a Philox call's four elements, and into the next call's
        assert abs(agree(m_up[:-lag], m_up[lag:]) - 0.5) < 1 / 32, f"elements {lag} apart round together"
        assert abs(agree(v_up[:-lag], v_up[lag:]) - 0.5) < 1 / 32, f"elements {lag} apart round together"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("working", [False, True])
def test_a_group_in_one_call_is_each_parameter_updated_alone(moments, working, backend):
    # Sizes around the kernel's block (1024): empty, one element, a block's tail, several blocks. Each parameter
    # keeps its own seed; every tensor sits in a NaN-tailed buffer, so a write past any end shows.
    sizes = [0, 1, 1000, 1024, 1025, 5000, 3]
    g0 = torch.Generator().manual_seed(3)

    def group():
        out = []
        for n in sizes:
            bufs = [torch.full((n + 64,), float("nan"), dtype=d, device=DEVICE)
                    for d in (torch.float32, moments, moments, torch.bfloat16)]
            p, m, v, w = (b[:n] for b in bufs)
            p.copy_(torch.randn(n, generator=g0))
            m.copy_(torch.randn(n, generator=g0) * 1e-2)
            v.copy_(torch.rand(n, generator=g0) * 1e-4)
            g = (torch.randn(n, generator=g0) * 1e-2).to(torch.bfloat16).to(DEVICE)
            out.append((bufs, (p, g, m, v, w)))
        return out

    together, alone = group(), None
    g0.manual_seed(3)
    alone = group()
    scale = torch.tensor(1.5, device=DEVICE)
    seeds = [11 * i + 1 for i in range(len(sizes))]
    roles = list(zip(*(t for _, t in together)))
    adamw_foreach_(*roles[:4], **HYPER, step=4, seeds=seeds, grad_scale=scale,
                   workings=roles[4] if working else None, backend=backend)
    for (_, (p, g, m, v, w)), seed in zip(alone, seeds):
        adamw_step_(p, g, m, v, **HYPER, step=4, seed=seed, grad_scale=scale, working=w if working else None,
                    backend=backend)
    for (bufs_a, _), (bufs_b, _), n in zip(together, alone, sizes):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "working"), bufs_a, bufs_b):
            torch.testing.assert_close(a[:n], b[:n], rtol=0, atol=0, equal_nan=True, msg=f"{name} of size {n}")
            assert a[n:].isnan().all(), f"{name} of size {n}: written past its end"
            if name == "working" and not working:
                assert a[:n].isnan().all(), "working written without being asked"


def test_a_group_has_one_dtype_per_role():
    p, q = torch.zeros(4), torch.zeros(3)
    with pytest.raises(ValueError, match=r"every grad of a group must have one dtype"):
        adamw_foreach_([p, q], [p, q.bfloat16()], [p, q], [p, q], **HYPER, step=1, seeds=[1, 2], backend="torch")
    with pytest.raises(ValueError, match=r"seeds: 1 entries for 2 params"):
        adamw_foreach_([p, q], [p, q], [p, q], [p, q], **HYPER, step=1, seeds=[1], backend="torch")


def test_bad_arguments_are_named():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="param must be float32"):
        adamw_step_(p.half(), p, p, p, **HYPER, step=1, backend="torch")
    with pytest.raises(ValueError, match="exp_avg_sq must be float32 or bfloat16"):
        adamw_step_(p, p, p, p.half(), **HYPER, step=1, backend="torch")
    with pytest.raises(ValueError, match=r"grad must match param \(\(4,\)"):
        adamw_step_(p, torch.zeros(5), p, p, **HYPER, step=1, backend="torch")
    with pytest.raises(ValueError, match="step counts from 1"):
        adamw_step_(p, p, p, p, **HYPER, step=0, backend="torch")
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\^31\)"):
        adamw_step_(p, p, p, p, **HYPER, step=1, seed=-1, backend="torch")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3)).to(DEVICE)


def _train(model, optimizer, steps=6):
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 16, device=DEVICE)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _optimizer(model, moments):
    return AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, moments_dtype=moments)


def test_fp32_moments_train_as_torch_adamw():
    ours, torchs = _model(), _model()
    _train(ours, _optimizer(ours, torch.float32))
    _train(torchs, torch.optim.AdamW(torchs.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                     foreach=False))
    for a, b in zip(ours.parameters(), torchs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_moments_are_stored_in_bf16_and_stay_in_bf16_through_a_checkpoint():
    model = _model()
    optimizer = _optimizer(model, torch.bfloat16)
    _train(model, optimizer)
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 8 and all(t.dtype == torch.bfloat16 for t in moments)
    saved = get_optimizer_state_dict(model, optimizer)  # what torchtitan's checkpointer saves

    # torch.optim.Optimizer.load_state_dict casts moments to the parameters' fp32; ours stores bf16 again.
    other = _optimizer(model, torch.bfloat16)
    set_optimizer_state_dict(model, other, saved)
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert other.state[p][k].dtype == torch.bfloat16
            assert torch.equal(other.state[p][k], optimizer.state[p][k])
        assert other.state[p]["step"].item() == 6


def test_bf16_moments_track_fp32_moments():
    # bf16 storage of the moments changes the weights by far less than one step moves them.
    runs = {}
    for moments in (torch.float32, torch.bfloat16):
        model = _model()
        start = [p.detach().clone() for p in model.parameters()]
        _train(model, _optimizer(model, moments), steps=20)
        runs[moments] = [(p.detach() - s) for p, s in zip(model.parameters(), start)]
    for a, b in zip(runs[torch.float32], runs[torch.bfloat16]):
        assert (a - b).norm() < 0.02 * a.norm()


def test_the_in_place_kernel_is_not_autotuned():
    # The autotuner times configs by running the kernel on the real arguments: an in-place update
    # would be applied once per timing run on the first call (caught on the GPU by the test above).
    triton = pytest.importorskip("triton")
    from torchtitan_moe.ops.adamw_triton import _adamw_kernel

    assert not isinstance(_adamw_kernel, triton.runtime.Autotuner)


# 'auto' with fp32 moments: ours on a GPU (faster, and it writes the experts' working copies), torch's on the CPU.
@pytest.mark.parametrize("update, moments, ours", [("auto", "float32", torch.cuda.is_available()), ("auto", "bfloat16", True),
                                                    ("triton", "float32", True), ("torch", "float32", False)])
def test_update_picks_the_optimizer_and_ours_keeps_the_moments_asked_for(update, moments, ours):
    from torchtitan_moe.train.job_config import load_job_config
    from torchtitan_moe.components.optimizer import build_optimizers

    job = load_job_config(["--job.config_file", "configs/debug.toml", "--optimizer.update", update,
                           "--optimizer.moments_dtype", moments])
    model = _model()
    optimizers = build_optimizers([model], job.optimizer, parallel_dims=None)
    (inner,) = optimizers.optimizers
    assert isinstance(inner, AdamW) == ours, type(inner)
    _train(model, optimizers)
    if ours:
        moments_seen = {s[k].dtype for s in inner.state.values() for k in ("exp_avg", "exp_avg_sq")}
        assert moments_seen == {getattr(torch, moments)}
