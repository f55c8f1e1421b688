"""``flex``: FlexAttention with a document block mask built from the segmentation (compiled once on CUDA).

On CPU torch runs FlexAttention's forward eagerly but has no backward, so the provider reports itself
unavailable there for training; its forward is still exercised by the CPU tests.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from longtrain import _optional

from ..meta import VarlenMeta

__all__ = ["SUMMARY", "attention", "flex_block_mask", "unavailable_reason"]

SUMMARY = "FlexAttention with a document block mask (compiled on CUDA; no dropout)"
_HALF = (torch.float16, torch.bfloat16)
_BLOCK = 128
_COMPILED: dict[str, Any] = {}


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    if dtype not in (*_HALF, torch.float32):
        return f"FlexAttention needs fp16/bf16/fp32, got {dtype}"
    if device.type == "cpu":
        return f"FlexAttention on CPU in torch {torch.__version__} runs forward only (no backward)"
    if device.type != "cuda":
        return f"FlexAttention needs CUDA, got device={device}"
    ok, reason = _optional.triton()
    return None if ok else f"compiled FlexAttention needs triton ({reason})"


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    fn = _COMPILED.get("cuda")
    if fn is None:
        fn = _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return fn


def _block_stats(doc: torch.Tensor, n_blocks: int, valid_from: int, valid_to: int, big: int):
    """Per block of ``_BLOCK`` positions: min/max segment over the valid positions ``[valid_from, valid_to)``,
    the first/last valid position, and whether the whole block is valid."""
    padded = F.pad(doc, (0, n_blocks * _BLOCK - doc.numel()), value=-1).view(n_blocks, _BLOCK)
    valid = padded >= 0
    dmin = torch.where(valid, padded, big).amin(1)
    dmax = padded.amax(1)
    start = torch.arange(n_blocks, device=doc.device) * _BLOCK
    first = start.clamp(min=valid_from)
    last = (start + _BLOCK).clamp(max=valid_to) - 1
    full = (start >= valid_from) & (start + _BLOCK <= valid_to)
    return dmin, dmax, first, last, full


def flex_block_mask(meta: VarlenMeta, query_len: int, key_len: int, device: torch.device, causal: bool = True):
    """The FlexAttention ``BlockMask`` of a segmentation, built on device without host syncs, cached in the meta.

    Query row ``i < n_real`` may see key index ``j`` iff both lie in the same segment and, when causal,
    ``j <= q_lim[i]`` (:meth:`VarlenMeta.row_tables`). Rows ``>= n_real`` see nothing (FlexAttention writes zeros).
    """
    from torch.nn.attention.flex_attention import BlockMask

    key = ("flex_block_mask", query_len, key_len, str(device), causal)
    hit = meta.cache.get(key)
    if hit is not None:
        return hit
    doc_q, doc_k, q_lim = meta.row_tables(query_len, key_len, device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return (same & (kv_idx <= q_lim[q_idx])) if causal else same

    nq, nk = -(-query_len // _BLOCK), -(-key_len // _BLOCK)
    big = meta.n_docs + 1
    q_min, q_max, q_first, q_last, q_full = _block_stats(doc_q, nq, 0, meta.n_real, big)
    k_min, k_max, k_first, k_last, k_full = _block_stats(doc_k, nk, meta.s_first, meta.real_end, big)
    lim = F.pad(q_lim, (0, nq * _BLOCK - query_len), value=-1)
    # q_lim never decreases over the real rows (every segment has at least as many keys as queries)
    lim_lo = lim[q_first.clamp(max=max(query_len - 1, 0))]
    lim_hi = lim[q_last.clamp(min=0)]
    overlap = torch.maximum(q_min[:, None], k_min[None, :]) <= torch.minimum(q_max[:, None], k_max[None, :])
    any_blk = (q_max >= 0)[:, None] & (k_max >= 0)[None, :] & overlap
    one_doc = (q_min == q_max)[:, None] & (k_min == k_max)[None, :] & (q_min[:, None] == k_min[None, :])
    full = any_blk & one_doc & q_full[:, None] & k_full[None, :]
    if causal:
        any_blk = any_blk & (k_first[None, :] <= lim_hi[:, None])
        full = full & any_blk & (k_last[None, :] <= lim_lo[:, None])
    partial = any_blk & ~full

    def to_kv(blocks: torch.Tensor):
        num = blocks.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~blocks).to(torch.int32), dim=-1, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = to_kv(partial)
    full_num, full_idx = to_kv(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=_BLOCK, mask_mod=mask_mod, seq_lengths=(query_len, key_len)
    )
    meta.cache[key] = block_mask
    return block_mask


def flex_attention_eager(*args, **kwargs):
    """torch's eager FlexAttention (CPU forward; materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(*args, **kwargs)


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
    """``q: [L, Hq, D]`` (the whole query chunk), ``k/v: [S_k, Hkv, D]`` (the whole key tensor; ``meta`` in their
    coordinates) -> ``[L, Hq, D]``, rows ``>= n_real`` exactly zero (a ``full_rows`` provider).

    Runs in SDPA layout (views, no packing copies). The shapes are the chunk's and the key tensor's, the same at
    every step, so the compiled kernel is reused (a shape per step would recompile until torch's cache limit, then
    run eagerly). On CUDA both lengths are padded to the block size: Inductor's flex templates find no kernel config
    for some unaligned lengths (seen: 127 queries over 255 keys on torch 2.11); padded rows and keys belong to no
    segment.
    """
    if dropout_p:
        raise ValueError(f"FlexAttention has no attention dropout (got dropout_p={dropout_p})")
    device = q.device
    q_len, k_len = q.shape[0], k.shape[0]
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    q_pad = (-q_len) % _BLOCK if device.type == "cuda" else 0
    k_pad = (-k_len) % _BLOCK if device.type == "cuda" else 0
    if q_pad:
        query = F.pad(query, (0, 0, 0, q_pad))
    if k_pad:
        key, value = F.pad(key, (0, 0, 0, k_pad)), F.pad(value, (0, 0, 0, k_pad))
    block_mask = flex_block_mask(meta, q_len + q_pad, k_len + k_pad, device, causal)
    gqa = query.shape[1] != key.shape[1]
    if device.type == "cpu":
        if not torch.is_grad_enabled():
            # torch's CPU FlexAttention refuses inputs that require grad even under no_grad (it has no backward)
            query, key, value = query.detach(), key.detach(), value.detach()
        out = flex_attention_eager(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        out = _flex_fn(device)(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out[0, :, :q_len].transpose(0, 1)
