"""``dense``: one masked SDPA over the whole packed call (the segment mask of :func:`..mask.segment_mask`).

O(n_real · kv_len) memory: a correctness tool and the last resort, available for any float dtype and device.
"""

from __future__ import annotations

import torch

from ..mask import ORIGINAL_SDPA, repeat_kv, segment_mask
from ..meta import VarlenMeta

__all__ = ["SUMMARY", "attention", "unavailable_reason"]

SUMMARY = "one masked SDPA over the packed call (builds the [L, S] mask; any float dtype, any device)"


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    return None if dtype.is_floating_point else f"dense attention needs a floating dtype, got {dtype}"


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
    k, v = repeat_kv(q, k, v)
    mask = segment_mask(meta, q.shape[0], k.shape[0], q.device, causal)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = ORIGINAL_SDPA(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, dropout_p=dropout_p, scale=scale
        )
    return out.transpose(0, 1)
