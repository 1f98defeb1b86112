"""The dispatchers' shared machinery."""

import torch

from torchtitan_moe.dispatch.backward import with_backward


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
