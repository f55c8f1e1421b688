"""``flash``: FlashAttention-2 varlen, from the flash-attn package when installed, else torch's bundled copy.

With flash-attn, a segmentation whose first document straddles in from the left (more keys than queries) runs
that document through fixed-length ``flash_attn_func`` and the rest through one ``flash_attn_varlen_func`` call
(:func:`flash_attn_long_prefix_guard`): some flash-attn builds produced asynchronous illegal accesses for long
packs with an asymmetric first varlen segment, and the guard costs at most one extra launch per call. Without
flash-attn, torch's ``aten._flash_attention_forward/_backward`` (CUDA SM80+, GQA native) runs the same math.
"""

from __future__ import annotations

import sys

import torch

from longtrain import _optional
from longtrain._autograd import differentiable_once

from ..meta import VarlenMeta

__all__ = [
    "SUMMARY",
    "attention",
    "flash_attn_long_prefix_guard",
    "isolates_nonfinite",
    "flash_attn_module",
    "torch_flash_reason",
    "torch_flash_varlen",
    "torch_flash_varlen_bwd",
    "torch_flash_varlen_fwd",
    "unavailable_reason",
]

SUMMARY = "FlashAttention-2 varlen (flash-attn, else torch's bundled FA2; CUDA SM80+, fp16/bf16, dropout)"
_HALF = (torch.float16, torch.bfloat16)


def flash_attn_module():
    """The flash-attn (2.x) module when installed (or placed in ``sys.modules`` by a test), else None.

    A ``flash_attn`` namespace without ``flash_attn_varlen_func`` (what flash-attn-4 alone installs) is not it.
    """
    mod = sys.modules.get("flash_attn")
    if mod is not None and hasattr(mod, "flash_attn_varlen_func"):
        return mod
    ok, _ = _optional.flash_attn()
    if not ok:
        return None
    import flash_attn

    return flash_attn


def torch_flash_reason() -> str | None:
    """Why torch's bundled FA2 varlen op cannot run here, or None."""
    ok, reason = _optional.torch_varlen()
    return None if ok else reason


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Documented order: dtype (fp16/bf16), then CUDA, then the library (flash-attn or torch's FA2)."""
    if dtype not in _HALF:
        return f"varlen CP attention needs fp16/bf16, got {dtype}"
    if device.type != "cuda":
        return f"varlen CP attention requires CUDA, got device={device}"
    if flash_attn_module() is not None:
        return None
    torch_reason = torch_flash_reason()
    if torch_reason is None:
        return None
    return f"flash_attn varlen kernel is unavailable (flash_attn not installed; torch's bundled FA2: {torch_reason})"


def flash_attn_long_prefix_guard(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    first_q: int,
    first_k: int,
    max_tail: int,
    scale: float | None,
    dropout_p: float,
    deterministic: bool,
    causal: bool = True,
) -> torch.Tensor:
    """flash-attn varlen over ``q: [T_q, Hq, D]``, ``k/v: [T_k, Hkv, D]`` with an asymmetric first segment peeled.

    ``first_k <= first_q``: one ``flash_attn_varlen_func`` call, whose output object is returned unchanged.
    Otherwise the first segment runs through ``flash_attn_func`` (bottom-right causal for ``seqlen_k > seqlen_q``,
    flash-attn >= 2.1) and the others through one varlen call over ``cu[1:] - first`` (a device op, no sync)
    with ``max_seqlen = max_tail``. ``flash_attn`` is imported at call time.
    """
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as exc:
        reason = _optional.flash_attn()[1] or str(exc)
        raise type(exc)(
            f"the flash-attn long-prefix guard is unavailable because {reason}; it calls flash-attn 2's "
            "flash_attn_func and flash_attn_varlen_func. Without flash-attn, backend='flash' runs torch's bundled FA2 "
            "through the varlen driver instead.",
            name=exc.name,
        ) from exc

    common = {"dropout_p": dropout_p, "softmax_scale": scale, "causal": causal, "deterministic": deterministic}
    if first_k <= first_q:
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, **common
        )
    head = flash_attn_func(q[:first_q].unsqueeze(0), k[:first_k].unsqueeze(0), v[:first_k].unsqueeze(0), **common)
    head = head.squeeze(0)
    if cu_q.numel() == 2:
        return head
    tail_cu_q = (cu_q[1:] - first_q).contiguous()
    tail_cu_k = (cu_k[1:] - first_k).contiguous()
    if max_tail <= 0:
        max_tail = int((tail_cu_q[1:] - tail_cu_q[:-1]).max())
    tail = flash_attn_varlen_func(
        q[first_q:], k[first_k:], v[first_k:], cu_seqlens_q=tail_cu_q, cu_seqlens_k=tail_cu_k,
        max_seqlen_q=max_tail, max_seqlen_k=max_tail, **common,
    )  # fmt: skip
    return torch.cat([head, tail], dim=0)


