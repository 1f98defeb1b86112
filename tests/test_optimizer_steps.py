"""Our AdamW (components/optimizer.py) over several steps, each option against torch.optim.AdamW: what one
step cannot show (the step count, a learning-rate schedule, parameter groups, parameters without a gradient,
and the bf16 moments' random bits, which must be new at every step)."""

import pytest
import torch

from torchtitan_moe.components.optimizer import AdamW

STEPS = 8
BASE = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
OPTIONS = {
    "defaults": {},
    "large lr": dict(lr=0.3),
    "betas": dict(betas=(0.5, 0.999)),
    "large eps": dict(eps=1e-3),  # the same size as sqrt(exp_avg_sq): where it is added shows
    "no weight decay": dict(weight_decay=0.0),
    "strong weight decay": dict(weight_decay=0.5),
}


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 33), (33,), (7, 5, 3))]


def gradients(step: int, params) -> list[torch.Tensor]:
    """The step's gradients: fixed by the step (not by the weights), of several scales."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) * 10.0 ** (i - 2) for i, p in enumerate(params)]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)  # a learning rate that changes at every step of the first four


def train(optimizer_cls, options: dict, steps: int = STEPS, skip=lambda step, i: False, **extra):
    """Weights and states after `steps` steps under a warm-up schedule; skip(step, i): parameter i has no
    gradient at that step (an expert no token reached)."""
    params = parameters()
    optimizer = optimizer_cls(params, **{**BASE, **options}, **extra)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    for step in range(1, steps + 1):
        for i, (p, g) in enumerate(zip(params, gradients(step, params))):
            p.grad = None if skip(step, i) else g
        optimizer.step()
        schedule.step()
    return params, optimizer


def torch_adamw(params, **kwargs):
    return torch.optim.AdamW(params, foreach=False, **kwargs)


def assert_same_training(ours, theirs):
    (ours_params, ours_opt), (their_params, their_opt) = ours, theirs
    for i, (a, b) in enumerate(zip(ours_params, their_params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"param {i}")  # weights of size 1: fp32 rounding
        mine, torchs = ours_opt.state[a], their_opt.state[b]
        assert float(mine["step"]) == float(torchs["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(torchs[key].abs().max())  # a moment near 0 is the difference of two terms of that size
            torch.testing.assert_close(mine[key], torchs[key], rtol=1e-5, atol=1e-6 * scale, msg=f"param {i} {key}")


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_as_torch_adamw_over_several_steps(option):
    ours = train(AdamW, OPTIONS[option], moments_dtype=torch.float32)
    assert_same_training(ours, train(torch_adamw, OPTIONS[option]))
    assert ours[1].param_groups[0]["lr"] == OPTIONS[option].get("lr", BASE["lr"])  # the warm-up is over


def test_parameter_groups_keep_their_own_hyperparameters():
    def grouped(cls, **extra):
        params = parameters()
        groups = [{"params": params[:1]}, {"params": params[1:2], "lr": 0.1, "weight_decay": 0.0, "betas": (0.8, 0.99)},
                  {"params": params[2:], "lr": 3e-3, "eps": 1e-4}]
        optimizer = cls(groups, **BASE, **extra)
        for step in range(1, STEPS + 1):
            for p, g in zip(params, gradients(step, params)):
                p.grad = g
            optimizer.step()
        return params, optimizer

    assert_same_training(grouped(AdamW, moments_dtype=torch.float32), grouped(torch_adamw))


def test_a_parameter_without_a_gradient_skips_its_step_as_in_torch():
    # Parameter 1 gets no gradient at steps 2, 3 and 6: it is not updated then, and its step count (its bias
    # correction) falls behind the others'.
    def skip(step, i):
        return i == 1 and step in (2, 3, 6)

    ours = train(AdamW, {}, skip=skip, moments_dtype=torch.float32)
    assert_same_training(ours, train(torch_adamw, {}, skip=skip))
    assert [float(ours[1].state[p]["step"]) for p in ours[0]] == [STEPS, STEPS - 3, STEPS]


def halfway_moments(steps: int, n: int = 1 << 14) -> torch.Tensor:
    """exp_avg rounded at each of `steps` steps of one parameter: before each step exp_avg is 1 + 2^-7 (a bf16
    number) and the gradient 1 with beta1 = 1/2, so the new exp_avg 1 + 2^-8 is halfway between two bf16
    numbers: each element rounds up or down with probability 1/2. -> [steps, n] True where it rounded up."""
    p = torch.nn.Parameter(torch.zeros(n))
    optimizer = AdamW([p], lr=1e-3, betas=(0.5, 0.5), eps=1e-8, weight_decay=0.0, moments_dtype=torch.bfloat16)
    ups = []
    for _ in range(steps):
        p.grad = torch.ones(n)
        if optimizer.state:
            optimizer.state[p]["exp_avg"].fill_(1 + 2**-7)
            optimizer.state[p]["exp_avg_sq"].fill_(1 + 2**-7)
        else:  # the first step's exp_avg starts at 0: give it the same start
            optimizer._state(p)["exp_avg"].fill_(1 + 2**-7)
            optimizer.state[p]["exp_avg_sq"].fill_(1 + 2**-7)
        optimizer.step()
        exp_avg = optimizer.state[p]["exp_avg"]
        assert set(exp_avg.unique().tolist()) == {1.0, 1 + 2**-7}
        ups.append(exp_avg == 1 + 2**-7)
    return torch.stack(ups)


def test_bf16_moments_draw_new_random_bits_at_every_step():
    ups = halfway_moments(6)
    n = ups.shape[1]
    # n coin flips per step: a share's standard deviation is 1/256 at n = 2^14; the bounds are 8 of them.
    assert (ups.double().mean(dim=1) - 0.5).abs().max() < 1 / 32
    for a in range(len(ups)):
        for b in range(a + 1, len(ups)):
            agree = (ups[a] == ups[b]).double().mean().item()
            assert abs(agree - 0.5) < 1 / 32, f"steps {a + 1} and {b + 1} round {agree:.0%} of elements alike"
    # Over the steps each element's rounding averages out: its share of ups is binomial(6, 1/2) / 6, not 0 or 1.
    always = ((ups.sum(dim=0) == 0) | (ups.sum(dim=0) == len(ups))).double().mean().item()
    assert abs(always - 2 / 2 ** len(ups)) < 1 / 32, always
    assert n == 1 << 14


def test_bf16_moments_follow_fp32_moments_over_many_steps():
    # The same gradients (fixed by the step, not by the weights) into fp32 and bf16 moments. Each bf16 store is
    # one unbiased stochastic rounding (error within 1 bf16 ulp, variance at most ulp^2 / 4), and a moment keeps
    # beta of the previous one, so independent roundings add up to an RMS of at most (ulp / 2) / sqrt(1 - beta^2)
    # and a mean near 0; roundings that repeat from step to step would add up coherently, to ulp / (1 - beta).
    steps = 60
    params = [torch.nn.Parameter(torch.zeros(1 << 13)) for _ in range(2)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        optimizer = AdamW(ps, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, moments_dtype=dtype)
        g = torch.Generator().manual_seed(5)
        base = [1 + torch.rand(p.shape, generator=g) for p in ps]  # gradients near 1..2: moments of one binade
        for _ in range(steps):
            for p, b in zip(ps, base):
                p.grad = b * (1 + 0.01 * torch.randn(p.shape, generator=g))
            optimizer.step()
        runs[dtype] = [optimizer.state[p] for p in ps]
    for exact, rounded in zip(runs[torch.float32], runs[torch.bfloat16]):
        for key, beta in (("exp_avg", 0.9), ("exp_avg_sq", 0.95)):
            ulp = 2.0 ** (torch.floor(torch.log2(exact[key].abs())) - 7)  # of a bf16 number near the moment
            error = (rounded[key].double() - exact[key].double()) / ulp
            rms = error.square().mean().sqrt().item()
            assert rms < 0.5 / (1 - beta**2) ** 0.5, (key, rms)
            assert abs(error.mean().item()) < 0.05, (key, error.mean().item())  # unbiased
