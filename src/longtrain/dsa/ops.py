"""DSA ops with one contract and interchangeable backends: ``indexer_topk`` and ``sparse_mla_attention``.

``backend`` is one of ``"auto" | "triton" | "cudnn" | "torch"``:

- ``"triton"``: our kernels (:mod:`longtrain.dsa.triton`), CUDA SM80+ (and the Triton interpreter on CPU
  when requested explicitly).
- ``"cudnn"``: the split cuDNN-frontend + FlashMLA path (:mod:`longtrain.dsa.cudnn_dsa`): CUDA SM90+, bf16,
  GLM-5.2 widths only (indexer 32/64 heads x 128, latent 576, value 512, no sink). Where FlashMLA is not
  installed, sparse MLA runs our Triton forward in its place (same call convention) with cuDNN's backward.
- ``"torch"``: the plain-torch reference math applied to row chunks; any device, float32/float64 (and
  bf16/fp16, accumulated in float32). It is the oracle: exact, deterministic, and it synchronizes.
- ``"auto"``: per op and per direction, the fastest route present here that fits the call, from the measured
  table :data:`longtrain.dsa.routes.ROUTE_TABLE`. On an SM90 GPU with the cuDNN frontend installed, a GLM-5.2
  sparse MLA call in bf16 runs our Triton forward and cuDNN's backward; without it (or for shapes cuDNN does not
  take), Triton both ways; on CPU, torch (the interpreter is never picked automatically). ``longtrain doctor``
  prints the choice and the row behind it.

Each call is validated once, here, at the boundary; the backends run through their unchecked bodies
(``sparse_mla_triton_unchecked``, ``_cudnn_sparse_attention_unchecked``, ...). A backend named explicitly that
cannot take the call raises its own error (``RuntimeError`` when it cannot run here, ``TypeError`` /
``ValueError`` for what it does not support).
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import torch

from longtrain._autograd import differentiable_once
from longtrain.dsa import cudnn_dsa, reference, routes
from longtrain.dsa._checks import INT32_LIMIT, check_float, check_int, check_same_device
from longtrain.dsa.cudnn_dsa import _MAX_TOPK as MAX_TOPK
from longtrain.dsa.cudnn_dsa import _validate_topk
from longtrain.dsa.metadata import CudnnDsaPackedMetadata, check_dsa_metadata, prepare_dsa_metadata

__all__ = ["BACKENDS", "MAX_TOPK", "backend_status", "indexer_topk", "sparse_mla_attention"]

BACKENDS = ("auto", "triton", "cudnn", "torch")
#: Elements of the largest intermediate one chunk of the torch backend may materialise.
_TORCH_CHUNK_ELEMENTS = 1 << 25

_TORCH_PLAN = routes.Plan("torch", "torch")
_TRITON_PLAN = routes.Plan("triton", "triton")
_TRITON_DETERMINISTIC_PLAN = routes.Plan("triton", "triton", deterministic=True)


def _triton_module() -> Any:
    return importlib.import_module("longtrain.dsa.triton")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")


def _require_triton(call: routes.CallShape) -> None:
    """``backend="triton"`` named: it must run here and take the call."""
    reason = routes.triton_reason(call.device)
    if reason is not None:
        raise RuntimeError(f"backend='triton' cannot run on {call.device}: {reason}. Use backend='torch' or 'auto'.")
    unfit = routes.route_unfit("triton", call)
    if unfit is not None:
        raise unfit[0](unfit[1])


def _raise_unfit(unfit: tuple[type[Exception], str] | None) -> None:
    if unfit is not None:
        raise unfit[0](unfit[1])


# --------------------------------------------------------------------------------------------- indexer


def indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    index_topk: int,
    *,
    query_indices: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    packed_metadata: CudnnDsaPackedMetadata | None = None,
    backend: str = "auto",
    fp8: bool = False,
) -> torch.Tensor:
    """Lightning-indexer top-k for packed THD input (no gradient: the result is integer).

    Scores ``I[t, s] = sum_h head_weights[t, h] * relu(index_q[t, h] . index_k[s])`` over the eligible keys of
    row ``t`` (same document, causal incl. self, never padding; see :mod:`longtrain.dsa.metadata`).

    Args:
        index_q: ``[T_q, H_I, D_I]`` float, rank-local indexer queries.
        index_k: ``[T_k, D_I]`` float, gathered indexer keys in global padded-storage order.
        head_weights: ``[T_q, H_I]`` float, already scaled (fold ``H_I**-0.5 * D_I**-0.5`` in once).
        cu_seqlens: ``[N+1] int32`` compact real-token offsets (ignored when ``packed_metadata`` is given).
        index_topk: output width ``K`` in ``[1, 2048]``.
        query_indices: optional ``[T_q]`` contiguous global coordinates of the local rows (CP); default all.
        cu_seqlens_padded: optional ``[N+1] int32`` storage-layout offsets.
        packed_metadata: optional prebuilt :func:`~longtrain.dsa.metadata.prepare_dsa_metadata` result;
            avoids the per-call metadata synchronization.
        backend: ``"auto" | "triton" | "cudnn" | "torch"``.
        fp8: score E4M3 codes of ``index_q`` and ``index_k`` (a power-of-two scale per query row and head and per
            key row, :func:`~longtrain.dsa.reference.indexer_fp8_operands`), as DeepSeek-V3.2 runs its indexer:
            the selection is exact for those scores and differs from the unquantized one where scores are close.
            ``triton`` (CUDA SM89+) and ``torch`` routes only; ``auto`` picks among them.

    Returns:
        ``[T_q, K] int32``: row ``t`` holds its ``min(K, causal_length[t])`` selected global key indices in
        ascending order, then ``-1``. Padding rows are all ``-1``. The torch backend breaks equal scores
        toward the smaller key index; other backends may break ties differently.
    """
    _check_backend(backend)
    _validate_topk(index_topk)
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}.")
    check_float("index_q", index_q, "[T_q, H_I, D_I]")
    check_float("index_k", index_k, "[T_k, D_I]")
    check_float("head_weights", head_weights, "[T_q, H_I]")
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T_q, H_I, D_I], got shape {tuple(index_q.shape)}.")
    if index_k.dim() != 2 or index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"index_k must be [T_k, {index_q.shape[2]}] (D_I of index_q), got {tuple(index_k.shape)}.")
    if tuple(head_weights.shape) != tuple(index_q.shape[:2]):
        raise ValueError(
            f"head_weights must be [T_q, H_I] = {tuple(index_q.shape[:2])}, got {tuple(head_weights.shape)}."
        )
    device = index_q.device
    check_same_device(device, "index_q", index_k=index_k, head_weights=head_weights)
    num_queries, num_heads, head_dim = index_q.shape
    if num_heads == 0 or head_dim == 0:
        raise ValueError(
            f"index_q must have at least one head and one dimension, got [T_q, H_I, D_I] = {tuple(index_q.shape)}."
        )
    total_keys = index_k.shape[0]
    if total_keys == 0 or total_keys >= INT32_LIMIT:
        raise ValueError(f"index_k must have between 1 and 2**31 - 2 rows, got {total_keys}.")
    if packed_metadata is None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but index_q is on {device}; move it to {device}.")
    route, call = backend, None
    if backend != "torch":
        call = routes.CallShape(
            "indexer_topk", device, index_q.dtype, num_heads, head_dim, index_topk,
            key_dtype=index_k.dtype, weight_dtype=head_weights.dtype, fp8=fp8,
        )  # fmt: skip
    if backend == "auto":
        route = routes.auto_plan(call).fwd
    elif backend == "cudnn":
        if fp8:
            _raise_unfit(routes.route_unfit("cudnn", call))
        # The indexer uses no FlashMLA kernel: the cuDNN frontend DSA alone is enough.
        if not cudnn_dsa._has_cudnn_dsa():
            from longtrain import _optional

            raise RuntimeError(
                "backend='cudnn' for indexer_topk requires nvidia-cudnn-frontend[cutedsl] "
                f"({_optional.cudnn_dsa()[1] or 'cudnn.DSA unavailable'}). Use backend='triton' or 'torch' instead."
            )
        layout = () if packed_metadata is not None else (cu_seqlens,)
        major, _minor = cudnn_dsa._require_cuda_tensors("cuDNN DSA indexer", index_q, index_k, head_weights, *layout)
        _raise_unfit(routes.route_unfit("cudnn", call, major))

    if packed_metadata is None:
        meta = prepare_dsa_metadata(
            cu_seqlens, total_keys, query_indices=query_indices, cu_seqlens_padded=cu_seqlens_padded
        )
    else:
        meta = check_dsa_metadata(packed_metadata, num_queries, total_keys, device)
    if meta.starts.shape[0] != num_queries:
        raise ValueError(
            f"index_q has {num_queries} rows but the packed layout has {meta.starts.shape[0]} query rows; "
            "pass query_indices with the global coordinates of the local rows."
        )
    if meta.starts.device != device:
        raise ValueError(f"cu_seqlens is on {meta.starts.device} but index_q is on {device}.")
    if route == "cudnn":
        return cudnn_dsa._cudnn_indexer_topk_unchecked(index_q, index_k, head_weights, meta, index_topk)[:, 0, :]
    if route == "triton":
        if backend == "triton":
            _require_triton(call)
        return _triton_module().indexer_topk_triton_unchecked(
            index_q, index_k, head_weights, meta.starts, meta.causal_lengths, index_topk, fp8=fp8
        )
    if fp8:
        # The dequantized codes (exact in float32: power-of-two scales) give the FP8 scores themselves.
        q8, k8, head_weights, k_scale = reference.indexer_fp8_operands(index_q, index_k, head_weights)
        index_q, index_k = q8.to(torch.float32), k8.to(torch.float32) * k_scale[:, None]
    return _indexer_topk_torch(index_q, index_k, head_weights, meta.starts, meta.causal_lengths, index_topk)


def _indexer_topk_torch(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    index_topk: int,
) -> torch.Tensor:
    """The reference top-k applied to row chunks, each over the key window its rows can see."""
    num_queries, num_heads, _ = index_q.shape
    out = torch.full((num_queries, index_topk), -1, dtype=torch.int32, device=index_q.device)
    if num_queries == 0:
        return out
    bounds = torch.stack([starts.to(torch.int64), causal_lengths.to(torch.int64)]).cpu()  # oracle: syncs
    begin_all, length_all = bounds[0], bounds[1]
    end_all = begin_all + length_all
    longest = max(1, int(length_all.max()))
    rows = max(
        1, min(_TORCH_CHUNK_ELEMENTS // (2 * longest * num_heads), math.isqrt(_TORCH_CHUNK_ELEMENTS // num_heads))
    )
    for first in range(0, num_queries, rows):
        last = min(num_queries, first + rows)
        used = length_all[first:last] > 0
        if not bool(used.any()):
            continue
        lo = int(begin_all[first:last][used].min())
        hi = int(end_all[first:last][used].max())
        local = reference.indexer_topk_reference(
            index_q[first:last],
            index_k[lo:hi],
            head_weights[first:last],
            starts[first:last] - lo,
            causal_lengths[first:last],
            index_topk,
        )
        out[first:last] = torch.where(local >= 0, local + lo, -1)
    return out


# --------------------------------------------------------------------------------------------- sparse MLA


def _validate_sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    """Boundary checks of :func:`sparse_mla_attention` (the only ones a call runs); returns the indices ``[T_q, K]``."""
    check_float("q", q, "[T_q, H, D_qk]")
    check_float("kv", kv, "[T_k, 1, D_qk]")
    if q.dim() != 3:
        raise ValueError(f"q must be [T_q, H, D_qk], got shape {tuple(q.shape)}.")
    num_queries, num_heads, width = q.shape
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != width:
        raise ValueError(f"kv must be [T_k, 1, {width}] (one latent head, D_qk of q), got {tuple(kv.shape)}.")
    if kv.dtype != q.dtype:
        raise TypeError(f"q and kv must share a dtype, got {q.dtype} and {kv.dtype}.")
    if kv.shape[0] == 0 or kv.shape[0] >= INT32_LIMIT:
        raise ValueError(f"kv must have between 1 and 2**31 - 2 rows, got {kv.shape[0]}.")
    check_int("topk_indices", topk_indices, "[T_q, K]")
    if topk_indices.dim() == 3 and topk_indices.shape[1] == 1:
        topk_indices = topk_indices[:, 0, :]
    if topk_indices.dim() != 2 or topk_indices.shape[0] != num_queries or topk_indices.shape[1] < 1:
        raise ValueError(
            f"topk_indices must be [{num_queries}, K] or [{num_queries}, 1, K] with K >= 1, "
            f"got {tuple(topk_indices.shape)}."
        )
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float, got {type(softmax_scale).__name__}.")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}.")
    if isinstance(d_v, bool) or not isinstance(d_v, int):
        raise TypeError(f"d_v must be an int, got {type(d_v).__name__}.")
    if not 1 <= d_v <= width:
        raise ValueError(f"d_v must be in [1, D_qk={width}] (the value is kv[..., :d_v]), got {d_v}.")
    if topk_length is not None:
        check_int("topk_length", topk_length, "[T_q]")
        if tuple(topk_length.shape) != (num_queries,):
            raise ValueError(f"topk_length must be [{num_queries}], got {tuple(topk_length.shape)}.")
    if attn_sink is not None:
        check_float("attn_sink", attn_sink, "[H]")
        if tuple(attn_sink.shape) != (num_heads,):
            raise ValueError(f"attn_sink must be [H] = [{num_heads}], got {tuple(attn_sink.shape)}.")
    check_same_device(q.device, kv=kv, topk_indices=topk_indices, topk_length=topk_length, attn_sink=attn_sink)
    return topk_indices


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse MLA attention over per-row selected keys; differentiable in ``q``, ``kv`` and ``attn_sink``.

    Row ``t`` attends to the keys ``topk_indices[t, j]`` for slots ``j < topk_length[t]`` (all slots when
    ``topk_length`` is None) holding an index in ``[0, T_k)``; other slots (``-1``) are ignored, duplicates
    count with multiplicity. ``out[t, h] = sum_j softmax_j(scale * q[t, h] . kv[j]) * kv[j, :d_v]``, with the
    optional per-head sink logit in the softmax denominator (sink value = 0). A row with no valid key gives
    exact zeros and zero gradients, never NaN. Ignored slots contribute nothing whatever the key row they would
    point to holds. A sink of ``+inf`` makes its head's rows 0 (zero gradients, sink included), ``-inf`` is no sink,
    and ``NaN`` makes its head's rows NaN.

    Args:
        q: ``[T_q, H, D_qk]`` float (the absorbed query, e.g. ``[T, 64, 576] bf16``).
        kv: ``[T_k, 1, D_qk]`` float, same dtype (the shared latent K/V; value = first ``d_v`` dims).
        topk_indices: ``[T_q, K]`` or ``[T_q, 1, K]`` int32/int64 global key rows, ``-1`` for unused slots.
        softmax_scale: the logit scale (finite, > 0); pass the model's MLA scale, never a kernel default.
        d_v: value width, ``<= D_qk`` (512 for GLM-5.2).
        topk_length: optional ``[T_q]`` int32/int64 number of leading slots to use, taken as ``clamp(topk_length,
            0, K)`` on every backend (checking the values would cost a synchronization per call).
        attn_sink: optional ``[H]`` float per-head sink logits (``-inf`` = no sink).
        backend: ``"auto" | "triton" | "cudnn" | "torch"``.

    Returns:
        ``[T_q, H, d_v]`` in ``q.dtype``.
    """
    _check_backend(backend)
    indices = _validate_sparse_mla(q, kv, topk_indices, softmax_scale, d_v, topk_length, attn_sink)
    plan = _TORCH_PLAN if backend == "torch" else _sparse_mla_plan(backend, q, kv, indices, d_v, attn_sink)
    if attn_sink is None:
        return _sparse_mla_dispatch(plan, q, kv, indices, softmax_scale, d_v, topk_length, None)
    # Non-finite sinks, the same in every backend: +inf takes all the mass (the head's rows are 0, the sink's
    # gradient 0), NaN is visible (the head's rows are NaN), -inf is no sink. The kernels run on a finite sink.
    posinf, nan = attn_sink == float("inf"), torch.isnan(attn_sink)
    finite_sink = torch.where(posinf | nan, torch.zeros_like(attn_sink), attn_sink)
    out = _sparse_mla_dispatch(plan, q, kv, indices, softmax_scale, d_v, topk_length, finite_sink)
    fill = torch.where(nan, float("nan"), 0.0).to(out.dtype)
    return torch.where((posinf | nan)[None, :, None], fill[None, :, None], out)


