"""Varlen attention providers for block-diagonal (per-document causal) attention.

Every provider implements one contract over *packed* (THD) documents:

- ``q: [n_real, Hq, D]`` (fp16/bf16 for the GPU kernels; any float dtype for ``reference``),
- ``k, v: [T_k, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: K/V heads are never repeated by the fast kernels),
- ``cu_q, cu_k: [n_docs + 1] int32`` cumulative document offsets on the tensors' device, plus the host ints
  ``max_q`` / ``max_k`` (largest query / key segment),
- per-segment causal attention aligned **bottom-right**: query ``j`` of segment ``i`` sees the keys
  ``[0, j + seg_k[i] - seg_q[i]]`` of that segment (only the first segment may have more keys than queries:
  the part of a document that lives on lower context-parallel ranks),
- ``scale`` (``None`` -> ``D ** -0.5``) and ``dropout_p``,
- returns ``[n_real, Hq, D]`` in ``q``'s dtype, differentiable with respect to ``q``, ``k`` and ``v``.

Canonical backend names (``VARLEN_BACKENDS``):

=============  ==========================================================================================
``flash``      ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed (driven through the
               long-prefix guard of :mod:`longtrain.blockdiag_cp.kernels`), otherwise torch's bundled
               FlashAttention-2 (``aten._flash_attention_forward/_backward``, GQA native) on CUDA SM80+.
``cudnn``      the cuDNN frontend (:mod:`longtrain.blockdiag_cp._cudnn_varlen`): its CuTe DSL varlen
               attention when ``nvidia-cudnn-frontend[cutedsl]`` is installed, else cuDNN SDPA over ragged
               documents through the graph API (graphs cached per shape bucket; top-left diagonal + cuDNN's
               backward when every document has as many queries as keys, else bottom-right + our Triton
               backward). CUDA SM90+, no dropout.
``te``         TransformerEngine ``DotProductAttention`` in ``thd`` format (built and cached by
               :func:`longtrain.blockdiag_cp.kernels._te_varlen_dpa`).
``flex``       FlexAttention with a document block mask derived from the segmentation (compiled on CUDA;
               on CPU torch runs its forward eagerly but has no backward).
``reference``  plain torch: one SDPA (math kernel) per document segment. Any float dtype, any device.
               Host-syncs; the CPU workhorse and the oracle.
=============  ==========================================================================================

``"dense"`` (synonym ``"sdpa"``) is not a varlen backend: it is the dense-mask fallback
(:func:`longtrain.blockdiag_cp.kernels.dense_blockdiag_sdpa`). ``"auto"`` resolves with
:func:`resolve_varlen_backend`. Nothing here imports an optional package at module import.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from longtrain import _optional

__all__ = [
    "ATTN_BACKENDS",
    "VARLEN_BACKENDS",
    "backend_status",
    "cudnn_graph_cache_stats",
    "cudnn_varlen_attention",
    "flash_attn_module",
    "flex_blockdiag_attention",
    "reference_varlen_attention",
    "resolve_varlen_backend",
    "torch_flash_varlen",
    "varlen_backend_unavailable_reason",
]

#: Canonical names of the varlen providers, in the order ``"auto"`` prefers them on CUDA.
VARLEN_BACKENDS: tuple[str, ...] = ("cudnn", "flash", "te", "flex", "reference")
#: Every name ``_cp_blockdiag_varlen`` accepts: the varlen providers, the dense fallback and ``"auto"``.
ATTN_BACKENDS: tuple[str, ...] = (*VARLEN_BACKENDS, "dense", "sdpa", "auto")

# Captured once at import: the cp=1 packed path patches ``F.scaled_dot_product_attention``; every stock
# SDPA call of this package goes through this object so the patch can never recurse into itself.
ORIGINAL_SDPA = F.scaled_dot_product_attention

_HALF = (torch.float16, torch.bfloat16)
_FLEX_BLOCK = 128


def resolve_device(device: Any) -> torch.device:
    """``torch.device`` with the CUDA index resolved (``cuda`` -> ``cuda:<current>``) and ``cpu:0`` -> ``cpu``."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    if dev.type == "cpu":
        return torch.device("cpu")
    return dev


