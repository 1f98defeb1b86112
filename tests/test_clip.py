"""Gradient clipping folded into the optimizer (optimizer.clip_in_optimizer) against torchtitan's own
clip_grad_norm_ followed by the same optimizer: the same norm, the same step, the gradients left as
they were; torchtitan's clip where an optimizer cannot take a grad_scale. (Under EP, on two meshes:
tests/test_train_cpu.py trains both ways.)"""

from types import SimpleNamespace

import pytest
import torch

from torchtitan_moe.components.optimizer import AdamW, clip_in_optimizer, total_grad_norm
from torchtitan_moe.compat.torchtitan import _TORCHTITAN_CLIP_GRAD_NORM as torchtitan_clip
from torchtitan_moe.compat.torchtitan import OptimizersContainer

MAX_NORM = 0.5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


OPTIMIZERS = {
    "torch_fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "ours_bf16_moments": (AdamW, dict(lr=1e-2, moments_dtype=torch.bfloat16)),
    "ours_fp32_moments": (AdamW, dict(lr=1e-2, moments_dtype=torch.float32)),
}


def train(clip, optimizer: str, steps: int = 4, max_norm: float = MAX_NORM):
    """-> (the norms clip returned, the weights, the last step's gradients) of a few clipped steps."""
    net = model()
    cls, kwargs = OPTIMIZERS[optimizer]
    optimizers = OptimizersContainer([net], cls, kwargs)
    clip = clip(optimizers)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    norms = []
    for _ in range(steps):
        optimizers.zero_grad()
        (net(x) ** 2).sum().backward()
        norms.append(clip(list(net.parameters()), max_norm, foreach=True))
        grads = [p.grad.clone() for p in net.parameters()]
        optimizers.step()
    return torch.stack(norms), [p.detach() for p in net.parameters()], grads, optimizers


def torchtitans(optimizers):
    return torchtitan_clip


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_clip_in_the_optimizer_steps_as_torchtitans_clip(optimizer):
    theirs, ours = train(torchtitans, optimizer), train(lambda o: clip_in_optimizer(o, torchtitan_clip), optimizer)
    assert torch.equal(ours[0][0], theirs[0][0])  # the first step's norm: same gradients, same bits
    assert (theirs[0] > MAX_NORM).all(), theirs[0]  # every step clips
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=0)
    for a, b in zip(ours[1], theirs[1]):  # grad / scale against grad * coefficient: a rounding apart
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # torchtitan's clip multiplied the gradients before the step; ours leaves them unclipped
    for mine, clipped in zip(ours[2], theirs[2]):
        assert mine.norm() > clipped.norm()
    assert all(getattr(o, "grad_scale", None) is None for o in ours[3].optimizers)  # cleared by the step


def test_an_optimizer_without_grad_scale_is_clipped_by_torchtitan():
    calls = []

    def spy(*args):
        calls.append(args)
        return torchtitan_clip(*args)

    net = model()
    optimizers = OptimizersContainer([net], torch.optim.AdamW, dict(lr=1e-2, foreach=True))
    (net(torch.randn(8, 16)) ** 2).sum().backward()
    norm = clip_in_optimizer(optimizers, spy)(list(net.parameters()), MAX_NORM, foreach=True)
    assert len(calls) == 1 and norm > MAX_NORM
    total = torch.stack([p.grad.norm() for p in net.parameters()]).norm()
    torch.testing.assert_close(total, torch.tensor(MAX_NORM), rtol=1e-5, atol=0)  # clipped in place
    optimizers.step()  # and the foreach AdamW steps (it refuses a grad_scale)


def test_other_containers_keep_torchtitans_clip():
    # e.g. optimizers that step in backward, before the clip: a grad_scale would reach the next step
    class StepsElsewhere(OptimizersContainer):
        pass

    optimizers = StepsElsewhere([model()], torch.optim.AdamW, dict(lr=1e-2, fused=True))
    assert clip_in_optimizer(optimizers, torchtitan_clip) is torchtitan_clip


# -- every branch of the clip ---------------------------------------------------------------------


