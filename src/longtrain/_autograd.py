"""First-order-only backwards that refuse a second-order gradient instead of silently dropping a term.

Our attention and exchange backwards are kernels or collectives, not graphs of differentiable torch ops. Run under
``create_graph=True`` (a gradient penalty, double backward, a Hessian-vector product), their gradients would come
back with no graph behind them, and a second-order gradient would silently leave the op's term out. torch's
``once_differentiable`` does not prevent that: it ties the gradients to fresh leaves, so ``torch.autograd.grad(...,
inputs)`` prunes its error node away. :func:`differentiable_once` ties them to the backward's real inputs (the
incoming gradients and the saved tensors) through a node that raises when differentiated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["differentiable_once"]


class _SecondOrder(torch.autograd.Function):
    """The identity on one first-order gradient, linked to the tensors it depends on; its backward raises."""

    @staticmethod
    def forward(ctx, op: str, grad: torch.Tensor, *links: torch.Tensor) -> torch.Tensor:
        ctx.op = op
        return grad.clone()

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.op} is differentiable once: its backward is a fused kernel or a collective, not a graph, so a "
            "second-order gradient through it (create_graph=True: a gradient penalty, double backward, a "
            "Hessian-vector product) cannot be computed. Keep this op out of the part of the model you "
            "differentiate twice, or use its plain-torch reference there."
        )


def differentiable_once(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an ``autograd.Function``'s ``backward``: it runs without recording a graph; when the backward itself
    is being recorded (``create_graph=True``), each gradient it returns is tied to the incoming gradients and the
    saved tensors through a node that raises a ``RuntimeError`` naming ``op`` if differentiated again."""

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grad_outputs: Any) -> Any:
            recording = torch.is_grad_enabled()
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not recording:
                return grads
            sources = (*grad_outputs, *ctx.saved_tensors)
            links = [t for t in sources if isinstance(t, torch.Tensor) and t.requires_grad]
            if not links:
                return grads
            tied = tuple(
                _SecondOrder.apply(op, g, *links) if isinstance(g, torch.Tensor) else g
                for g in (grads if isinstance(grads, tuple) else (grads,))
            )
            return tied if isinstance(grads, tuple) else tied[0]

        return wrapper

    return decorate