def flash_attn_module():
    """The ``flash_attn`` module if installed (or installed into ``sys.modules`` by a test), else None."""
    mod = sys.modules.get("flash_attn")
    if mod is not None:
        return mod
    ok, _ = _optional.flash_attn()
    if not ok:
        return None
    import flash_attn

    return flash_attn


def _torch_flash_reason() -> str | None:
    ok, reason = _optional.torch_varlen()
    return None if ok else reason


def varlen_backend_unavailable_reason(backend: str, dtype: torch.dtype, device: Any) -> str | None:
    """Cheap reason why ``backend`` cannot run for ``(dtype, device)``, or None. Never launches a kernel or syncs.

    ``flash``/``te`` follow the documented order (dtype, then CUDA, then the library); the other backends
    extend it: ``reference`` runs any float dtype anywhere; ``flex`` needs CUDA for training (its CPU
    forward runs, eagerly, but torch has no CPU backward); ``dense`` is not a varlen backend.
    """
    dev = torch.device(device)
    if backend == "reference":
        return None if dtype.is_floating_point else f"reference attention needs a floating dtype, got {dtype}"
    if backend == "flex":
        if dtype not in (*_HALF, torch.float32):
            return f"FlexAttention needs fp16/bf16/fp32, got {dtype}"
        if dev.type == "cpu":
            return f"FlexAttention on CPU in torch {torch.__version__} runs forward only (no backward)"
        if dev.type != "cuda":
            return f"FlexAttention needs CUDA, got device={dev}"
        ok, reason = _optional.triton()
        return None if ok else f"compiled FlexAttention needs triton ({reason})"
    if backend in ("dense", "sdpa"):
        return "dense is not a varlen backend (it builds the [L, S] mask; use the dense fallback)"
    if backend not in VARLEN_BACKENDS:
        return f"unsupported varlen backend={backend!r} (valid: {', '.join(VARLEN_BACKENDS)})"
    if backend == "cudnn":
        from longtrain.blockdiag_cp._cudnn_varlen import cudnn_unavailable_reason

        return cudnn_unavailable_reason(dtype, dev)
    if dtype not in _HALF:
        return f"varlen CP attention needs fp16/bf16, got {dtype}"
    if dev.type != "cuda":
        return f"varlen CP attention requires CUDA, got device={dev}"
    if backend == "flash":
        if flash_attn_module() is not None:
            return None
        torch_reason = _torch_flash_reason()
        if torch_reason is None:
            return None
        return (
            f"flash_attn varlen kernel is unavailable (flash_attn not installed; torch's bundled FA2: {torch_reason})"
        )
    # backend == "te"
    if "transformer_engine" in sys.modules:
        return None
    ok, reason = _optional.transformer_engine()
    return None if ok else f"TransformerEngine varlen kernel is unavailable ({reason})"


