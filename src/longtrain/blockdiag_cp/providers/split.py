"""Split providers: one provider's forward with another's backward, for layouts where the fastest kernels differ by
direction (``cudnn_fa4``: the cuDNN CuTe DSL forward, FlashAttention-4's backward; ``fa4_cudnn``: the reverse).

Both libraries compute the natural-log log-sum-exp of the scaled scores in the same ``[Hq, n_real]`` fp32 layout,
so the backward of one reads the forward of the other directly. Each part goes through that library's own
forward / backward entry points (below its autograd wrapper), so these providers are checked against the float64
reference on the GPU (``tests/gpu/test_varlen_gpu.py``) for every library version they are used with.
"""

from __future__ import annotations

import torch

from longtrain._autograd import differentiable_once

from ..meta import VarlenMeta
from . import cudnn, cudnn_cute, fa4

__all__ = ["PARTS", "split_attention", "split_unavailable_reason"]

#: name -> (forward, backward, unavailable_reason) of the parts a split provider combines.
PARTS = {
    "cudnn": (cudnn_cute.cute_forward, cudnn_cute.cute_backward, None),
    "fa4": (fa4.fa4_forward, fa4.fa4_backward, fa4.unavailable_reason),
}


def _cute_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    reason = cudnn.unavailable_reason(dtype, device)
    if reason is None:
        probe = torch.empty(1, 8, 128, device=device, dtype=dtype)
        reason = cudnn_cute.cute_unavailable_reason(probe, probe)
    return reason


def split_unavailable_reason(forward: str, backward: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the ``forward``/``backward`` pair cannot run: the first part that cannot."""
    for part in (forward, backward):
        reason = _cute_reason(dtype, device) if part == "cudnn" else PARTS[part][2](dtype, device)
        if reason is not None:
            return f"{part}: {reason}"
    return None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta, scale, causal, deterministic, forward, backward):
        out, lse = PARTS[forward][0](q, k, v, meta, scale=scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (meta, scale, causal, deterministic, backward)
        return out

    @staticmethod
    @differentiable_once("the split-provider varlen attention")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        meta, scale, causal, deterministic, backward = ctx.args
        dq, dk, dv = PARTS[backward][1](dout.contiguous(), q, k, v, out, lse, meta, scale=scale, causal=causal,
                                        deterministic=deterministic)  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None


def split_attention(
    forward: str,
    backward: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` -> ``[n_real, Hq, D]`` (the provider contract), no dropout."""
    if dropout_p:
        raise ValueError(f"the {forward}_{backward} provider has no attention dropout (got dropout_p={dropout_p})")
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _Split.apply(q, k, v, meta, float(scale), bool(causal), bool(deterministic), forward, backward)