def _sparse_mla_plan(backend: str, q, kv, indices, d_v: int, attn_sink) -> routes.Plan:
    """The routes of one validated call: ``"auto"``'s table choice, or the named backend's (its errors raised)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    call = routes.CallShape(
        "sparse_mla", q.device, q.dtype, q.shape[1], q.shape[2], indices.shape[1], d_v, attn_sink is not None,
        deterministic=deterministic,
    )  # fmt: skip
    if backend == "auto":
        return routes.auto_plan(call)
    if backend == "triton":
        _require_triton(call)
        return _TRITON_DETERMINISTIC_PLAN if deterministic else _TRITON_PLAN
    if deterministic:
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(f"sparse_mla_attention(backend='cudnn'): {routes.CUDNN_NOT_DETERMINISTIC}")
        warnings.warn(f"sparse_mla_attention(backend='cudnn'): {routes.CUDNN_NOT_DETERMINISTIC}", stacklevel=3)
    flash_mla = cudnn_dsa._has_flash_mla()
    if not cudnn_dsa._has_cudnn_dsa() or (not flash_mla and routes.triton_reason(call.device) is not None):
        cudnn_dsa._require_available()
    _raise_unfit(cudnn_dsa.value_unfit(call.d_v, call.has_sink))
    major, _minor = cudnn_dsa._require_cuda_tensors("cuDNN DSA sparse attention", q, kv, indices)
    _raise_unfit(cudnn_dsa.sparse_attention_unfit(call.dtype, call.width, call.topk, call.heads, major))
    return routes.Plan("flash_mla" if flash_mla else "triton", "cudnn", major=major)


def _sparse_mla_dispatch(plan, q, kv, indices, softmax_scale, d_v, topk_length, attn_sink):
    """Run ``plan`` on a validated call with a finite (or -inf / absent) sink."""
    if plan.bwd == "cudnn":
        valid = (indices >= 0) & (indices < kv.shape[0]) if indices.dtype == torch.int64 else None
        if topk_length is not None:
            # The split path trusts a supplied length to describe a canonical prefix; masking the slots and
            # letting it canonicalize keeps this op's contract (any -1 positions) exact.
            slot = torch.arange(indices.shape[1], device=indices.device)
            in_len = slot[None, :] < topk_length[:, None]
            valid = in_len if valid is None else valid & in_len
        if valid is not None:
            # (int64 indices past int32 must stay invalid after narrowing, not wrap into a real row.)
            indices = torch.where(valid, indices, -1)
        indices = indices.to(torch.int32)[:, None, :]
        forward = None
        if plan.fwd == "triton":
            forward = importlib.import_module("longtrain.dsa.triton.sparse_mla").flash_mla_style_fwd
        padded_heads = cudnn_dsa._padded_head_count(q.shape[1], plan.major)
        return cudnn_dsa._cudnn_sparse_attention_unchecked(
            q, kv, indices, float(softmax_scale), padded_heads, forward_fn=forward
        )
    if plan.bwd == "triton":
        # Under torch.use_deterministic_algorithms(True) the dkv sum runs in a fixed order (bitwise reproducible).
        return _triton_module().sparse_mla_triton_unchecked(
            q, kv, indices, float(softmax_scale), d_v, topk_length, attn_sink, plan.deterministic
        )
    return _SparseMLATorch.apply(q, kv, indices, float(softmax_scale), d_v, topk_length, attn_sink)


# --------------------------------------------------------------------------------------------- torch backend


def _row_chunks(q: torch.Tensor, indices: torch.Tensor) -> list[slice]:
    """Row slices whose gathered keys ``[R, K, D_qk]`` and logits ``[R, H, K]`` fit the chunk budget."""
    per_row = indices.shape[1] * (q.shape[2] + 2 * q.shape[1])
    rows = max(1, _TORCH_CHUNK_ELEMENTS // per_row)
    return [slice(first, first + rows) for first in range(0, q.shape[0], rows)]


def _reference_rows(
    part: slice,
    q_part: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    lengths = None if topk_length is None else topk_length[part]
    return reference.sparse_mla_reference(
        q_part, kv, indices[part], softmax_scale, d_v=d_v, topk_length=lengths, attn_sink=attn_sink
    )[0]


def sparse_mla_torch_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    """Forward of the torch backend: the reference on row chunks (no graph kept)."""
    out = q.new_empty((q.shape[0], q.shape[1], d_v))
    with torch.no_grad():
        for part in _row_chunks(q, indices):
            out[part] = _reference_rows(part, q[part], kv, indices, softmax_scale, d_v, topk_length, attn_sink)
    return out


def sparse_mla_torch_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward of the torch backend: recompute each row chunk with autograd (activation checkpointing).

    The chunk's keys are gathered outside the graph and their gradient is summed into ``grad_kv`` (float32, or
    float64) by key row: on CPU with ``index_add_`` (serial, so deterministic; differentiating through the gather
    scattered with ``index_put_(accumulate=True)``, 35% of a chunk's time there), on CUDA with
    ``index_put_(accumulate=True)``, which is deterministic where CUDA's ``index_add_`` is not."""
    grad_q = torch.zeros_like(q) if needs[0] else None
    grad_kv = torch.zeros_like(kv, dtype=reference.compute_dtype(q, kv)) if needs[1] else None
    grad_sink = torch.zeros_like(attn_sink) if needs[2] and attn_sink is not None else None
    latent = kv[:, 0].detach().to(reference.compute_dtype(q, kv))  # [T_k, D_qk]
    for part in _row_chunks(q, indices):
        lengths = None if topk_length is None else topk_length[part]
        rows, valid = reference.selected_rows(indices[part], kv.shape[0], lengths)  # [R, K] each
        with torch.enable_grad():
            q_part = q[part].detach().requires_grad_(needs[0])
            keys = latent[rows].requires_grad_(needs[1])  # [R, K, D_qk]
            sink_leaf = None if attn_sink is None else attn_sink.detach().requires_grad_(grad_sink is not None)
            out, _ = reference.sparse_mla_on_keys(q_part, keys, valid, softmax_scale, d_v=d_v, attn_sink=sink_leaf)
            inputs = [
                t for t, need in ((q_part, needs[0]), (keys, needs[1]), (sink_leaf, grad_sink is not None)) if need
            ]
            grads = list(torch.autograd.grad(out, inputs, grad_out[part], allow_unused=True))
        if needs[0]:
            grad_q[part] = grads.pop(0)
        if needs[1]:
            # Only used slots: an unused slot's gradient is exactly 0, and its row is clamped to 0, so keeping them
            # makes key row 0 the target of every unused slot of the chunk (tens of thousands of duplicates, which
            # CUDA's deterministic accumulation walks one by one: most of a step's time at 1K tokens and K = 2048).
            used = valid.reshape(-1)
            flat_rows, flat_grads = rows.reshape(-1)[used], grads.pop(0).reshape(-1, kv.shape[2])[used]
            if grad_kv.is_cuda:
                grad_kv[:, 0].index_put_((flat_rows,), flat_grads, accumulate=True)
            else:
                grad_kv[:, 0].index_add_(0, flat_rows, flat_grads)
        if grad_sink is not None:
            grad_sink += grads.pop(0)
    return grad_q, None if grad_kv is None else grad_kv.to(kv.dtype), grad_sink