def unclipped(optimizer: str, steps: int = 4):
    """The weights of the same steps without any clip."""
    net = model()
    cls, kwargs = OPTIMIZERS[optimizer]
    optimizers = OptimizersContainer([net], cls, kwargs)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizers.zero_grad()
        (net(x) ** 2).sum().backward()
        optimizers.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_norm_below_max_norm_leaves_the_steps_as_without_a_clip(optimizer):
    # max_norm above every step's norm: min(1, max_norm / norm) = 1, so the steps are those of no clip, bit for bit
    # (a scale of exactly 1), never gradients scaled up toward max_norm.
    norms, weights, grads, _ = train(lambda o: clip_in_optimizer(o, torchtitan_clip), optimizer, max_norm=1e4)
    assert (norms < 1e4).all() and (norms > 1.0).all(), norms  # below max_norm, yet far from zero
    for a, b in zip(weights, unclipped(optimizer)):
        assert torch.equal(a, b)
    theirs = train(torchtitans, optimizer, max_norm=1e4)
    assert torch.equal(norms, theirs[0])
    for a, b in zip(weights, theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("side", [0.999, 1.001])
def test_a_norm_a_hair_from_max_norm_clips_as_torchtitan_does(side):
    # The first step's norm, measured, then max_norm 0.1% below it (clips by 0.999) or above it (no clip).
    first = train(torchtitans, "ours_bf16_moments", steps=1)[0][0].item()
    ours = train(lambda o: clip_in_optimizer(o, torchtitan_clip), "ours_bf16_moments", steps=1, max_norm=first * side)
    theirs = train(torchtitans, "ours_bf16_moments", steps=1, max_norm=first * side)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    scale = ours[2][0].norm() / theirs[2][0].norm()  # ours left the gradients unclipped, torchtitan's scaled them
    assert scale.item() == pytest.approx(1 / side if side < 1 else 1.0, rel=1e-5)


@pytest.mark.parametrize("case", ["inf norm", "error_if_nonfinite", "pipeline"])
def test_what_grad_scale_does_not_cover_is_clipped_by_torchtitan(case):
    calls = []

    def spy(*args):
        calls.append(args)
        return torchtitan_clip(*args[:-2], None, args[-1])  # pp_mesh: a stand-in (one process has no PP mesh)

    net = model()
    optimizers = OptimizersContainer([net], AdamW, dict(lr=1e-2, moments_dtype=torch.float32))
    (net(torch.randn(8, 16, generator=torch.Generator().manual_seed(2))) ** 2).sum().backward()
    kwargs = {"inf norm": dict(norm_type=float("inf")), "error_if_nonfinite": dict(error_if_nonfinite=True),
              "pipeline": dict(pp_mesh=object())}[case]
    norm = clip_in_optimizer(optimizers, spy)(list(net.parameters()), MAX_NORM, foreach=True, **kwargs)
    assert len(calls) == 1
    assert all(getattr(o, "grad_scale", None) is None for o in optimizers.optimizers)  # nothing for the step
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])
    norm_type = kwargs.get("norm_type", 2.0)
    assert norm > MAX_NORM
    torch.testing.assert_close(grads.norm(norm_type), torch.tensor(MAX_NORM), rtol=1e-5, atol=0)  # in place


def test_kept_expert_gradients_refuse_torchtitans_clip():
    # torchtitan's clip reads the weights' .grad only: with the experts' gradients on their working copies it would
    # leave them out of the norm and unclipped.
    net = model()
    optimizers = OptimizersContainer([net], AdamW, dict(lr=1e-2, moments_dtype=torch.float32))
    experts = SimpleNamespace(working_gradients=True)
    optimizers.optimizers[0].working_copies = {net[0].weight: (experts, "w13")}
    (net(torch.randn(8, 16)) ** 2).sum().backward()
    clip = clip_in_optimizer(optimizers, torchtitan_clip)
    with pytest.raises(RuntimeError, match="which torchtitan's clip_grad_norm_ does not read: use 'float32'"):
        clip(list(net.parameters()), MAX_NORM, norm_type=float("inf"))


def test_the_norm_without_expert_parallel_dtensors_is_the_plain_norm():
    net = model()
    (net(torch.randn(8, 16)) ** 2).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in net.parameters()]).double().norm()
    for ep_enabled in (False, True):  # EP on, but no parameter on an "ep" mesh: the dense group alone
        norm = total_grad_norm(list(net.parameters()), ep_enabled)
        assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
