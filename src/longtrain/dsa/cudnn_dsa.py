"""cuDNN and FlashMLA kernels for the split GLM-5.2 DSA path.

The indexer top-k runs on the cuDNN frontend DSA API (``from cudnn import DSA``, package
``nvidia-cudnn-frontend[cutedsl]``): segmented THD scores, then a radix top-k. Sparse MLA attention pairs
FlashMLA's sparse prefill forward (``flash_mla.flash_mla_sparse_fwd``) with the cuDNN sparse-attention
backward. Both need CUDA SM90+ and bf16 tensors with GLM-5.2's fixed widths (indexer head dim 128, latent
query/key 576 = 512 + 64, value 512, top-k <= 2048).

Nothing optional is imported when this module is imported. The providers are module globals resolved on
first use (and looked up at call time, so tests can substitute fakes):

- ``_HAS_CUDNN_DSA`` / ``_CUDNN_DSA``: whether ``cudnn.DSA`` imports, and the namespace itself;
- ``_HAS_FLASH_MLA`` / ``_FLASH_MLA_SPARSE_FWD``: whether FlashMLA imports, and its sparse forward.

``None`` means "not probed yet"; :mod:`longtrain._optional` answers the probe.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from longtrain._autograd import differentiable_once
from longtrain.dsa.metadata import CudnnDsaPackedMetadata, check_dsa_metadata, prepare_dsa_metadata

__all__ = [
    "CudnnDsaPackedMetadata",
    "cudnn_indexer_topk",
    "cudnn_sparse_attention",
    "is_cudnn_dsa_available",
    "prepare_cudnn_dsa_packed_metadata",
]

_ATTENTION_HEAD_DIM = 576
_VALUE_HEAD_DIM = 512
_INDEX_HEAD_DIM = 128
_MAX_TOPK = 2048
_FLASH_MLA_TOPK_ALIGNMENT = 512
_TOPK_ROW_ALIGNMENT = 512
_TOPK_SCRATCH_INT32_FACTOR = 2
_TOPK_SCRATCH_LIMIT_BYTES = 2 * 1024 * 1024 * 1024

_INT32_LIMIT = 2**31 - 1
_INDEXER_HEADS = (32, 64)

_HAS_CUDNN_DSA: bool | None = None
_CUDNN_DSA: Any = None
_HAS_FLASH_MLA: bool | None = None
_FLASH_MLA_SPARSE_FWD: Any = None


def _has_cudnn_dsa() -> bool:
    global _HAS_CUDNN_DSA
    if _HAS_CUDNN_DSA is None:
        from longtrain import _optional

        _HAS_CUDNN_DSA = _optional.cudnn_dsa()[0]
    return bool(_HAS_CUDNN_DSA)


def _has_flash_mla() -> bool:
    global _HAS_FLASH_MLA
    if _HAS_FLASH_MLA is None:
        from longtrain import _optional

        _HAS_FLASH_MLA = _optional.flash_mla()[0]
    return bool(_HAS_FLASH_MLA)


def _cudnn_dsa() -> Any:
    """The ``cudnn.DSA`` namespace (imported on first use).

    Raises ``RuntimeError`` naming why it is unavailable (package missing, or a frontend without ``DSA``), never a
    bare ``ImportError``/``AttributeError`` from inside the private helpers that call it.
    """
    global _CUDNN_DSA
    if _CUDNN_DSA is None:
        try:
            import cudnn

            _CUDNN_DSA = cudnn.DSA
        except (ImportError, AttributeError) as exc:
            from longtrain import _optional

            reason = _optional.cudnn_dsa()[1] or f"{type(exc).__name__}: {exc}"
            raise RuntimeError(
                f"cuDNN DSA is unavailable because {reason}. Install nvidia-cudnn-frontend[cutedsl] or use "
                "backend='triton' or 'torch'."
            ) from exc
    return _CUDNN_DSA


def _flash_mla_sparse_fwd() -> Any:
    """``flash_mla.flash_mla_sparse_fwd`` (imported on first use); ``RuntimeError`` naming why when unavailable."""
    global _FLASH_MLA_SPARSE_FWD
    if _FLASH_MLA_SPARSE_FWD is None:
        try:
            from flash_mla import flash_mla_sparse_fwd
        except ImportError as exc:
            from longtrain import _optional

            reason = _optional.flash_mla()[1] or f"{type(exc).__name__}: {exc}"
            raise RuntimeError(
                f"FlashMLA sparse prefill (flash_mla.flash_mla_sparse_fwd) is unavailable because {reason}. "
                "Use backend='triton' or 'torch'."
            ) from exc
        _FLASH_MLA_SPARSE_FWD = flash_mla_sparse_fwd
    return _FLASH_MLA_SPARSE_FWD


def is_cudnn_dsa_available() -> bool:
    """Return whether both optional libraries required by cuDNN DSA import (cuDNN frontend DSA and FlashMLA)."""
    return bool(_has_cudnn_dsa() and _has_flash_mla())


def unavailable_reason() -> str | None:
    """Why the split path cannot run here (missing package), or ``None``; hardware is checked per call."""
    from longtrain import _optional

    reasons = []
    if not _has_cudnn_dsa():
        reasons.append(_optional.cudnn_dsa()[1] or "cudnn.DSA unavailable")
    if not _has_flash_mla():
        reasons.append(_optional.flash_mla()[1] or "flash_mla.flash_mla_sparse_fwd unavailable")
    return "; ".join(reasons) or None


def _require_available() -> None:
    """Raise when either optional runtime required by the split kernel is absent."""
    if not is_cudnn_dsa_available():
        raise RuntimeError(
            "GLM-5.2 cuDNN DSA requires both nvidia-cudnn-frontend[cutedsl] and FlashMLA with "
            f"flash_mla_sparse_fwd ({unavailable_reason()}). Use backend='triton' or 'torch' instead."
        )


def _require_cuda_tensors(operation: str, *tensors: torch.Tensor) -> tuple[int, int]:
    """Validate that arbitrary-layout input tensors share one SM90+ CUDA device; return its capability."""
    if not tensors or any(not t.is_cuda for t in tensors):
        raise RuntimeError(f"{operation} requires CUDA tensors.")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{operation} requires every tensor on the same CUDA device.")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(f"{operation} requires SM90 or later, got SM{major}{minor}.")
    return major, minor


def _validate_topk(index_topk: int) -> None:
    """Validate GLM-5.2's fixed sparse-selection width: a Python int in ``[1, 2048]``."""
    if isinstance(index_topk, bool) or not isinstance(index_topk, int):
        raise TypeError(f"index_topk must be an int, got {type(index_topk).__name__}.")
    if not 1 <= index_topk <= _MAX_TOPK:
        raise ValueError(f"index_topk must be in [1, {_MAX_TOPK}], got {index_topk}.")