class _SparseMLATorch(torch.autograd.Function):
    """Chunked, memory-bounded, exact sparse MLA on plain torch (forward and backward)."""

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, topk_length, attn_sink):
        ctx.save_for_backward(q, kv, indices, topk_length, attn_sink)
        ctx.softmax_scale = softmax_scale
        ctx.d_v = d_v
        return sparse_mla_torch_fwd(q, kv, indices, softmax_scale, d_v, topk_length, attn_sink)

    @staticmethod
    @differentiable_once("sparse_mla_attention (torch backend)")
    def backward(ctx, grad_out):
        q, kv, indices, topk_length, attn_sink = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6])
        grad_q, grad_kv, grad_sink = sparse_mla_torch_bwd(
            grad_out, q, kv, indices, ctx.softmax_scale, ctx.d_v, topk_length, attn_sink, needs
        )
        return grad_q, grad_kv, None, None, None, None, grad_sink


def backend_status() -> list[tuple[str, str | None]]:
    """``(backend, None | reason)`` rows for ``longtrain doctor``, then what ``"auto"`` picks here per op and
    direction and the :data:`~longtrain.dsa.routes.ROUTE_TABLE` row it picks by."""
    from longtrain import _optional

    cuda_ok, cuda_why = _optional.torch_cuda()
    device = torch.device("cuda") if cuda_ok else torch.device("cpu")
    if cuda_ok:
        triton_why = routes.triton_reason(device)
    else:
        triton_why = f"needs CUDA ({cuda_why}); on CPU it runs under TRITON_INTERPRET=1 with backend='triton'"
    rows: list[tuple[str, str | None]] = [
        ("triton", triton_why),
        ("cudnn", routes.cudnn_backend_reason()),
        ("torch", None),
    ]
    return rows + routes.auto_status(device)
