"""``differentiable_once``: a backward that is not a graph refuses a second-order gradient instead of dropping it."""

from __future__ import annotations

import pytest
import torch

from longtrain._autograd import differentiable_once


class _Cube(torch.autograd.Function):
    """``x ** 3`` with a backward computed outside autograd, as a kernel's would be."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.detach() ** 3

    @staticmethod
    @differentiable_once("cube")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 3 * x.detach() ** 2


@pytest.mark.parametrize("loss", ["sum", "square"])
def test_second_order_raises_through_saved_tensors_and_incoming_gradients(loss):
    x = torch.randn(5, requires_grad=True)
    y = _Cube.apply(x)
    out = y.sum() if loss == "sum" else y.square().sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    want = 3 * x.detach() ** 2 if loss == "sum" else 6 * x.detach() ** 5
    torch.testing.assert_close(g, want)
    # torch.autograd.grad(inputs=x) would prune a node tied to fresh leaves; ours sits on the path to x.
    with pytest.raises(RuntimeError, match="cube is differentiable once"):
        torch.autograd.grad(g.sum() + x.square().sum(), x)


def test_first_order_backward_records_nothing():
    x = torch.randn(5, requires_grad=True)
    _Cube.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, 3 * x.detach() ** 2)
    assert x.grad.grad_fn is None
