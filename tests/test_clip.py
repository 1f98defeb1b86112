"""Gradient clipping folded into the optimizer (optimizer.clip_in_optimizer) against torchtitan's own
clip_grad_norm_ followed by the same optimizer: the same norm, the same step, the gradients left as
they were; torchtitan's clip where an optimizer cannot take a grad_scale. (Under EP, on two meshes:
tests/test_train_cpu.py trains both ways.)"""

import pytest
import torch

from torchtitan_moe.components.optimizer import AdamW, clip_in_optimizer
from torchtitan_moe.compat.torchtitan import _TORCHTITAN_CLIP_GRAD_NORM as torchtitan_clip
from torchtitan_moe.compat.torchtitan import OptimizersContainer

MAX_NORM = 0.5


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


OPTIMIZERS = {
    "torch_fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "ours_bf16_moments": (AdamW, dict(lr=1e-2, moments_dtype=torch.bfloat16)),
}


def train(clip, optimizer: str, steps: int = 4):
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
        norms.append(clip(list(net.parameters()), MAX_NORM, foreach=True))
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