# ----------------------------------------------------------------------------------------------------------
# torch's bundled FlashAttention-2 (varlen, GQA native)
# ----------------------------------------------------------------------------------------------------------


def torch_flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, dropout_p: float, causal=True):
    """aten FA2 varlen forward. Returns ``(out [T_q, Hq, D], saved tensors for the backward)``."""
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False, scale=scale
    )
    out, lse, rng_a, rng_b = res[0], res[1], res[2], res[3]
    return out, (lse, rng_a, rng_b)


def torch_flash_varlen_bwd(
    dout, q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k, max_q, max_k, scale, dropout_p, causal=True
):
    """aten FA2 varlen backward -> ``(dq, dk, dv)`` with ``dk``/``dv`` in the K/V head count."""
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, rng_a, rng_b, scale=scale
    )
    return dq, dk, dv


class _TorchFlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p, deterministic, causal):
        out, (lse, rng_a, rng_b) = torch_flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p, causal)
        ctx.save_for_backward(q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, dropout_p, deterministic, causal)
        return out

    @staticmethod
    @differentiable_once("the flash varlen attention")
    def backward(ctx, dout):
        q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, dropout_p, deterministic, causal = ctx.args
        dout = dout.contiguous()
        force = deterministic and not torch.are_deterministic_algorithms_enabled()
        if force:  # aten's FA2 backward reads torch's global flag; set it for this call only
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            dq, dk, dv = torch_flash_varlen_bwd(
                dout, q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k, max_q, max_k, scale, dropout_p, causal
            )
        finally:
            if force:
                torch.use_deterministic_algorithms(False)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def torch_flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    causal: bool = True,
) -> torch.Tensor:
    """Bottom-right causal varlen attention through torch's bundled FA2 (CUDA SM80+, fp16/bf16).

    ``q: [T_q, Hq, D]``, ``k/v: [T_k, Hkv, D]`` contiguous, ``cu_q/cu_k: [N+1] int32``; returns ``[T_q, Hq, D]``.
    GQA is native; ``deterministic`` makes the backward deterministic.
    """
    return _TorchFlashVarlen.apply(
        q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale, float(dropout_p), deterministic, causal
    )


def isolates_nonfinite(q: torch.Tensor, k: torch.Tensor) -> bool:
    """torch's bundled FA2 keeps a non-finite value inside its document (measured on the H200,
    ``tests/gpu/test_isolation_gpu.py``); the flash-attn package's kernels are not measured, so they are wrapped."""
    return flash_attn_module() is None


def attention(
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
    """``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` -> ``[n_real, Hq, D]`` (the provider contract)."""
    if flash_attn_module() is not None:
        return flash_attn_long_prefix_guard(
            q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, first_q=meta.first_q, first_k=meta.first_k,
            max_tail=meta.max_tail if meta.only_first_longer else meta.max_k, scale=scale, dropout_p=dropout_p,
            deterministic=deterministic, causal=causal,
        )  # fmt: skip
    return torch_flash_varlen(
        q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale=scale, dropout_p=dropout_p,
        deterministic=deterministic, causal=causal,
    )  # fmt: skip
