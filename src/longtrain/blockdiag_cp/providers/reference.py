"""``reference``: plain torch, one math-kernel SDPA per document segment. Any float dtype, any device.

The oracle of every other provider and the CPU workhorse. It reads the segment lengths from the metadata's host
ints (no sync) and never builds more than one segment's ``[seg_q, seg_k]`` mask.
"""

from __future__ import annotations

import torch

from ..mask import ORIGINAL_SDPA
from ..meta import VarlenMeta

__all__ = ["SUMMARY", "attention", "reference_varlen_attention", "unavailable_reason"]

SUMMARY = "plain torch: one math-kernel SDPA per document (any float dtype, any device; the oracle)"


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    return None if dtype.is_floating_point else f"reference attention needs a floating dtype, got {dtype}"


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
    from torch.nn.attention import SDPBackend, sdpa_kernel

    del deterministic
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv})")
    rep = hq // hkv
    outs = []
    q0 = k0 = 0
    with sdpa_kernel([SDPBackend.MATH]):
        for sq, sk in zip(meta.seg_q, meta.seg_k):
            qs = q[q0 : q0 + sq].transpose(0, 1)
            ks = k[k0 : k0 + sk].transpose(0, 1)
            vs = v[k0 : k0 + sk].transpose(0, 1)
            q0, k0 = q0 + sq, k0 + sk
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, dim=0), vs.repeat_interleave(rep, dim=0)
            if not causal:
                o = ORIGINAL_SDPA(qs, ks, vs, scale=scale, dropout_p=dropout_p)
            elif sq == sk:
                o = ORIGINAL_SDPA(qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout_p)
            else:
                rows = torch.arange(sq, device=q.device).unsqueeze(1)
                cols = torch.arange(sk, device=q.device).unsqueeze(0)
                o = ORIGINAL_SDPA(qs, ks, vs, attn_mask=cols <= rows + (sk - sq), scale=scale, dropout_p=dropout_p)
            outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """:func:`attention` over raw offsets (read on the host: syncs), for tests of kernels that take ``cu_seqlens``.

    ``q: [T_q, Hq, D]``, ``k/v: [T_k, Hkv, D]``, ``cu_q/cu_k: [N+1]`` with ``cu[0]`` possibly non-zero (the first
    ``cu_q[0]`` query rows and ``cu_k[0]`` keys are skipped); returns ``[cu_q[-1] - cu_q[0], Hq, D]``.
    """
    cq, ck = cu_q.tolist(), cu_k.tolist()
    seg_q = tuple(b - a for a, b in zip(cq[:-1], cq[1:]))
    seg_k = tuple(b - a for a, b in zip(ck[:-1], ck[1:]))
    meta = VarlenMeta(n_real=sum(seg_q), s_first=0, real_end=sum(seg_k), seg_q=seg_q, seg_k=seg_k)
    qs, ks, vs = q[cq[0] : cq[-1]], k[ck[0] : ck[-1]], v[ck[0] : ck[-1]]
    return attention(qs, ks, vs, meta, scale=scale, dropout_p=dropout_p, causal=causal)
