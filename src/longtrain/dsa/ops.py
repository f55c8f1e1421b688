"""DSA ops with one contract and interchangeable backends: ``indexer_topk`` and ``sparse_mla_attention``.

``backend`` is one of ``"auto" | "triton" | "cudnn" | "torch"``:

- ``"triton"``: our kernels (:mod:`longtrain.dsa.triton`), CUDA SM80+ (and the Triton interpreter on CPU
  when requested explicitly).
- ``"cudnn"``: the split cuDNN-frontend + FlashMLA path (:mod:`longtrain.dsa.cudnn_dsa`): CUDA SM90+, bf16,
  GLM-5.2 widths only (indexer 32/64 heads x 128, latent 576, value 512, no sink). Where FlashMLA is not
  installed, sparse MLA runs our Triton forward in its place (same call convention) with cuDNN's backward.
- ``"torch"``: the plain-torch reference math applied to row chunks; any device, float32/float64 (and
  bf16/fp16, accumulated in float32). It is the oracle: exact, deterministic, and it synchronizes.
- ``"auto"``: on CUDA, triton when available, else cudnn when it can run this call, else torch; on CPU,
  torch (the interpreter is never picked automatically).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from longtrain.dsa import reference
from longtrain.dsa.cudnn_dsa import _MAX_TOPK as MAX_TOPK
from longtrain.dsa.cudnn_dsa import _validate_topk
from longtrain.dsa.metadata import CudnnDsaPackedMetadata, check_dsa_metadata, prepare_dsa_metadata

__all__ = ["BACKENDS", "MAX_TOPK", "backend_status", "indexer_topk", "resolve_backend", "sparse_mla_attention"]

BACKENDS = ("auto", "triton", "cudnn", "torch")
_INT32_LIMIT = 2**31 - 1
#: Elements of the largest intermediate one chunk of the torch backend may materialise.
_TORCH_CHUNK_ELEMENTS = 1 << 25
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _triton_module() -> Any:
    return importlib.import_module("longtrain.dsa.triton")


_TRITON_REASONS: dict[tuple[int, str], str | None] = {}


def _triton_reason(device: torch.device) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (``None`` when they can); cached per module and device."""
    from longtrain import _optional

    ok, why = _optional.triton()
    if not ok:
        return why
    try:
        module = _triton_module()
    except Exception as exc:  # a missing or broken kernel module is a reason, not a crash
        return f"longtrain.dsa.triton failed to import ({type(exc).__name__}: {str(exc)[:160]})"
    key = (id(module), str(device))
    if key not in _TRITON_REASONS:
        try:
            ok, why = module.availability(device)
            _TRITON_REASONS[key] = None if ok else (why or "longtrain.dsa.triton reports it is unavailable")
        except Exception as exc:
            _TRITON_REASONS[key] = f"longtrain.dsa.triton.availability failed ({type(exc).__name__}: {str(exc)[:160]})"
    return _TRITON_REASONS[key]


def _triton_stands_in_for_flash_mla(device: torch.device) -> bool:
    """Whether backend "cudnn" can run sparse MLA here without FlashMLA (cuDNN DSA + our Triton forward)."""
    from longtrain.dsa import cudnn_dsa

    return cudnn_dsa._has_cudnn_dsa() and _triton_reason(device) is None


def _cudnn_reason(device: torch.device | None = None) -> str | None:
    """Why the cuDNN split path cannot run (packages, CUDA, SM90+); ``None`` when it can.

    FlashMLA is needed only where our Triton forward cannot stand in for it (no Triton, or not CUDA SM80+).
    """
    from longtrain import _optional
    from longtrain.dsa import cudnn_dsa

    missing = cudnn_dsa.unavailable_reason()
    if missing and not _triton_stands_in_for_flash_mla(device or torch.device("cuda")):
        return missing
    if device is not None and device.type != "cuda":
        return "needs CUDA tensors"
    ok, why = _optional.cuda_sm(9, 0)
    return None if ok else why


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")