def prepare_cudnn_dsa_packed_metadata(
    cu_seqlens: torch.Tensor,
    total_key_tokens: int,
    max_seqlen: int | torch.Tensor | None = None,
    query_indices: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> CudnnDsaPackedMetadata:
    """Build segmented THD metadata for local queries and gathered global keys.

    This validation intentionally performs one device-to-host synchronization. Prepare the object once per
    pipeline stage and reuse it across every indexer and shared-attention layer. Works on any device.

    Args:
        cu_seqlens: ``[N+1] int32`` cumulative compact real-token lengths.
        total_key_tokens: number of tokens in the gathered, padded THD key tensor.
        max_seqlen: optional precomputed maximum sequence length (int or scalar integer tensor); checked
            against ``cu_seqlens``.
        query_indices: optional contiguous ``[T_q]`` global padded-storage coordinates of the local query
            rows. When absent, queries cover all global key tokens (CP=1).
        cu_seqlens_padded: optional ``[N+1] int32`` padded-storage boundaries; absent means ``cu_seqlens``.
        padding_mask: optional local ``[T_q] bool`` padding mask; authoritative when THD preprocessing
            absorbed trailing pack padding into ``cu_seqlens``.

    Returns:
        Metadata with per-query global padded-storage starts and real causal lengths (see
        :func:`longtrain.dsa.metadata.prepare_dsa_metadata`, which this is).
    """
    return prepare_dsa_metadata(
        cu_seqlens,
        total_key_tokens,
        max_seqlen,
        query_indices=query_indices,
        cu_seqlens_padded=cu_seqlens_padded,
        padding_mask=padding_mask,
    )


def _unpack_packed_metadata(
    packed_metadata: CudnnDsaPackedMetadata,
    total_query_tokens: int,
    total_key_tokens: int,
    device: torch.device,
) -> CudnnDsaPackedMetadata:
    """Validate reusable packed metadata without a CUDA-to-host synchronization; return it unchanged.

    Args:
        packed_metadata: metadata whose per-query fields have shape ``[T_q]`` and whose key-source indices
            address the gathered padded-storage K/V tensor.
        total_query_tokens: expected local query row count ``T_q``.
        total_key_tokens: expected gathered padded-storage K/V row count ``T_k``.
        device: device shared by the metadata and kernel inputs.
    """
    return check_dsa_metadata(packed_metadata, total_query_tokens, total_key_tokens, device)


def _topk_wrapper_chunked(scores: torch.Tensor, seq_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """Select top-k for FP32 scores ``[T, S_max]`` using causal lengths ``[T]`` (int32).

    The radix kernel needs ``_TOPK_SCRATCH_INT32_FACTOR`` int32 words of scratch per score column and row;
    rows are launched in chunks that keep that scratch under ``_TOPK_SCRATCH_LIMIT_BYTES`` (chunks of at
    least ``_TOPK_ROW_ALIGNMENT`` rows are rounded down to a multiple of it). Returns ``[T, topk]`` int32
    row-local column indices in unspecified order (invalid slots may be ``-1``).
    """
    num_rows, width = scores.shape
    scratch_per_row = max(1, width) * 4 * _TOPK_SCRATCH_INT32_FACTOR
    rows = max(1, _TOPK_SCRATCH_LIMIT_BYTES // scratch_per_row)
    if rows >= _TOPK_ROW_ALIGNMENT:
        rows -= rows % _TOPK_ROW_ALIGNMENT
    rows = max(1, min(num_rows, rows))
    dsa = _cudnn_dsa()
    chunks = []
    for begin in range(0, num_rows, rows):
        result = dsa.indexer_top_k_wrapper(
            scores[begin : begin + rows].contiguous(),
            seq_lens[begin : begin + rows].contiguous(),
            top_k=topk,
            next_n=1,
            return_val=False,
        )
        chunks.append(result["indices"])
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)


def _compact_and_sort_indices(indices: torch.Tensor, key_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonicalize global indices ``[T, K]`` and return valid lengths ``[T]``.

    Entries outside ``[0, key_count)`` are invalid. Valid entries move to the front, that prefix is sorted
    ascending, the rest becomes ``-1``; duplicates are kept. Returns ``(int32 [T, K], int32 [T])``, both
    contiguous. Pure device work (no synchronization).
    """
    values = indices.to(torch.int64)
    valid = (values >= 0) & (values < key_count)
    # Invalid entries sort after every valid index (key_count is larger than all of them).
    ordered = torch.where(valid, values, key_count).sort(dim=-1).values
    lengths = valid.sum(dim=-1, dtype=torch.int32)
    canonical = torch.where(ordered < key_count, ordered, -1).to(torch.int32).contiguous()
    return canonical, lengths.contiguous()


def _padded_head_count(num_heads: int, major: int) -> int:
    """Return the FlashMLA-supported head count for one SM generation (64/128 blocks)."""
    if major >= 10:
        if num_heads == 64 or (num_heads < 64 and 64 % num_heads == 0):
            return 64
        if num_heads == 128 or (num_heads < 128 and 128 % num_heads == 0):
            return 128
        if num_heads % 128 == 0:
            return num_heads
        alignment = 128
    else:
        if num_heads % 64 == 0:
            return num_heads
        if num_heads < 64 and 64 % num_heads == 0:
            return 64
        alignment = 64
    raise ValueError(f"FlashMLA sparse prefill requires the query-head count to divide {alignment}, got H={num_heads}.")


def _pad_attention_heads(
    q: torch.Tensor, attn_sink: torch.Tensor, padded_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad query ``[T, H, 576]`` (zeros) and sink ``[H]`` (``-inf``) to ``padded_heads``; no-op when equal."""
    num_heads = q.shape[1]
    if num_heads == padded_heads:
        return q, attn_sink
    q_padded = q.new_zeros((q.shape[0], padded_heads, q.shape[2]))
    q_padded[:, :num_heads] = q
    sink_padded = attn_sink.new_full((padded_heads,), float("-inf"))
    sink_padded[:num_heads] = attn_sink
    return q_padded, sink_padded


def _pad_rows_to_heads(tensor: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """Zero-pad dim 1 (heads) of ``out``/``grad``/``lse`` rows for the cuDNN backward."""
    if tensor.shape[1] == padded_heads:
        return tensor.contiguous()
    padded = tensor.new_zeros((tensor.shape[0], padded_heads, *tensor.shape[2:]))
    padded[:, : tensor.shape[1]] = tensor
    return padded


def _split_forward(
    ctx,
    q,
    kv_latent,
    topk_indices,
    softmax_scale,
    padded_heads,
    topk_length,
    all_rows_nonempty,
    valid_row_indices,
    forward,
) -> torch.Tensor:
    """The body of ``_CudnnSparseAttention.forward`` with the forward kernel given (``flash_mla_sparse_fwd``'s
    call convention), shared with :class:`_CudnnSparseAttentionWithForward`."""
    num_heads = q.shape[1]
    kv = kv_latent.reshape(kv_latent.shape[0], kv_latent.shape[-1]).contiguous()
    if topk_length is None:
        indices, topk_length = _compact_and_sort_indices(topk_indices[:, 0, :], kv.shape[0])
    else:
        indices = topk_indices[:, 0, :]
    width = indices.shape[-1]
    padded_width = -(-width // _FLASH_MLA_TOPK_ALIGNMENT) * _FLASH_MLA_TOPK_ALIGNMENT
    if padded_width != width:
        indices = torch.cat([indices, indices.new_full((indices.shape[0], padded_width - width), -1)], dim=-1)
    indices = indices.contiguous()
    sink = torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=q.device)
    q_padded, sink_padded = _pad_attention_heads(q, sink, padded_heads)
    out, _max_logits, lse = forward(
        q_padded,
        kv[:, None, :],
        indices[:, None, :],
        softmax_scale,
        d_v=_VALUE_HEAD_DIM,
        attn_sink=sink_padded,
        topk_length=topk_length,
        indexer_topk=0,
    )
    out = out[:, :num_heads].contiguous()
    lse = lse[:, :num_heads].contiguous()
    if not all_rows_nonempty:
        out.masked_fill_((topk_length == 0)[:, None, None], 0)
    cached_rows = valid_row_indices if valid_row_indices is not None else q.new_empty((0,), dtype=torch.int64)
    ctx.save_for_backward(q, kv, out, lse, sink, indices.clamp_min(0), topk_length, cached_rows)
    ctx.softmax_scale = softmax_scale
    ctx.padded_heads = padded_heads
    ctx.all_rows_nonempty = all_rows_nonempty
    ctx.has_cached_valid_rows = valid_row_indices is not None
    return out


class _CudnnSparseAttention(torch.autograd.Function):
    """Pair FlashMLA forward with cuDNN backward for latent THD attention."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        kv_latent: torch.Tensor,
        topk_indices: torch.Tensor,
        softmax_scale: float,
        padded_heads: int,
        topk_length: torch.Tensor | None,
        all_rows_nonempty: bool,
        valid_row_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run FlashMLA forward and save tensors required by cuDNN backward.

        Args:
            q: ``[T_q, H, 576]`` CUDA bf16 query.
            kv_latent: ``[T_k, 1, 576]`` CUDA bf16 gathered K/V.
            topk_indices: ``[T_q, 1, K]`` CUDA int32 global padded-storage K/V coordinates with a ``-1`` suffix.
            softmax_scale: scale applied to query-key scores.
            padded_heads: FlashMLA-compatible padded head count.
            topk_length: optional ``[T_q]`` int32 valid-prefix lengths.
            all_rows_nonempty: whether every query has a positive valid prefix.
            valid_row_indices: optional ``[T_valid]`` int64 indices of nonempty queries.

        Returns:
            ``[T_q, H, 512]`` CUDA bf16 latent values.
        """
        return _split_forward(
            ctx, q, kv_latent, topk_indices, softmax_scale, padded_heads, topk_length, all_rows_nonempty,
            valid_row_indices, _flash_mla_sparse_fwd(),
        )  # fmt: skip

    @staticmethod
    @differentiable_once("sparse_mla_attention (cudnn backend)")
    def backward(ctx, grad_output: torch.Tensor):
        """Map output gradients ``[T_q, H, 512]`` bf16 to query ``[T_q, H, 576]`` and latent-KV ``[T_k, 1, 576]``.

        Returns gradients for the eight forward inputs (``None`` for all but ``q`` and ``kv_latent``).
        """
        q, kv, out, lse, sink, indices, topk_length, cached_rows = ctx.saved_tensors
        num_heads = q.shape[1]
        grad_output = grad_output.contiguous()
        rows = None
        if not ctx.all_rows_nonempty:
            rows = cached_rows if ctx.has_cached_valid_rows else torch.nonzero(topk_length > 0).flatten()
        used_dummy = False
        if rows is None:
            q_k, out_k, grad_k, lse_k, idx_k, len_k = q, out, grad_output, lse, indices, topk_length
        elif rows.numel() == 0:
            # A single shape-stable dummy row: zero q/out/grad/lse, key 0, length 1; its dq is discarded.
            used_dummy = True
            q_k = q.new_zeros((1, *q.shape[1:]))
            out_k = out.new_zeros((1, *out.shape[1:]))
            grad_k = grad_output.new_zeros((1, *grad_output.shape[1:]))
            lse_k = lse.new_zeros((1, lse.shape[1]))
            idx_k = indices.new_zeros((1, indices.shape[1]))
            len_k = topk_length.new_ones((1,))
        else:
            q_k, out_k, grad_k = q[rows], out[rows], grad_output[rows]
            lse_k, idx_k, len_k = lse[rows], indices[rows], topk_length[rows]
        q_k, sink_k = _pad_attention_heads(q_k, sink, ctx.padded_heads)
        result = _cudnn_dsa().sparse_attention_backward_wrapper(
            q_k.contiguous(),
            kv,
            _pad_rows_to_heads(out_k, ctx.padded_heads),
            _pad_rows_to_heads(grad_k, ctx.padded_heads),
            _pad_rows_to_heads(lse_k, ctx.padded_heads),
            sink_k,
            idx_k.contiguous(),
            softmax_scale=ctx.softmax_scale,
            topk_length=len_k.contiguous(),
        )
        dq = result["dq"]
        if rows is None:
            grad_q = dq[:, :num_heads].contiguous()
        else:
            grad_q = torch.zeros_like(q)
            if not used_dummy:
                grad_q.index_copy_(0, rows, dq[:, :num_heads].to(q.dtype))
        grad_kv = result["dkv"].reshape(kv.shape[0], 1, kv.shape[1]).contiguous()
        return grad_q, grad_kv, None, None, None, None, None, None


def cudnn_indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    index_topk: int,
    query_indices: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    packed_metadata: CudnnDsaPackedMetadata | None = None,
) -> torch.Tensor:
    """Compute GLM-5.2 packed-THD indexer top-k with cuDNN Frontend.

    Args:
        index_q: rank-local indexer query, ``[T_q, H_I, 128]`` bf16 (``H_I`` in (32, 64)).
        index_k: gathered global indexer key, ``[T_k, 128]`` bf16.
        head_weights: already-scaled per-head weights ``[T_q, H_I]`` fp32 or bf16. The caller owns both
            ``H_I**-0.5`` and ``128**-0.5``; this function does not rescale (it rounds them to bf16).
        cu_seqlens: ``[N+1]`` int32 compact packed-sequence offsets (CUDA).
        index_topk: output width ``K`` in ``[1, 2048]``.
        query_indices: optional contiguous ``[T_q]`` global padded coordinates of the local query rows;
            absent means CP=1 identity coordinates.
        cu_seqlens_padded: optional ``[N+1]`` int32 global padded packed-layout offsets.
        packed_metadata: optional object from :func:`prepare_cudnn_dsa_packed_metadata`; supplying it avoids
            rebuilding and synchronizing the same metadata in every full-indexer layer (the three layout
            arguments are then ignored).

    Returns:
        ``[T_q, 1, K]`` CUDA int32 top-k indices in global padded-storage THD coordinates: row ``t`` holds
        its ``min(K, causal_length)`` selected keys ascending, then ``-1``.

    Raises:
        RuntimeError: if optional kernels, CUDA, or SM90+ are unavailable.
        TypeError: if tensor dtypes or ``index_topk`` are invalid.
        ValueError: if tensor shapes or compact packed metadata are invalid.
    """
    _require_available()
    meta = _validate_indexer(
        index_q, index_k, head_weights, cu_seqlens, index_topk, query_indices, cu_seqlens_padded, packed_metadata
    )
    return _cudnn_indexer_topk_unchecked(index_q, index_k, head_weights, meta, index_topk)


def _validate_indexer(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    index_topk: int,
    query_indices: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    packed_metadata: CudnnDsaPackedMetadata | None,
) -> CudnnDsaPackedMetadata:
    """The documented checks of :func:`cudnn_indexer_topk` after its package check, in order; returns the metadata
    (built, or the given object checked without a synchronization)."""
    _validate_topk(index_topk)
    major, _minor = _require_cuda_tensors("cuDNN DSA indexer", index_q, index_k, head_weights, cu_seqlens)
    if index_q.dtype != torch.bfloat16 or index_k.dtype != torch.bfloat16:
        raise TypeError(f"cuDNN DSA indexer needs bf16 index_q/index_k, got {index_q.dtype}/{index_k.dtype}.")
    if head_weights.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"cuDNN DSA indexer needs fp32 or bf16 head_weights, got {head_weights.dtype}.")
    if index_q.dim() != 3 or index_q.shape[-1] != _INDEX_HEAD_DIM:
        raise ValueError(f"index_q must be [T_q, H_index, {_INDEX_HEAD_DIM}], got {tuple(index_q.shape)}.")
    if index_k.dim() != 2 or index_k.shape[1] != _INDEX_HEAD_DIM:
        raise ValueError(f"index_k must be [T_k, {_INDEX_HEAD_DIM}], got {tuple(index_k.shape)}.")
    if head_weights.shape != index_q.shape[:2]:
        raise ValueError(
            f"head_weights must be [T_q, H_index] = {tuple(index_q.shape[:2])}, got {tuple(head_weights.shape)}."
        )
    if index_q.shape[1] not in _INDEXER_HEADS:
        raise ValueError(f"cuDNN DSA indexer on SM{major} supports H_index in (32, 64), got {index_q.shape[1]}.")
    total_keys = index_k.shape[0]
    if total_keys >= _INT32_LIMIT:
        raise ValueError(f"cuDNN DSA indexer needs T_k < 2**31 - 1 (int32 indices), got {total_keys}.")
    num_queries = index_q.shape[0]
    if packed_metadata is None:
        meta = prepare_dsa_metadata(
            cu_seqlens, total_keys, query_indices=query_indices, cu_seqlens_padded=cu_seqlens_padded
        )
    else:
        meta = _unpack_packed_metadata(packed_metadata, num_queries, total_keys, index_q.device)
    if meta.starts.shape[0] != num_queries:
        raise ValueError(
            f"index_q has {num_queries} rows but the packed layout has {meta.starts.shape[0]} local query rows; "
            "pass query_indices for rank-local queries."
        )
    return meta


def indexer_unfit(
    dtype: torch.dtype, key_dtype: torch.dtype, weight_dtype: torch.dtype, num_heads: int, head_dim: int, major: int
) -> tuple[type[Exception], str] | None:
    """Why the cuDNN indexer cannot take a call of these static facts (exception type and message), else None.

    The constraints of :func:`cudnn_indexer_topk` that ``longtrain.dsa.ops`` evaluates for ``backend="cudnn"``
    (raised) and ``"auto"`` (the next route), on a call whose shapes it has checked already.
    """
    if dtype != torch.bfloat16 or key_dtype != torch.bfloat16:
        return TypeError, f"cuDNN DSA indexer needs bf16 index_q/index_k, got {dtype}/{key_dtype}."
    if weight_dtype not in (torch.float32, torch.bfloat16):
        return TypeError, f"cuDNN DSA indexer needs fp32 or bf16 head_weights, got {weight_dtype}."
    if head_dim != _INDEX_HEAD_DIM:
        return ValueError, f"index_q must be [T_q, H_index, {_INDEX_HEAD_DIM}], got D_I={head_dim}."
    if num_heads not in _INDEXER_HEADS:
        return ValueError, f"cuDNN DSA indexer on SM{major} supports H_index in (32, 64), got {num_heads}."
    return None


def _cudnn_indexer_topk_unchecked(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    meta: CudnnDsaPackedMetadata,
    index_topk: int,
) -> torch.Tensor:
    """The body of :func:`cudnn_indexer_topk` on a validated call and its metadata: ``[T_q, 1, K]`` int32.

    Needs only the cuDNN frontend DSA (FlashMLA is the attention forward's); ``longtrain.dsa.ops`` calls it after
    validating the call once at its own boundary.
    """
    num_queries, total_keys = index_q.shape[0], index_k.shape[0]
    keys = index_k if meta.key_source_indices is None else index_k[meta.key_source_indices]
    scores = _cudnn_dsa().indexer_forward_wrapper(
        index_q.contiguous(),
        keys.reshape(keys.shape[0], 1, _INDEX_HEAD_DIM).contiguous(),
        head_weights.to(torch.bfloat16).contiguous(),
        ratio=1,
        sm_scale=1.0,
        cu_seqlens_q=meta.segment_cu_q,
        cu_seqlens_k=meta.segment_cu_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        q_causal_offsets=meta.q_causal_offsets,
    )["scores"]
    k_eff = min(index_topk, meta.max_seqlen_k)
    if k_eff == meta.max_seqlen_k:
        # K covers every document: every eligible key is selected, no ranking needed.
        local = torch.arange(k_eff, device=index_q.device, dtype=torch.int64).expand(num_queries, k_eff)
    else:
        # Padding rows rank over one column so the ranker never sees a zero length; masked below.
        local = _topk_wrapper_chunked(scores, meta.causal_lengths.clamp_min(1), k_eff).to(torch.int64)
    lengths = meta.causal_lengths.to(torch.int64)[:, None]
    valid = meta.query_valid[:, None] & (local >= 0) & (local < lengths)
    global_idx = torch.where(valid, local + meta.starts.to(torch.int64)[:, None], -1)
    if k_eff < index_topk:
        global_idx = torch.cat([global_idx, global_idx.new_full((num_queries, index_topk - k_eff), -1)], dim=-1)
    canonical, _lengths = _compact_and_sort_indices(global_idx, total_keys)
    return canonical[:, None, :].contiguous()


def _validate_sparse_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    all_rows_nonempty: bool,
    valid_row_indices: torch.Tensor | None,
) -> int:
    """The documented checks of :func:`cudnn_sparse_attention`, in order; returns the padded head count."""
    major, _minor = _require_cuda_tensors("cuDNN DSA sparse attention", q, kv_latent, topk_indices)
    if q.dtype != torch.bfloat16 or kv_latent.dtype != torch.bfloat16:
        raise TypeError(f"cuDNN DSA sparse attention needs bf16 q/kv_latent, got {q.dtype}/{kv_latent.dtype}.")
    if topk_indices.dtype != torch.int32:
        raise TypeError(f"cuDNN DSA sparse attention needs int32 topk_indices, got {topk_indices.dtype}.")
    if q.dim() != 3 or q.shape[-1] != _ATTENTION_HEAD_DIM:
        raise ValueError(f"q must be [T_q, H, {_ATTENTION_HEAD_DIM}], got {tuple(q.shape)}.")
    if kv_latent.dim() != 3 or tuple(kv_latent.shape[1:]) != (1, _ATTENTION_HEAD_DIM):
        raise ValueError(f"kv_latent must be [T_k, 1, {_ATTENTION_HEAD_DIM}], got {tuple(kv_latent.shape)}.")
    num_queries = q.shape[0]
    if topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (num_queries, 1):
        raise ValueError(f"topk_indices must be [{num_queries}, 1, K], got {tuple(topk_indices.shape)}.")
    width = topk_indices.shape[-1]
    if not 1 <= width <= _MAX_TOPK:
        raise ValueError(f"topk_indices width K must be in [1, {_MAX_TOPK}], got {width}.")
    if kv_latent.shape[0] >= _INT32_LIMIT:
        raise ValueError(f"kv_latent must have fewer than 2**31 - 1 rows, got {kv_latent.shape[0]}.")
    if not isinstance(softmax_scale, (float, int)) or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale must be a finite float, got {softmax_scale!r}.")
    if softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}.")
    if not isinstance(all_rows_nonempty, bool):
        raise TypeError(f"all_rows_nonempty must be a bool, got {type(all_rows_nonempty).__name__}.")
    if all_rows_nonempty and valid_row_indices is not None:
        raise ValueError("valid_row_indices must be None when all_rows_nonempty is True (every row is valid).")
    if topk_length is not None:
        if (
            tuple(topk_length.shape) != (num_queries,)
            or topk_length.dtype != torch.int32
            or (topk_length.device != q.device)
        ):
            raise ValueError(
                f"topk_length must be int32 ({num_queries},) on {q.device}, got {topk_length.dtype} "
                f"{tuple(topk_length.shape)} on {topk_length.device}."
            )
        if not topk_length.is_contiguous():
            raise ValueError("topk_length must be contiguous.")
    if valid_row_indices is not None:
        if topk_length is None:
            raise ValueError("valid_row_indices requires topk_length (both come from the packed metadata).")
        if (
            valid_row_indices.dim() != 1
            or valid_row_indices.dtype != torch.int64
            or valid_row_indices.device != q.device
            or not valid_row_indices.is_contiguous()
        ):
            raise ValueError(f"valid_row_indices must be a contiguous 1-D int64 tensor on {q.device}.")
        if valid_row_indices.numel() > num_queries:
            raise ValueError(
                f"valid_row_indices has {valid_row_indices.numel()} entries, more than the {num_queries} query rows."
            )
    return _padded_head_count(q.shape[1], major)


