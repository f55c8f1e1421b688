"""Packed THD metadata shared by every DSA backend: local queries, gathered global keys.

A packed micro-batch concatenates documents on one token axis. ``cu_seqlens`` (int32 ``[N+1]``) holds the
cumulative *real* token counts; ``cu_seqlens_padded`` (int32 ``[N+1]``, optional) the document boundaries in
the *storage* layout, where each document may be followed by padding (context parallelism pads every
document to a CP multiple). Keys live in that storage layout: row ``j`` of the gathered K/V tensor is the
global padded-storage coordinate ``j``. Under context parallelism each rank owns a contiguous interval of
query rows (``query_indices``) and sees every key.

For local query row ``t`` with global coordinate ``g_t`` in document ``d``:

- ``starts[t]`` is the storage start of ``d``;
- the row is *valid* when ``g_t`` lies in the real part of ``d`` and ``padding_mask[t]`` is not set;
- its eligible keys are the global rows ``[starts[t], starts[t] + causal_lengths[t])`` with
  ``causal_lengths[t] = min(g_t + 1, real_end) - starts[t]`` for valid rows and ``0`` otherwise: same
  document, causal (self included), never a padding key. Every valid row has at least one key.

:func:`prepare_dsa_metadata` builds and validates all of it with exactly one batched device-to-host copy
(21 scalars), once per step; layers reuse the object and :func:`check_dsa_metadata` re-validates it with
host-side attributes only (no synchronization).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CudnnDsaPackedMetadata", "DsaMetadata", "check_dsa_metadata", "mask_ineligible", "prepare_dsa_metadata"]

_INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class CudnnDsaPackedMetadata:
    """Reusable THD metadata for local-query/global-key DSA (every backend, not only cuDNN).

    Per local query row (``T_q`` rows):

    - ``starts``: ``[T_q] int32`` global padded-storage start of the row's document.
    - ``causal_lengths``: ``[T_q] int32`` number of eligible keys (0 for padding rows).
    - ``query_valid``: ``[T_q] bool`` real, non-padding rows.
    - ``valid_row_indices``: ``[T_valid] int64`` positions of valid rows, ``None`` iff every row is valid.

    Per query segment (a maximal run of local rows inside one document, ``S`` segments):

    - ``segment_cu_q``: ``[S+1] int32`` local query offsets of the segments.
    - ``segment_cu_k``: ``[S+1] int32`` offsets of the repacked key prefixes (document start through the
      segment's last query).
    - ``q_causal_offsets``: ``[S] int32`` document-relative position of each segment's first query.
    - ``key_source_indices``: ``[sum key counts] int64`` rows of the gathered K/V that build the segmented
      key tensor; ``None`` for the identity layout (all rows local, CP=1).

    Scalars: ``max_seqlen_q`` / ``max_seqlen_k`` (longest query / key segment), ``total_key_tokens``
    (``T_k``, rows of the gathered padded-storage K/V) and ``all_rows_nonempty`` (every row valid).
    """

    starts: torch.Tensor
    causal_lengths: torch.Tensor
    query_valid: torch.Tensor
    valid_row_indices: torch.Tensor | None
    segment_cu_q: torch.Tensor
    segment_cu_k: torch.Tensor
    q_causal_offsets: torch.Tensor
    key_source_indices: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    total_key_tokens: int
    all_rows_nonempty: bool


#: Backend-neutral name of the metadata class.
DsaMetadata = CudnnDsaPackedMetadata


def _check_layout_tensor(name: str, tensor: torch.Tensor, device: torch.device, shape: torch.Size) -> None:
    if tensor.dim() != 1 or tensor.shape != shape:
        raise ValueError(
            f"{name} must be a 1-D tensor shaped like cu_seqlens {tuple(shape)}, got shape {tuple(tensor.shape)}."
        )
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}; pass tensor.to(torch.int32).")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} like cu_seqlens, got {tensor.device}.")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; pass tensor.contiguous().")


def _validate_inputs(
    cu_seqlens: torch.Tensor,
    total_key_tokens: int,
    max_seqlen: int | torch.Tensor | None,
    query_indices: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
) -> None:
    """Host-only input checks, in the documented order (no device synchronization)."""
    if isinstance(total_key_tokens, bool) or not isinstance(total_key_tokens, int) or total_key_tokens <= 0:
        raise ValueError(f"total_key_tokens must be a positive Python int, got {total_key_tokens!r}.")
    if total_key_tokens >= _INT32_LIMIT:
        raise ValueError(
            f"total_key_tokens={total_key_tokens} does not fit an int32 global index (must be < 2**31 - 1)."
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be a 1-D tensor with at least 2 entries [N+1], got {shape}.")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; pass cu_seqlens.to(torch.int32).")
    if not cu_seqlens.is_contiguous():
        raise ValueError("cu_seqlens must be contiguous; pass cu_seqlens.contiguous().")
    device = cu_seqlens.device
    layout = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    _check_layout_tensor("cu_seqlens_padded", layout, device, cu_seqlens.shape)
    num_queries = total_key_tokens
    if query_indices is not None:
        if query_indices.dim() != 1 or query_indices.numel() == 0:
            raise ValueError(
                f"query_indices must be a non-empty 1-D tensor [T_q], got shape {tuple(query_indices.shape)}."
            )
        if query_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"query_indices must be int32 or int64, got {query_indices.dtype}.")
        if query_indices.device != device or not query_indices.is_contiguous():
            raise ValueError(
                f"query_indices must be contiguous and on {device} like cu_seqlens, got {query_indices.device}"
                f" (contiguous={query_indices.is_contiguous()})."
            )
        num_queries = query_indices.numel()
    if padding_mask is not None:
        if padding_mask.shape != (num_queries,) or padding_mask.dtype != torch.bool:
            raise ValueError(
                f"padding_mask must be a bool tensor of shape ({num_queries},) (one entry per local query row), "
                f"got {padding_mask.dtype} {tuple(padding_mask.shape)}."
            )
        if padding_mask.device != device or not padding_mask.is_contiguous():
            raise ValueError(f"padding_mask must be contiguous and on {device} like cu_seqlens.")
    if isinstance(max_seqlen, torch.Tensor):
        if max_seqlen.numel() != 1 or max_seqlen.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"max_seqlen must be a scalar int32/int64 tensor, got {max_seqlen.dtype} {tuple(max_seqlen.shape)}."
            )
    elif max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)):
        raise TypeError(f"max_seqlen must be an int, a scalar integer tensor or None, got {type(max_seqlen).__name__}.")


def prepare_dsa_metadata(
    cu_seqlens: torch.Tensor,
    total_key_tokens: int,
    max_seqlen: int | torch.Tensor | None = None,
    query_indices: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
) -> CudnnDsaPackedMetadata:
    """Build segmented THD metadata for local queries and gathered global keys, on any device.

    This validation intentionally performs one device-to-host synchronization (a single batched copy of 20
    scalars). Prepare the object once per step (pipeline stage) and reuse it in every indexer and attention
    layer.

    Args:
        cu_seqlens: ``[N+1] int32`` cumulative real-token lengths; starts at 0, strictly increasing.
        total_key_tokens: ``T_k``, rows of the gathered padded-storage key tensor (a positive Python int).
        max_seqlen: optional precomputed longest real document (int or scalar integer tensor); checked.
        query_indices: optional contiguous ``[T_q]`` int32/int64 global padded-storage coordinates of the
            local query rows (one increasing interval). Absent means every key row is a query (CP=1).
        cu_seqlens_padded: optional ``[N+1] int32`` storage-layout boundaries; absent means ``cu_seqlens``.
        padding_mask: optional ``[T_q] bool`` (True = padding row); stays authoritative when packing absorbed
            trailing padding into the last document.

    Returns:
        :class:`CudnnDsaPackedMetadata` with per-query global starts and causal lengths.

    Raises:
        TypeError: wrong dtypes (``cu_seqlens``, layout, ``query_indices``) or a non-integer ``max_seqlen``.
        ValueError: wrong shapes/devices/contiguity, ``total_key_tokens`` invalid (any type), or offsets that
            are not a valid packed layout (checked after the one synchronization).
    """
    _validate_inputs(cu_seqlens, total_key_tokens, max_seqlen, query_indices, cu_seqlens_padded, padding_mask)
    device = cu_seqlens.device
    real = cu_seqlens.to(torch.int64)
    padded = real if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64)
    num_docs = real.numel() - 1
    real_len = real[1:] - real[:-1]
    pad_len = padded[1:] - padded[:-1]
    if query_indices is None:
        g = torch.arange(total_key_tokens, device=device, dtype=torch.int64)
    else:
        g = query_indices.to(torch.int64)
    num_queries = g.numel()

    doc = torch.searchsorted(padded, g, right=True) - 1
    sdoc = doc.clamp(0, num_docs - 1)
    starts = padded[sdoc]
    real_end = starts + real_len[sdoc]
    query_valid = g < real_end
    big = torch.iinfo(torch.int64).max
    first_hole = torch.full((), big, device=device, dtype=torch.int64)
    if padding_mask is not None:
        query_valid = query_valid & ~padding_mask
        # A marked row followed by a real row of the same document would stay an eligible key of that row (a row's
        # keys are a contiguous prefix of its document): marked rows must be a tail of their document.
        hole = padding_mask[:-1] & query_valid[1:] & (doc[:-1] == doc[1:])
        if hole.numel():
            first_hole = torch.where(hole, torch.arange(num_queries - 1, device=device), big).min()

    # Segments are computed per document with fixed-size arithmetic (no data-dependent shapes, so no
    # extra synchronization): document D holds the local queries [max(P[D], g0), min(P[D+1], g_last+1)).
    g0, g_last = g[0], g[-1]
    seg_first = torch.maximum(padded[:-1], g0)
    seg_count = (torch.minimum(padded[1:], g_last + 1) - seg_first).clamp_min(0)
    key_counts = seg_first + seg_count - padded[:-1]
    doc_ids = torch.arange(num_docs, device=device)
    in_range = (doc_ids >= sdoc[0]) & (doc_ids <= sdoc[-1])
    deltas = g[1:] - g[:-1] if num_queries > 1 else torch.ones(1, device=device, dtype=torch.int64)
    if isinstance(max_seqlen, torch.Tensor):
        provided = max_seqlen.reshape(()).to(device=device, dtype=torch.int64)
    elif max_seqlen is not None:
        provided = torch.tensor(max_seqlen, device=device, dtype=torch.int64)
    else:
        provided = real_len.max()
    stats = torch.stack(
        [
            real[0],
            real_len.min(),
            real_len.max(),
            padded[0],
            padded[-1],
            pad_len.min(),
            (pad_len - real_len).min(),
            g0,
            g_last,
            deltas.min(),
            deltas.max(),
            doc.min(),
            doc.max(),
            torch.where(in_range, seg_count, big).min(),
            torch.where(in_range, seg_count, 0).max(),
            torch.where(in_range, key_counts, big).min(),
            torch.where(in_range, key_counts, 0).max(),
            torch.where(in_range, key_counts, 0).sum(),
            provided,
            query_valid.sum(),
            first_hole,
        ]
    ).tolist()  # the single device-to-host synchronization
    (
        r0,
        min_real,
        max_real,
        p0,
        p_last,
        min_pad,
        min_slack,
        first_g,
        last_g,
        min_delta,
        max_delta,
        min_doc,
        max_doc,
        min_seg_q,
        max_seg_q,
        min_seg_k,
        max_seg_k,
        total_seg_k,
        provided_max,
        num_valid,
        hole_row,
    ) = stats

    if r0 != 0 or min_real <= 0:
        raise ValueError(
            "cu_seqlens must start at zero and be strictly increasing (empty documents are not allowed), "
            f"got first={r0}, shortest document={min_real}."
        )
    if p0 != 0 or p_last != total_key_tokens or min_pad <= 0:
        raise ValueError(
            f"cu_seqlens_padded must start at zero, end at total_key_tokens={total_key_tokens} and be strictly "
            f"increasing, got first={p0}, last={p_last}, shortest padded document={min_pad}."
        )
    if min_slack < 0:
        raise ValueError(
            "every padded document must be at least as long as its real document (cu_seqlens_padded[i+1] - "
            "cu_seqlens_padded[i] >= cu_seqlens[i+1] - cu_seqlens[i])."
        )
    if first_g < 0 or last_g >= total_key_tokens or min_delta != 1 or max_delta != 1:
        raise ValueError(
            "query_indices must be one contiguous increasing interval inside the global padded THD layout "
            f"[0, {total_key_tokens}), got first={first_g}, last={last_g}, step range [{min_delta}, {max_delta}]."
        )
    if min_doc < 0 or max_doc >= num_docs:
        raise ValueError(f"query rows fall outside the {num_docs} documents of cu_seqlens_padded.")
    if min_seg_q <= 0 or min_seg_k <= 0:
        raise ValueError("internal: a query segment has no queries or no keys; the packed layout is inconsistent.")
    if provided_max != max_real:
        raise ValueError(f"max_seqlen={provided_max} does not match the longest real document {max_real}.")
    if hole_row != big:
        raise ValueError(
            f"padding_mask marks local row {hole_row} as padding but row {hole_row + 1} of the same document is real: "
            "a padding row there would stay an eligible key of the rows after it. Padding may only be a tail of a "
            "document; drop the padding rows or move them to the document's end (or give them a document of "
            "their own in cu_seqlens_padded)."
        )

    causal_lengths = torch.where(query_valid, torch.minimum(g + 1, real_end) - starts, 0)
    first_doc, last_doc = min_doc, max_doc
    seg_q = seg_count[first_doc : last_doc + 1]
    seg_k = key_counts[first_doc : last_doc + 1]
    seg_start = padded[first_doc : last_doc + 1]
    zero = torch.zeros(1, device=device, dtype=torch.int64)
    segment_cu_q = torch.cat([zero, seg_q.cumsum(0)])
    segment_cu_k = torch.cat([zero, seg_k.cumsum(0)])
    q_causal_offsets = seg_first[first_doc : last_doc + 1] - seg_start

    identity = num_queries == total_key_tokens and first_g == 0 and last_g == total_key_tokens - 1
    key_source_indices = None
    if not identity:
        # Row i of the segmented keys is seg_start[s] + (i - segment_cu_k[s]) for the segment s holding it.
        owner = torch.repeat_interleave(torch.arange(seg_k.numel(), device=device), seg_k, output_size=total_seg_k)
        key_source_indices = (
            seg_start[owner] + torch.arange(total_seg_k, device=device) - segment_cu_k[:-1][owner]
        ).contiguous()

    all_valid = num_valid == num_queries
    valid_row_indices = None
    if not all_valid:
        # A stable sort puts the valid rows first in order; the count is known, so no synchronization.
        order = torch.argsort((~query_valid).to(torch.int8), stable=True)
        valid_row_indices = order[:num_valid].contiguous()

    return CudnnDsaPackedMetadata(
        starts=starts.to(torch.int32).contiguous(),
        causal_lengths=causal_lengths.to(torch.int32).contiguous(),
        query_valid=query_valid.contiguous(),
        valid_row_indices=valid_row_indices,
        segment_cu_q=segment_cu_q.to(torch.int32).contiguous(),
        segment_cu_k=segment_cu_k.to(torch.int32).contiguous(),
        q_causal_offsets=q_causal_offsets.to(torch.int32).contiguous(),
        key_source_indices=key_source_indices,
        max_seqlen_q=int(max_seg_q),
        max_seqlen_k=int(max_seg_k),
        total_key_tokens=total_key_tokens,
        all_rows_nonempty=bool(all_valid),
    )


def _check_tensor(
    name: str, tensor: object, dtype: torch.dtype, shape: tuple[int, ...] | None, device: torch.device
) -> None:
    """Host-side check of one metadata tensor (shape, dtype, device, contiguity)."""
    spec = f"contiguous {str(dtype).removeprefix('torch.')} {shape if shape is not None else '1-D'} on {device}"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"packed {name} must be a {spec} tensor, got {type(tensor).__name__}.")
    bad_shape = tensor.dim() != 1 if shape is None else tuple(tensor.shape) != shape
    if bad_shape or tensor.dtype != dtype or tensor.device != device:
        raise ValueError(f"packed {name} must be {spec}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}.")
    if not tensor.is_contiguous():
        raise ValueError(f"packed {name} must be {spec}, got a non-contiguous tensor.")


def check_dsa_metadata(
    packed_metadata: CudnnDsaPackedMetadata,
    total_query_tokens: int,
    total_key_tokens: int,
    device: torch.device,
) -> CudnnDsaPackedMetadata:
    """Validate reusable packed metadata with host-side attributes only (no device-to-host synchronization).

    Args:
        packed_metadata: the object from :func:`prepare_dsa_metadata`.
        total_query_tokens: expected local query rows ``T_q``.
        total_key_tokens: expected gathered padded-storage key rows ``T_k``.
        device: the device shared by the metadata and the kernel inputs.

    Returns:
        The same object, unchanged.
    """
    if not isinstance(packed_metadata, CudnnDsaPackedMetadata):
        raise TypeError(
            "packed_metadata must be a CudnnDsaPackedMetadata from prepare_dsa_metadata(), "
            f"got {type(packed_metadata).__name__}."
        )
    meta = packed_metadata
    device = torch.device(device)
    rows = (total_query_tokens,)
    _check_tensor("starts", meta.starts, torch.int32, rows, device)
    _check_tensor("causal_lengths", meta.causal_lengths, torch.int32, rows, device)
    _check_tensor("query_valid", meta.query_valid, torch.bool, rows, device)
    if not isinstance(meta.all_rows_nonempty, bool):
        raise TypeError(f"packed all_rows_nonempty must be a Python bool, got {type(meta.all_rows_nonempty).__name__}.")
    if meta.all_rows_nonempty:
        if meta.valid_row_indices is not None:
            raise ValueError("packed valid_row_indices must be None when all_rows_nonempty is True.")
    else:
        if meta.valid_row_indices is None:
            raise ValueError("packed valid_row_indices is required when all_rows_nonempty is False.")
        _check_tensor("valid_row_indices", meta.valid_row_indices, torch.int64, None, device)
    for name in ("segment_cu_q", "segment_cu_k"):
        tensor = getattr(meta, name)
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dim() != 1
            or tensor.numel() < 2
            or tensor.dtype != torch.int32
            or tensor.device != device
        ):
            raise ValueError(f"packed {name} must be a 1-D int32 tensor with at least 2 entries on {device}.")
        if not tensor.is_contiguous():
            raise ValueError(f"packed {name} must be contiguous.")
    if meta.segment_cu_q.shape != meta.segment_cu_k.shape:
        raise ValueError(
            f"packed segment_cu_q {tuple(meta.segment_cu_q.shape)} and segment_cu_k "
            f"{tuple(meta.segment_cu_k.shape)} must have the same shape."
        )
    num_segments = meta.segment_cu_q.numel() - 1
    offsets = meta.q_causal_offsets
    if (
        not isinstance(offsets, torch.Tensor)
        or tuple(offsets.shape) != (num_segments,)
        or offsets.dtype != torch.int32
        or offsets.device != device
        or not offsets.is_contiguous()
    ):
        raise ValueError(f"packed q_causal_offsets must be contiguous int32 ({num_segments},) on {device}.")
    if meta.total_key_tokens != total_key_tokens:
        raise ValueError(
            f"packed metadata was built for total_key_tokens={meta.total_key_tokens}, but the key tensor has "
            f"{total_key_tokens} rows; rebuild it with prepare_dsa_metadata()."
        )
    if meta.max_seqlen_q <= 0 or meta.max_seqlen_k <= 0:
        raise ValueError(
            f"packed max_seqlen_q/max_seqlen_k must be positive, got {meta.max_seqlen_q}/{meta.max_seqlen_k}."
        )
    if meta.key_source_indices is not None:
        _check_tensor("key_source_indices", meta.key_source_indices, torch.int64, None, device)
    return meta


def mask_ineligible(topk: torch.Tensor, metadata: CudnnDsaPackedMetadata) -> torch.Tensor:
    """``topk: [T_q, K] int`` with every index outside its row's eligible keys (``[starts[t], starts[t] +
    causal_lengths[t])``: same document, causal, never padding) replaced by -1, which attention ignores. An
    indexer's own selection comes back unchanged; a top-k from elsewhere (a shared layer's ``prev_topk``) can then
    never attend across documents or into the future. Elementwise, no synchronization."""
    index = topk.to(torch.int64)
    start = metadata.starts.to(torch.int64)[:, None]
    keep = (index >= start) & (index < start + metadata.causal_lengths.to(torch.int64)[:, None])
    return torch.where(keep, index, -1).to(topk.dtype)