def resolve_varlen_backend(name: str, dtype: torch.dtype, device: Any, dropout_p: float = 0.0) -> str:
    """Canonical backend for ``name``; ``"auto"`` picks the fastest available for ``(dtype, device, dropout)``.

    CUDA: the first available of ``cudnn`` (SM90+ with the cuDNN frontend; no dropout), ``flash`` (flash-attn or
    torch's FA2), ``flex`` (no dropout), ``te`` (no dropout), ``reference``. CPU and other devices: ``reference``.
    Any other name is returned unchanged if canonical (``"sdpa"`` maps to ``"dense"``); an unknown name raises
    ``ValueError`` listing the valid ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    if name == "sdpa":
        return "dense"
    if name in VARLEN_BACKENDS or name == "dense":
        return name
    if name != "auto":
        raise ValueError(
            f"unknown block-diagonal varlen backend {name!r}; valid: {', '.join(ATTN_BACKENDS)} "
            "(synonyms such as 'fa2' or 'transformer_engine' are normalised by longtrain.blockdiag_cp.state)"
        )
    if torch.device(device).type == "cuda":
        order = ("cudnn", "flash", "flex", "te") if dropout_p == 0 else ("flash",)
        for cand in order:
            if varlen_backend_unavailable_reason(cand, dtype, device) is None:
                return cand
    return "reference"


def backend_status() -> list[tuple[str, str | None]]:
    """``(backend, None or the reason it cannot run)`` for every backend, for bf16 on the default device."""
    cuda_ok, _ = _optional.torch_cuda()
    device = torch.device("cuda") if cuda_ok else torch.device("cpu")
    rows: list[tuple[str, str | None]] = []
    for name in VARLEN_BACKENDS:
        reason = varlen_backend_unavailable_reason(name, torch.bfloat16, device)
        if reason is not None and name == "flash" and not cuda_ok:
            fa = "flash_attn installed" if flash_attn_module() is not None else "flash_attn not installed"
            reason = f"needs CUDA ({fa}; torch's bundled FA2 varlen needs CUDA SM80+)"
        elif reason is not None and name == "cudnn" and not cuda_ok:
            ok, why = _optional.cudnn_frontend()
            reason = "needs CUDA SM90+" + ("" if ok else f" ({why})")
        elif reason is not None and name == "te" and not cuda_ok:
            ok, why = _optional.transformer_engine()
            reason = "needs CUDA" + ("" if ok else f" ({why})")
        rows.append((name, reason))
        if name == "cudnn" and reason is None:
            rows.append((_cudnn_route_row(device), None))
    rows.append(("dense", None))
    return rows


def _cudnn_route_row(device: torch.device) -> str:
    """Which route the ``cudnn`` backend takes here (for ``longtrain doctor``)."""
    from longtrain.blockdiag_cp._cudnn_flex import flex_unavailable_reason

    probe = torch.empty(1, 8, 128, device=device, dtype=torch.bfloat16)
    why = flex_unavailable_reason(probe, probe)
    return "cudnn route -> CuTe DSL" if why is None else f"cudnn route -> graph API (CuTe DSL: {why})"


# ----------------------------------------------------------------------------------------------------------
# torch's bundled FlashAttention-2 (varlen, GQA native)
# ----------------------------------------------------------------------------------------------------------


def torch_flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale, dropout_p: float):
    """aten FA2 varlen forward. Returns ``(out [n_real, Hq, D], saved tensors for the backward)``."""
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, True, False, scale=scale
    )
    out, lse, rng_a, rng_b = res[0], res[1], res[2], res[3]
    return out, (lse, rng_a, rng_b)


def torch_flash_varlen_bwd(dout, q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k, max_q, max_k, scale, dropout_p):
    """aten FA2 varlen backward -> ``(dq, dk, dv)`` with ``dk``/``dv`` in the K/V head count."""
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, True, rng_a, rng_b, scale=scale
    )
    return dq, dk, dv


class _TorchFlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p, deterministic):
        out, (lse, rng_a, rng_b) = torch_flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p)
        ctx.save_for_backward(q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, dropout_p, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, dropout_p, deterministic = ctx.args
        dout = dout.contiguous()
        force = deterministic and not torch.are_deterministic_algorithms_enabled()
        if force:  # aten's FA2 backward reads torch's global flag; set it for this call only
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            dq, dk, dv = torch_flash_varlen_bwd(
                dout, q, k, v, out, lse, rng_a, rng_b, cu_q, cu_k, max_q, max_k, scale, dropout_p
            )
        finally:
            if force:
                torch.use_deterministic_algorithms(False)
        return dq, dk, dv, None, None, None, None, None, None, None


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
) -> torch.Tensor:
    """Bottom-right causal varlen attention through torch's bundled FA2 (CUDA SM80+, fp16/bf16).

    ``q: [n_real, Hq, D]``, ``k/v: [T_k, Hkv, D]`` contiguous, ``cu_q/cu_k: [n_docs+1] int32``; returns
    ``[n_real, Hq, D]``. GQA is native (no K/V repetition); ``deterministic`` makes the backward
    deterministic.
    """
    return _TorchFlashVarlen.apply(q, k, v, cu_q, cu_k, int(max_q), int(max_k), scale, float(dropout_p), deterministic)


# ----------------------------------------------------------------------------------------------------------
# reference: one SDPA per document segment
# ----------------------------------------------------------------------------------------------------------


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Plain-torch oracle: one math-kernel SDPA per document, bottom-right causal, any float dtype/device.

    ``q: [n_real, Hq, D]``, ``k/v: [T_k, Hkv, D]``, ``cu_q/cu_k: [n_docs+1]`` (read on the host: syncs);
    returns ``[n_real, Hq, D]``. GQA repeats K/V heads per segment. Never builds an ``[L, S]`` mask: the
    largest mask is one segment's ``[seg_q, seg_k]``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cq = cu_q.tolist()
    ck = cu_k.tolist()
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    rep = hq // hkv
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for i in range(len(cq) - 1):
            qs = q[cq[i] : cq[i + 1]].transpose(0, 1)
            ks = k[ck[i] : ck[i + 1]].transpose(0, 1)
            vs = v[ck[i] : ck[i + 1]].transpose(0, 1)
            if rep > 1:
                ks = ks.repeat_interleave(rep, dim=0)
                vs = vs.repeat_interleave(rep, dim=0)
            sq, sk = qs.shape[1], ks.shape[1]
            if sq == sk:
                o = ORIGINAL_SDPA(qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout_p)
            else:
                rows = torch.arange(sq, device=q.device).unsqueeze(1)
                cols = torch.arange(sk, device=q.device).unsqueeze(0)
                o = ORIGINAL_SDPA(qs, ks, vs, attn_mask=cols <= rows + (sk - sq), scale=scale, dropout_p=dropout_p)
            outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


# ----------------------------------------------------------------------------------------------------------
# FlexAttention with a document block mask
# ----------------------------------------------------------------------------------------------------------

_COMPILED_FLEX: dict[str, Any] = {}


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    fn = _COMPILED_FLEX.get("cuda")
    if fn is None:
        fn = torch.compile(flex_attention, dynamic=False)
        _COMPILED_FLEX["cuda"] = fn
    return fn


def _block_stats(doc: torch.Tensor, n_blocks: int, lo: int, hi: int, big: int):
    """Per block of ``_FLEX_BLOCK`` positions: min/max document among valid positions ``[lo, hi)`` etc."""
    bs = _FLEX_BLOCK
    padded = F.pad(doc, (0, n_blocks * bs - doc.numel()), value=-1).view(n_blocks, bs)
    valid = padded >= 0
    dmin = torch.where(valid, padded, big).amin(1)
    dmax = padded.amax(1)
    start = torch.arange(n_blocks, device=doc.device) * bs
    first = start.clamp(min=lo)
    last = (start + bs).clamp(max=hi) - 1
    all_valid = (start >= lo) & (start + bs <= hi)
    return dmin, dmax, first, last, all_valid


def flex_block_mask(meta: dict, query_len: int, key_len: int, device: torch.device):
    """The FlexAttention ``BlockMask`` of one rank's segmentation, built on device without host syncs.

    Query row ``i < n_real`` of segment ``s`` may see key index ``j`` (key index 0 = the first column of the
    K/V tensor the meta indexes) iff ``j`` is in segment ``s`` and ``j <= i + s_first + back`` with
    ``back = (real_end - s_first) - n_real``. Rows ``>= n_real`` see nothing (FlexAttention writes zeros).
    Cached in ``meta["_flex_cache"]`` per (lengths, slice, device).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n_real, s_first, real_end = int(meta["n_real"]), int(meta["s_first"]), int(meta["real_end"])
    cache = meta.setdefault("_flex_cache", {})
    key = (query_len, key_len, n_real, s_first, real_end, id(meta["cu_q"]), id(meta["cu_k"]), str(device))
    hit = cache.get(key)
    if hit is not None:
        return hit
    cu_q = meta["cu_q"].to(device)
    cu_k = meta["cu_k"].to(device)
    n_docs = cu_q.numel() - 1
    ids = torch.arange(n_docs, device=device, dtype=torch.int32)
    doc_q = torch.full((query_len,), -1, dtype=torch.int32, device=device)
    doc_q[:n_real] = torch.repeat_interleave(ids, (cu_q[1:] - cu_q[:-1]).long(), output_size=n_real)
    doc_k = torch.full((key_len,), -2, dtype=torch.int32, device=device)
    doc_k[s_first:real_end] = torch.repeat_interleave(
        ids, (cu_k[1:] - cu_k[:-1]).long(), output_size=real_end - s_first
    )
    offset = s_first + (real_end - s_first) - n_real
    q_lim = torch.arange(query_len, device=device, dtype=torch.int32) + offset

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_k[kv_idx]) & (kv_idx <= q_lim[q_idx])

    bs = _FLEX_BLOCK
    nq, nk = -(-query_len // bs), -(-key_len // bs)
    big = n_docs + 1
    q_min, q_max, q_first, q_last, q_full = _block_stats(doc_q, nq, 0, n_real, big)
    k_min, k_max, k_first, k_last, k_full = _block_stats(doc_k, nk, s_first, real_end, big)
    overlap = torch.maximum(q_min[:, None], k_min[None, :]) <= torch.minimum(q_max[:, None], k_max[None, :])
    any_blk = (q_max >= 0)[:, None] & (k_max >= 0)[None, :] & overlap & (k_first[None, :] <= (q_last + offset)[:, None])
    one_doc = (q_min == q_max)[:, None] & (k_min == k_max)[None, :] & (q_min[:, None] == k_min[None, :])
    full = any_blk & one_doc & q_full[:, None] & k_full[None, :] & (k_last[None, :] <= (q_first + offset)[:, None])
    partial = any_blk & ~full

    def to_kv(blocks: torch.Tensor):
        num = blocks.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~blocks).to(torch.int32), dim=-1, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = to_kv(partial)
    full_num, full_idx = to_kv(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(query_len, key_len)
    )
    cache[key] = block_mask
    return block_mask