def cudnn_sparse_attention(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run split GLM-5.2 sparse MLA with FlashMLA forward and cuDNN backward.

    Args:
        q: absorbed MLA query, CUDA bf16 ``[T_q, H, 576]`` (``kv_lora_rank + qk_rope_head_dim`` = 512 + 64).
        kv_latent: shared latent key/value, CUDA bf16 ``[T_kv, 1, 576]``.
        topk_indices: global padded-storage K/V indices, CUDA int32 ``[T_q, 1, K]`` with ``-1`` for invalid slots.
        softmax_scale: already-computed MLA attention scale, forwarded unchanged to FlashMLA and cuDNN.
        topk_length: optional int32 ``[T_q]`` valid-prefix lengths prepared once from the packed metadata.
            When supplied, ``topk_indices`` must already hold the indexer's canonical compact ascending prefix.
        all_rows_nonempty: whether every query has a positive valid-prefix length (keeps unpadded inputs on
            the allocation-free backward path).
        valid_row_indices: optional cached int64 row indices whose valid-prefix length is positive.

    Returns:
        ``[T_q, H, 512]`` CUDA bf16 latent output; the caller applies ``W_vc``. Rows without keys are zero.

    Raises:
        RuntimeError: if optional kernels, CUDA, or SM90+ are unavailable.
        TypeError: if compute tensors are not bf16, indices are not int32, or the scale is not finite.
        ValueError: if tensor layouts, dimensions, top-k, or scale are invalid.
    """
    _require_available()
    padded_heads = _validate_sparse_attention(
        q, kv_latent, topk_indices, softmax_scale, topk_length, all_rows_nonempty, valid_row_indices
    )
    return _cudnn_sparse_attention_unchecked(
        q, kv_latent, topk_indices, softmax_scale, padded_heads, topk_length, all_rows_nonempty, valid_row_indices
    )


def _cudnn_sparse_attention_unchecked(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    padded_heads: int,
    topk_length: torch.Tensor | None = None,
    all_rows_nonempty: bool = False,
    valid_row_indices: torch.Tensor | None = None,
    forward_fn: Any = None,
) -> torch.Tensor:
    """The body of :func:`cudnn_sparse_attention` on a validated call (``topk_indices: [T_q, 1, K]`` int32).

    ``forward_fn``: a forward with ``flash_mla_sparse_fwd``'s call convention in FlashMLA's place (``None`` =
    FlashMLA's, looked up at call time). ``longtrain.dsa.ops`` calls this after validating the call once.
    """
    args = (
        q.contiguous(), kv_latent.contiguous(), topk_indices.contiguous(), float(softmax_scale), padded_heads,
        topk_length, all_rows_nonempty, valid_row_indices,
    )  # fmt: skip
    if forward_fn is None:
        return _CudnnSparseAttention.apply(*args)
    return _CudnnSparseAttentionWithForward.apply(*args, forward_fn)


def value_unfit(d_v: int, has_sink: bool) -> tuple[type[Exception], str] | None:
    """Why the split path cannot produce this value width or sink (it is GLM-5.2's: ``d_v = 512``, no sink)."""
    if d_v != _VALUE_HEAD_DIM or has_sink:
        return ValueError, (
            f"backend='cudnn' supports d_v={_VALUE_HEAD_DIM} without attn_sink (GLM-5.2), got d_v={d_v}, "
            f"attn_sink={'given' if has_sink else None}; use backend='triton' or 'torch'."
        )
    return None


def sparse_attention_unfit(
    dtype: torch.dtype, d_qk: int, topk: int, num_heads: int, major: int
) -> tuple[type[Exception], str] | None:
    """Why the split path cannot take ``q: [T_q, num_heads, d_qk]`` of ``dtype`` with ``topk`` slots on SM ``major``.

    The static constraints of :func:`cudnn_sparse_attention` (with :func:`value_unfit`), as ``(exception type,
    message)``, that ``longtrain.dsa.ops`` evaluates for ``backend="cudnn"`` (raised) and ``"auto"`` (the next
    route) on a call whose shapes it has checked already; ``None`` when the path can take it.
    """
    if dtype != torch.bfloat16:
        return TypeError, f"cuDNN DSA sparse attention needs bf16 q/kv_latent, got {dtype}."
    if d_qk != _ATTENTION_HEAD_DIM:
        return ValueError, f"q must be [T_q, H, {_ATTENTION_HEAD_DIM}], got D_qk={d_qk}."
    if not 1 <= topk <= _MAX_TOPK:
        return ValueError, f"topk_indices width K must be in [1, {_MAX_TOPK}], got {topk}."
    try:
        _padded_head_count(num_heads, major)
    except ValueError as exc:
        return ValueError, str(exc)
    return None


def _cudnn_sparse_attention_with_forward(
    q: torch.Tensor,
    kv_latent: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    forward_fn: Any,
) -> torch.Tensor:
    """:func:`cudnn_sparse_attention` with ``forward_fn`` (``flash_mla_sparse_fwd``'s convention) instead of FlashMLA.

    Same validation, head/width padding, row compaction and cuDNN backward; needs only the cuDNN frontend DSA.
    (``longtrain.dsa.ops`` validates at its own boundary and calls :func:`_cudnn_sparse_attention_unchecked`.)
    """
    if not _has_cudnn_dsa():
        _require_available()
    padded_heads = _validate_sparse_attention(q, kv_latent, topk_indices, softmax_scale, None, False, None)
    return _cudnn_sparse_attention_unchecked(
        q, kv_latent, topk_indices, softmax_scale, padded_heads, None, False, None, forward_fn
    )


class _CudnnSparseAttentionWithForward(_CudnnSparseAttention):
    """:class:`_CudnnSparseAttention` with the forward kernel passed in (one more input, no gradient)."""

    @staticmethod
    def forward(ctx, q, kv_latent, topk_indices, softmax_scale, padded_heads, topk_length, all_rows_nonempty,
                valid_row_indices, forward_fn):  # fmt: skip
        return _split_forward(
            ctx, q, kv_latent, topk_indices, softmax_scale, padded_heads, topk_length, all_rows_nonempty,
            valid_row_indices, forward_fn,
        )  # fmt: skip

    @staticmethod
    @differentiable_once("sparse_mla_attention (cudnn backend)")
    def backward(ctx, grad_output: torch.Tensor):
        return (*_CudnnSparseAttention.backward(ctx, grad_output), None)