def resolve_backend(backend: str, device: torch.device, cudnn_fits: bool) -> str:
    """The concrete backend for a call on ``device`` (``cudnn_fits``: the call meets cuDNN's constraints)."""
    _check_backend(backend)
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    if _triton_reason(device) is None:
        return "triton"
    if cudnn_fits and _cudnn_reason(device) is None:
        return "cudnn"
    return "torch"


def _require_triton(device: torch.device) -> Any:
    reason = _triton_reason(device)
    if reason is not None:
        raise RuntimeError(f"backend='triton' cannot run on {device}: {reason}. Use backend='torch' or 'auto'.")
    return _triton_module()


def _check_float(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float tensor (bf16, fp16, fp32 or fp64), got {tensor.dtype}.")
    return tensor


def _check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {device}; move every input to one device.")


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

    Returns:
        ``[T_q, K] int32``: row ``t`` holds its ``min(K, causal_length[t])`` selected global key indices in
        ascending order, then ``-1``. Padding rows are all ``-1``. The torch backend breaks equal scores
        toward the smaller key index; other backends may break ties differently.
    """
    _check_backend(backend)
    _validate_topk(index_topk)
    _check_float("index_q", index_q)
    _check_float("index_k", index_k)
    _check_float("head_weights", head_weights)
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T_q, H_I, D_I], got shape {tuple(index_q.shape)}.")
    if index_k.dim() != 2 or index_k.shape[1] != index_q.shape[2]:
        raise ValueError(f"index_k must be [T_k, {index_q.shape[2]}] (D_I of index_q), got {tuple(index_k.shape)}.")
    if tuple(head_weights.shape) != tuple(index_q.shape[:2]):
        raise ValueError(
            f"head_weights must be [T_q, H_I] = {tuple(index_q.shape[:2])}, got {tuple(head_weights.shape)}."
        )
    device = index_q.device
    _check_same_device(device, index_k=index_k, head_weights=head_weights)
    num_queries, num_heads, head_dim = index_q.shape
    total_keys = index_k.shape[0]
    if total_keys == 0 or total_keys >= _INT32_LIMIT:
        raise ValueError(f"index_k must have between 1 and 2**31 - 2 rows, got {total_keys}.")

    cudnn_fits = (
        index_q.dtype == torch.bfloat16
        and index_k.dtype == torch.bfloat16
        and head_dim == 128
        and num_heads in (32, 64)
    )
    chosen = resolve_backend(backend, device, cudnn_fits)
    if chosen == "cudnn":
        from longtrain.dsa import cudnn_dsa

        # The indexer uses no FlashMLA kernel: with the cuDNN frontend DSA alone, skip the split path's check.
        only_cudnn = cudnn_dsa._has_cudnn_dsa() and not cudnn_dsa._has_flash_mla()
        indexer = cudnn_dsa._cudnn_indexer_topk_unchecked if only_cudnn else cudnn_dsa.cudnn_indexer_topk
        out = indexer(
            index_q,
            index_k,
            head_weights,
            cu_seqlens,
            index_topk,
            query_indices=query_indices,
            cu_seqlens_padded=cu_seqlens_padded,
            packed_metadata=packed_metadata,
        )
        return out[:, 0, :]

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
    if chosen == "triton":
        module = _require_triton(device)
        return module.indexer_topk_triton(index_q, index_k, head_weights, meta.starts, meta.causal_lengths, index_topk)
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


def _validate_sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> torch.Tensor:
    """Boundary checks of :func:`sparse_mla_attention`; returns the indices as ``[T_q, K]``."""
    _check_float("q", q)
    _check_float("kv", kv)
    if q.dim() != 3:
        raise ValueError(f"q must be [T_q, H, D_qk], got shape {tuple(q.shape)}.")
    num_queries, num_heads, width = q.shape
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != width:
        raise ValueError(f"kv must be [T_k, 1, {width}] (one latent head, D_qk of q), got {tuple(kv.shape)}.")
    if kv.dtype != q.dtype:
        raise TypeError(f"q and kv must share a dtype, got {q.dtype} and {kv.dtype}.")
    if kv.shape[0] == 0 or kv.shape[0] >= _INT32_LIMIT:
        raise ValueError(f"kv must have between 1 and 2**31 - 2 rows, got {kv.shape[0]}.")
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dtype not in (torch.int32, torch.int64):
        got = topk_indices.dtype if isinstance(topk_indices, torch.Tensor) else type(topk_indices).__name__
        raise TypeError(f"topk_indices must be an int32 or int64 tensor, got {got}.")
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
        if not isinstance(topk_length, torch.Tensor) or topk_length.dtype not in (torch.int32, torch.int64):
            raise TypeError("topk_length must be an int32 or int64 tensor [T_q].")
        if tuple(topk_length.shape) != (num_queries,):
            raise ValueError(f"topk_length must be [{num_queries}], got {tuple(topk_length.shape)}.")
    if attn_sink is not None:
        _check_float("attn_sink", attn_sink)
        if tuple(attn_sink.shape) != (num_heads,):
            raise ValueError(f"attn_sink must be [H] = [{num_heads}], got {tuple(attn_sink.shape)}.")
    _check_same_device(q.device, kv=kv, topk_indices=topk_indices, topk_length=topk_length, attn_sink=attn_sink)
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
        topk_length: optional ``[T_q]`` int32/int64 number of leading slots to use.
        attn_sink: optional ``[H]`` float per-head sink logits (``-inf`` = no sink).
        backend: ``"auto" | "triton" | "cudnn" | "torch"``.

    Returns:
        ``[T_q, H, d_v]`` in ``q.dtype``.
    """
    _check_backend(backend)
    indices = _validate_sparse_mla(q, kv, topk_indices, softmax_scale, d_v, topk_length, attn_sink)
    if attn_sink is None:
        return _sparse_mla_dispatch(q, kv, indices, softmax_scale, d_v, topk_length, None, backend)
    # Non-finite sinks, the same in every backend: +inf takes all the mass (the head's rows are 0, the sink's
    # gradient 0), NaN is visible (the head's rows are NaN), -inf is no sink. The kernels run on a finite sink.
    posinf, nan = attn_sink == float("inf"), torch.isnan(attn_sink)
    finite_sink = torch.where(posinf | nan, torch.zeros_like(attn_sink), attn_sink)
    out = _sparse_mla_dispatch(q, kv, indices, softmax_scale, d_v, topk_length, finite_sink, backend)
    fill = torch.where(nan, float("nan"), 0.0).to(out.dtype)
    return torch.where((posinf | nan)[None, :, None], fill[None, :, None], out)


def _sparse_mla_dispatch(q, kv, indices, softmax_scale, d_v, topk_length, attn_sink, backend):
    """The backends of :func:`sparse_mla_attention` on validated inputs and a finite (or -inf / absent) sink."""
    cudnn_fits = (
        q.dtype == torch.bfloat16
        and q.shape[2] == 576
        and d_v == 512
        and attn_sink is None
        and indices.shape[1] <= MAX_TOPK
        and (q.shape[1] % 64 == 0 or 64 % q.shape[1] == 0)
    )
    chosen = resolve_backend(backend, q.device, cudnn_fits)
    if chosen == "cudnn":
        from longtrain.dsa import cudnn_dsa

        flash_mla = cudnn_dsa._has_flash_mla()
        if not flash_mla and not _triton_stands_in_for_flash_mla(q.device):
            cudnn_dsa._require_available()
        if attn_sink is not None or d_v != 512:
            raise ValueError(
                f"backend='cudnn' supports d_v=512 without attn_sink (GLM-5.2), got d_v={d_v}, "
                f"attn_sink={'given' if attn_sink is not None else None}; use backend='triton' or 'torch'."
            )
        if topk_length is not None:
            # The split path trusts a supplied length to describe a canonical prefix; masking the slots and
            # letting it canonicalize keeps this op's contract (any -1 positions) exact.
            slot = torch.arange(indices.shape[1], device=indices.device)
            indices = torch.where(slot[None, :] < topk_length[:, None], indices, -1)
        indices = indices.to(torch.int32)[:, None, :]
        if flash_mla:
            return cudnn_dsa.cudnn_sparse_attention(q, kv, indices, float(softmax_scale))
        from longtrain.dsa.triton.sparse_mla import flash_mla_style_fwd

        return cudnn_dsa._cudnn_sparse_attention_with_forward(q, kv, indices, float(softmax_scale), flash_mla_style_fwd)
    if chosen == "triton":
        module = _require_triton(q.device)
        return module.sparse_mla_triton(
            q,
            kv,
            indices.to(torch.int32).contiguous(),
            float(softmax_scale),
            d_v=d_v,
            topk_length=topk_length,
            attn_sink=attn_sink,
        )
    return _SparseMLATorch.apply(q, kv, indices, float(softmax_scale), d_v, topk_length, attn_sink)


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
    """Backward of the torch backend: recompute each row chunk with autograd (activation checkpointing)."""
    grad_q = torch.zeros_like(q) if needs[0] else None
    grad_kv = torch.zeros_like(kv) if needs[1] else None
    grad_sink = torch.zeros_like(attn_sink) if needs[2] and attn_sink is not None else None
    for part in _row_chunks(q, indices):
        with torch.enable_grad():
            q_part = q[part].detach().requires_grad_(needs[0])
            kv_leaf = kv.detach().requires_grad_(needs[1])
            sink_leaf = None if attn_sink is None else attn_sink.detach().requires_grad_(grad_sink is not None)
            out = _reference_rows(part, q_part, kv_leaf, indices, softmax_scale, d_v, topk_length, sink_leaf)
            inputs = [
                t for t, need in ((q_part, needs[0]), (kv_leaf, needs[1]), (sink_leaf, grad_sink is not None)) if need
            ]
            grads = list(torch.autograd.grad(out, inputs, grad_out[part], allow_unused=True))
        if needs[0]:
            grad_q[part] = grads.pop(0)
        if needs[1]:
            grad_kv += grads.pop(0)
        if grad_sink is not None:
            grad_sink += grads.pop(0)
    return grad_q, grad_kv, grad_sink


class _SparseMLATorch(torch.autograd.Function):
    """Chunked, memory-bounded, exact sparse MLA on plain torch (forward and backward)."""

    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, topk_length, attn_sink):
        ctx.save_for_backward(q, kv, indices, topk_length, attn_sink)
        ctx.softmax_scale = softmax_scale
        ctx.d_v = d_v
        return sparse_mla_torch_fwd(q, kv, indices, softmax_scale, d_v, topk_length, attn_sink)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, indices, topk_length, attn_sink = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6])
        grad_q, grad_kv, grad_sink = sparse_mla_torch_bwd(
            grad_out, q, kv, indices, ctx.softmax_scale, ctx.d_v, topk_length, attn_sink, needs
        )
        return grad_q, grad_kv, None, None, None, None, grad_sink


def backend_status() -> list[tuple[str, str | None]]:
    """``(backend, None | reason)`` rows for ``longtrain doctor``, plus what ``"auto"`` resolves to here."""
    from longtrain import _optional

    cuda_ok, cuda_why = _optional.torch_cuda()
    device = torch.device("cuda") if cuda_ok else torch.device("cpu")
    if cuda_ok:
        triton_why = _triton_reason(device)
    else:
        triton_why = f"needs CUDA ({cuda_why}); on CPU it runs under TRITON_INTERPRET=1 with backend='triton'"
    cudnn_why = _cudnn_reason()
    if cuda_ok and triton_why is None:
        auto = "triton"
    elif cuda_ok and cudnn_why is None:
        auto = "cudnn (bf16 GLM-5.2 shapes; torch otherwise)"
    else:
        auto = "torch"
    return [("triton", triton_why), ("cudnn", cudnn_why), ("torch", None), (f"auto -> {auto}", None)]