def flex_blockdiag_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: dict, *, scale: float | None = None
) -> torch.Tensor:
    """Block-diagonal causal attention of one packed row through FlexAttention, in SDPA layout.

    ``query: [1, Hq, L, D]``, ``key/value: [1, Hkv, S_k, D]`` (the K/V range the meta's
    ``[s_first, real_end)`` slice indexes), any of fp16/bf16/fp32; returns ``[1, Hq, L, D]`` with rows
    ``>= n_real`` exactly zero. No packing copies: FlexAttention reads the SDPA layout directly. On CUDA the
    kernel is ``torch.compile``-d once per process; the block mask is cached inside ``meta``.
    """
    device = query.device
    q_len, k_len = query.shape[2], key.shape[2]
    # Inductor's flex templates find no kernel config for some unaligned lengths (seen: 127 queries over 255
    # keys on torch 2.11); pad both to the block size on CUDA. Padded rows/keys belong to no document.
    q_pad = (-q_len) % _FLEX_BLOCK if device.type == "cuda" else 0
    k_pad = (-k_len) % _FLEX_BLOCK if device.type == "cuda" else 0
    if q_pad:
        query = F.pad(query, (0, 0, 0, q_pad))
    if k_pad:
        key, value = F.pad(key, (0, 0, 0, k_pad)), F.pad(value, (0, 0, 0, k_pad))
    block_mask = flex_block_mask(meta, q_len + q_pad, k_len + k_pad, device)
    gqa = query.shape[1] != key.shape[1]
    if device.type == "cpu":
        if not torch.is_grad_enabled():
            # torch's CPU FlexAttention refuses inputs that require grad even under no_grad (it has no backward)
            query, key, value = query.detach(), key.detach(), value.detach()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention_eager(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out = _flex_fn(device)(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out[:, :, :q_len] if q_pad else out


def flex_attention_eager(*args, **kwargs):
    """torch's eager FlexAttention (CPU forward; materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


def cudnn_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, dropout_p=0.0, deterministic=False,
                           meta=None):  # fmt: skip
    """The ``cudnn`` provider (see :func:`longtrain.blockdiag_cp._cudnn_varlen.cudnn_varlen_attention`)."""
    from longtrain.blockdiag_cp._cudnn_varlen import cudnn_varlen_attention as impl

    return impl(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, dropout_p=dropout_p, deterministic=deterministic,
                meta=meta)  # fmt: skip


def cudnn_graph_cache_stats() -> dict:
    """Hits, misses, entries, hit rate and build seconds of the cuDNN graph cache (``cudnn`` backend)."""
    from longtrain.blockdiag_cp._cudnn_varlen import cudnn_graph_cache_stats as impl

    return impl()


def default_scale(head_dim: int) -> float:
    """The softmax scale every backend uses when ``scale`` is None: ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim)
