"""The graph route of the ``cudnn`` provider: cuDNN SDPA over ragged (THD) documents through the frontend's graph API.

cuDNN's backward is fast with a top-left diagonal but slow with a bottom-right one, so the diagonal follows the
layout: when every segment has as many queries as keys (the metadata's host ints say so, no sync) the two
alignments coincide and top-left runs with cuDNN's backward; otherwise bottom-right runs with our Triton varlen
backward (:mod:`.triton_varlen_bwd`) or, without Triton, torch's bundled FA2 backward, both fed with cuDNN's output
and log-sum-exp (``BACKWARD`` overrides the choice). The H200 numbers behind that order:
``benchmarks/results/blockdiag_attention_graph_route_2026-11-29.md`` (every diagonal and backward) and
``blockdiag_cudnn_bwd_probe_2026-11-29.md``.

Why not ``aten._cudnn_attention_forward`` with cumulative offsets: on an H200 (torch 2.11, cuDNN 9.19) it rebuilds
its cuDNN graph on every call, identical calls included (its time per call against FA2's:
``benchmarks/results/blockdiag_cudnn_probe_2026-11-29.md``), and aligns its causal diagonal top-left, which is
wrong for a document whose start lives on a lower CP rank. The frontend graph API takes a bottom-right diagonal and
lets us cache graphs.

Graph caching: a cuDNN graph bakes in the batch (number of documents), the maximum segment lengths and, for the
backward, the packed token totals; all vary per step. They are rounded up to buckets (``_bucket``: 4 steps per
octave, so at most ~19% slack) and the document list is padded with zero-length documents, so a training run
reuses a handful of graphs. ``cudnn_graph_cache_stats()`` reports hits, misses and build time. Per-call metadata
(lengths, ragged element offsets) is built on device and cached in the step's metadata: no host syncs per layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from longtrain import _optional
from longtrain._autograd import differentiable_once

from ..meta import VarlenMeta

__all__ = [
    "BACKWARD",
    "cudnn_graph_cache_stats",
    "cudnn_unavailable_reason",
    "graph_attention",
    "note_failure",
    "reset_cudnn_graph_cache",
]

# uids of the graph tensors
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_SEQ_Q, _SEQ_K, _RAG_Q, _RAG_K, _RAG_STATS = 20, 21, 22, 23, 24

_GRAPHS: OrderedDict[tuple, tuple] = OrderedDict()
_GRAPHS_MAX = 256
_CACHE_STATS = {"hits": 0, "misses": 0, "build_s": 0.0}
_LOCK = threading.Lock()
_TLS = threading.local()
logger = logging.getLogger(__name__)
#: ``(what, Hq, Hkv, D, dtype)`` static shapes whose CuTe DSL forward (``what="cute"``) or Triton backward
#: (``"triton"``) raised under the "auto" choice -> the reason; later calls of that shape take the next option.
FAILED: dict[tuple, str] = {}
#: None: try ragged (packed) softmax stats in the backward and fall back to a padded copy if cuDNN refuses.
RAGGED_STATS_BWD: bool | None = None
#: Graph-route backward kernel: "auto" (cuDNN's with a top-left diagonal; with a bottom-right one our Triton
#: backward, else FA2's: the fastest available in each case on an H200, see docs/blockdiag_kernels.md), "triton"
#: (ours, fed with the cuDNN forward's output and log-sum-exp; deterministic), "fa2" (torch's bundled
#: FlashAttention-2 backward, fed the same way) or "cudnn". Triton falls back to FA2 when it cannot run here, FA2
#: to cuDNN when torch has no FA2 kernels or a deterministic backward is requested.
BACKWARD: str = "auto"
_BACKWARDS = ("auto", "triton", "fa2", "cudnn")
_MIN_BACKEND = 90000


def cudnn_unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the cuDNN varlen backend cannot run (dtype, then CUDA SM90+, then the frontend), or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"varlen CP attention needs fp16/bf16, got {dtype}"
    if device.type != "cuda":
        return f"varlen CP attention requires CUDA, got device={device}"
    ok, reason = _optional.cuda_sm(9, 0)
    if not ok:
        return f"cuDNN varlen backend {reason}"
    ok, reason = _optional.cudnn_frontend()
    if not ok:
        return f"cuDNN frontend unavailable: {reason}"
    import cudnn

    version = int(cudnn.backend_version())
    if version < _MIN_BACKEND:
        return f"cuDNN varlen backend needs cuDNN >= 9.0 (ragged offsets, bottom-right diagonal), found {version}"
    return None


def cudnn_graph_cache_stats() -> dict[str, Any]:
    """``{"hits", "misses", "entries", "hit_rate", "build_s"}`` of the process-wide cuDNN graph cache."""
    calls = _CACHE_STATS["hits"] + _CACHE_STATS["misses"]
    return {**_CACHE_STATS, "entries": len(_GRAPHS), "hit_rate": (_CACHE_STATS["hits"] / calls) if calls else None}


def reset_cudnn_graph_cache() -> None:
    """Drop every cached graph and zero the statistics."""
    with _LOCK:
        _GRAPHS.clear()
        _CACHE_STATS.update(hits=0, misses=0, build_s=0.0)


def _bucket(n: int, minimum: int, steps_per_octave: int = 4) -> int:
    """Round ``n`` up to ``minimum`` or to a multiple of ``2**e / steps_per_octave`` with ``2**e < n <= 2**(e+1)``."""
    if n <= minimum:
        return minimum
    base = 1 << ((n - 1).bit_length() - 1)
    step = max(base // steps_per_octave, 1)
    return -(-n // step) * step


def _handle(device: torch.device):
    import cudnn

    handles = getattr(_TLS, "handles", None)
    if handles is None:
        handles = _TLS.handles = {}
    h = handles.get(device)
    if h is None:
        with torch.cuda.device(device):
            h = handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
    return h


def _cached(key: tuple, build):
    hit = _GRAPHS.get(key)
    if hit is not None:
        _CACHE_STATS["hits"] += 1
        return hit
    with _LOCK:
        hit = _GRAPHS.get(key)
        if hit is None:
            t0 = time.perf_counter()
            hit = build()
            _CACHE_STATS["build_s"] += time.perf_counter() - t0
            _CACHE_STATS["misses"] += 1
            _GRAPHS[key] = hit
            while len(_GRAPHS) > _GRAPHS_MAX:
                _GRAPHS.popitem(last=False)
        else:
            _CACHE_STATS["hits"] += 1
    return hit


def _thd_stride(heads: int, seq: int, dim: int) -> list[int]:
    # BHSD descriptor of a packed [T, H, D] tensor; the batch stride is unused (ragged offsets locate documents)
    return [seq * heads * dim, dim, heads * dim, 1]


def _finish(g) -> None:
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def _graph_inputs(g, io, p: dict):
    """q/k/v tensors with ragged offsets and the padding / bottom-right causal mask attributes for graph ``g``."""
    import cudnn

    b, hq, hkv, sq, sk, d = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"]
    i32, i64 = cudnn.data_type.INT32, cudnn.data_type.INT64
    q = g.tensor(name="q", dim=[b, hq, sq, d], stride=_thd_stride(hq, sq, d), data_type=io, uid=_Q)
    k = g.tensor(name="k", dim=[b, hkv, sk, d], stride=_thd_stride(hkv, sk, d), data_type=io, uid=_K)
    v = g.tensor(name="v", dim=[b, hkv, sk, d], stride=_thd_stride(hkv, sk, d), data_type=io, uid=_V)
    one = [1, 1, 1, 1]
    seq_q = g.tensor(name="seq_q", dim=[b, 1, 1, 1], stride=one, data_type=i32, uid=_SEQ_Q)
    seq_k = g.tensor(name="seq_k", dim=[b, 1, 1, 1], stride=one, data_type=i32, uid=_SEQ_K)
    rag_q = g.tensor(name="rag_q", dim=[b + 1, 1, 1, 1], stride=one, data_type=i64, uid=_RAG_Q)
    rag_k = g.tensor(name="rag_k", dim=[b + 1, 1, 1, 1], stride=one, data_type=i64, uid=_RAG_K)
    q.set_ragged_offset(rag_q)
    k.set_ragged_offset(rag_k)
    v.set_ragged_offset(rag_k)
    mask = {"use_padding_mask": True, "seq_len_q": seq_q, "seq_len_kv": seq_k}
    if p["causal"]:
        mask["diagonal_alignment"] = getattr(cudnn.diagonal_alignment, p["align"])
        mask["diagonal_band_right_bound"] = 0
    return q, k, v, rag_q, rag_k, mask


def _new_graph(p: dict, handle):
    """An empty graph with the call's I/O dtype and fp32 intermediates: ``(graph, io_data_type)``."""
    import cudnn

    io = cudnn.data_type.BFLOAT16 if p["dtype"] == torch.bfloat16 else cudnn.data_type.HALF
    g = cudnn.pygraph(
        handle=handle,
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    return g, io


def _build_fwd(p: dict, handle):
    import cudnn

    g, io = _new_graph(p, handle)
    q, k, v, rag_q, _, mask = _graph_inputs(g, io, p)
    b, hq, sq, d = p["B"], p["Hq"], p["Sq"], p["D"]
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=p["scale"], **mask)
    o.set_uid(_O).set_output(True).set_dim([b, hq, sq, d]).set_stride(_thd_stride(hq, sq, d)).set_data_type(io)
    o.set_ragged_offset(rag_q)
    rag_s = g.tensor(name="rag_stats", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64,
                     uid=_RAG_STATS)  # fmt: skip
    stats.set_uid(_STATS).set_output(True).set_dim([b, hq, sq, 1]).set_stride([sq * hq, 1, hq, 1])
    stats.set_data_type(cudnn.data_type.FLOAT).set_ragged_offset(rag_s)
    _finish(g)
    return g, g.get_workspace_size()


def _build_bwd(p: dict, handle, ragged_stats: bool):
    import cudnn

    g, io = _new_graph(p, handle)
    q, k, v, rag_q, rag_k, mask = _graph_inputs(g, io, p)
    b, hq, hkv, sq, sk, d = p["B"], p["Hq"], p["Hkv"], p["Sq"], p["Sk"], p["D"]
    o = g.tensor(name="o", dim=[b, hq, sq, d], stride=_thd_stride(hq, sq, d), data_type=io, uid=_O)
    do = g.tensor(name="dO", dim=[b, hq, sq, d], stride=_thd_stride(hq, sq, d), data_type=io, uid=_DO)
    o.set_ragged_offset(rag_q)
    do.set_ragged_offset(rag_q)
    f32 = cudnn.data_type.FLOAT
    if ragged_stats:
        stats = g.tensor(name="stats", dim=[b, hq, sq, 1], stride=[sq * hq, 1, hq, 1], data_type=f32, uid=_STATS)
        rag_s = g.tensor(name="rag_stats", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                         data_type=cudnn.data_type.INT64, uid=_RAG_STATS)  # fmt: skip
        stats.set_ragged_offset(rag_s)
    else:
        stats = g.tensor(name="stats", dim=[b, hq, sq, 1], stride=[hq * sq, sq, 1, 1], data_type=f32, uid=_STATS)
    dq, dk, dv = g.sdpa_backward(
        name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=p["scale"],
        max_total_seq_len_q=p["Tq"], max_total_seq_len_kv=p["Tk"],
        use_deterministic_algorithm=p["deterministic"], **mask,
    )  # fmt: skip
    dq.set_uid(_DQ).set_output(True).set_dim([b, hq, sq, d]).set_stride(_thd_stride(hq, sq, d)).set_data_type(io)
    dk.set_uid(_DK).set_output(True).set_dim([b, hkv, sk, d]).set_stride(_thd_stride(hkv, sk, d)).set_data_type(io)
    dv.set_uid(_DV).set_output(True).set_dim([b, hkv, sk, d]).set_stride(_thd_stride(hkv, sk, d)).set_data_type(io)
    dq.set_ragged_offset(rag_q)
    dk.set_ragged_offset(rag_k)
    dv.set_ragged_offset(rag_k)
    _finish(g)
    return g, g.get_workspace_size()


def _layout(cu_q, cu_k, max_q, max_k, hq, hkv, d, cache: dict | None):
    """Bucketed shapes and the device-side per-document tensors; cached in the step meta when given."""
    n_docs = cu_q.numel() - 1
    b = _bucket(n_docs, 8)
    key = ("cudnn_layout", id(cu_q), id(cu_k), b, hq, hkv, d)
    if cache is not None and key in cache:
        return cache[key]
    pad_q = torch.cat([cu_q, cu_q[-1:].expand(b - n_docs)]).long()
    pad_k = torch.cat([cu_k, cu_k[-1:].expand(b - n_docs)]).long()
    sq, sk = _bucket(int(max_q), 64), _bucket(int(max_k), 64)
    lay = {
        "B": b,
        "Sq": sq,
        "Sk": sk,
        "seq_q": (pad_q[1:] - pad_q[:-1]).to(torch.int32).view(b, 1, 1, 1),
        "seq_k": (pad_k[1:] - pad_k[:-1]).to(torch.int32).view(b, 1, 1, 1),
        "rag_q": (pad_q * (hq * d)).view(b + 1, 1, 1, 1),
        "rag_k": (pad_k * (hkv * d)).view(b + 1, 1, 1, 1),
        "rag_stats": (pad_q * hq).view(b + 1, 1, 1, 1),
        "pad_q": pad_q,
        "cu_q": cu_q,
        "cu_k": cu_k,
        "max_q": int(max_q),
        "max_k": int(max_k),
    }
    if cache is not None:
        cache[key] = lay
    return lay


def _padded_stats(stats: torch.Tensor, lay: dict, total_q: int) -> torch.Tensor:
    """Packed softmax stats ``[T_q, Hq, 1]`` -> padded ``[B, Hq, Sq, 1]`` (device-side, no sync)."""
    b, sq = lay["B"], lay["Sq"]
    idx = lay.get("_pad_index")
    if idx is None:
        pad_q = lay["pad_q"]
        doc = torch.repeat_interleave(torch.arange(b, device=stats.device), pad_q[1:] - pad_q[:-1], output_size=total_q)
        pos = torch.arange(total_q, device=stats.device) - pad_q[doc]
        idx = lay["_pad_index"] = (doc, pos)
    out = stats.new_zeros(b, sq, stats.shape[1])
    out[idx[0], idx[1]] = stats[:, :, 0]
    return out.transpose(1, 2).unsqueeze(-1).contiguous()


def note_failure(shape: tuple, what: str, instead: str, exc: BaseException) -> str:
    """Remember that ``what`` raised for this static shape (same on every rank: shapes are replicated) and warn."""
    reason = f"the {what} raised {type(exc).__name__}: {str(exc)[:200]}"
    FAILED[shape] = reason
    logger.warning("cudnn varlen backend: %s for Hq=%s Hkv=%s D=%s %s; using %s from now on", reason,
                   *shape[1:], instead)  # fmt: skip
    return reason


def _triton_bwd_reason(q: torch.Tensor) -> str | None:
    if q.device.type != "cuda":  # the interpreter path is for the kernel's own tests, never this backend
        return f"the Triton varlen backward runs on CUDA here, got device={q.device}"
    from .triton_varlen_bwd import triton_varlen_unavailable_reason

    return triton_varlen_unavailable_reason(q.dtype, q.device)


def _static(q: torch.Tensor, k: torch.Tensor) -> tuple:
    return (q.shape[1], k.shape[1], q.shape[2], q.dtype)


def _params(q, k, lay, scale, deterministic, total_q, total_k, align="BOTTOM_RIGHT", causal=True):
    backward = BACKWARD
    if backward not in _BACKWARDS:
        raise ValueError(f"cudnn_graph.BACKWARD must be one of {_BACKWARDS}, got {backward!r}")
    if not causal:
        backward = "cudnn"  # the Triton and FA2-fed backwards are written for the causal mask
    elif backward == "auto":
        backward = "cudnn" if align == "TOP_LEFT" else "triton"
    if backward == "triton" and (FAILED.get(("triton", *_static(q, k))) or _triton_bwd_reason(q)) is not None:
        backward = "fa2"
    if backward == "fa2" and (deterministic or not _optional.torch_varlen()[0]):
        backward = "cudnn"  # cuDNN's backward has a deterministic mode; FA2's follows torch's global flag
    return {
        "dtype": q.dtype, "B": lay["B"], "Hq": q.shape[1], "Hkv": k.shape[1], "Sq": lay["Sq"], "Sk": lay["Sk"],
        "D": q.shape[2], "scale": float(scale), "deterministic": bool(deterministic), "align": align,
        "Tq": _bucket(total_q, 64, 8), "Tk": _bucket(total_k, 64, 8), "device": q.device, "backward": backward,
        "causal": bool(causal),
    }  # fmt: skip


def cudnn_varlen_fwd(q, k, v, lay, p):
    """Forward: ``(out [T_q, Hq, D], stats [T_q, Hq, 1] fp32 log-sum-exp)``."""
    handle = _handle(q.device)
    key = ("fwd", *(p[n] for n in ("dtype", "B", "Hq", "Hkv", "Sq", "Sk", "D", "scale", "align", "causal", "device")))
    g, ws = _cached(key, lambda: _build_fwd(p, handle))
    out = torch.empty_like(q)
    stats = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
    pack = {_Q: q, _K: k, _V: v, _O: out, _STATS: stats, _SEQ_Q: lay["seq_q"], _SEQ_K: lay["seq_k"],
            _RAG_Q: lay["rag_q"], _RAG_K: lay["rag_k"], _RAG_STATS: lay["rag_stats"]}  # fmt: skip
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=q.device)
    g.execute(pack, workspace, handle=handle)
    return out, stats


def cudnn_varlen_bwd(dout, q, k, v, out, stats, lay, p):
    """cuDNN backward: ``(dq, dk, dv)`` packed like ``q``/``k``/``v`` (dk/dv in the K/V head count)."""
    global RAGGED_STATS_BWD
    handle = _handle(q.device)
    names = ("dtype", "B", "Hq", "Hkv", "Sq", "Sk", "D", "scale", "align", "causal", "deterministic", "Tq", "Tk",
             "device")  # fmt: skip
    base = ("bwd", *(p[n] for n in names))
    ragged = RAGGED_STATS_BWD
    if ragged is None:
        try:
            _cached((*base, True), lambda: _build_bwd(p, handle, True))
            ragged = RAGGED_STATS_BWD = True
        except Exception:  # this cuDNN refuses packed stats in the backward: use the padded layout from now on
            ragged = RAGGED_STATS_BWD = False
    g, ws = _cached((*base, ragged), lambda: _build_bwd(p, handle, ragged))
    stats_in = stats if ragged else _padded_stats(stats, lay, q.shape[0])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pack = {_Q: q, _K: k, _V: v, _O: out, _DO: dout, _STATS: stats_in, _DQ: dq, _DK: dk, _DV: dv,
            _SEQ_Q: lay["seq_q"], _SEQ_K: lay["seq_k"], _RAG_Q: lay["rag_q"], _RAG_K: lay["rag_k"]}  # fmt: skip
    if ragged:
        pack[_RAG_STATS] = lay["rag_stats"]
    workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device=q.device)
    g.execute(pack, workspace, handle=handle)
    return dq, dk, dv


def fa2_bwd_from_cudnn(dout, q, k, v, out, stats, lay, p):
    """FA2 backward (``aten._flash_attention_backward``) from the cuDNN forward's output and log-sum-exp.

    Both libraries use the natural-log log-sum-exp of the scaled scores; FA2's varlen layout is ``[Hq, T_q]``.
    """
    lse = stats[:, :, 0].t().contiguous()
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: the philox state is never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, lay["cu_q"], lay["cu_k"], lay["max_q"], lay["max_k"], 0.0, True, rng, unused,
        scale=p["scale"],
    )  # fmt: skip
    return dq, dk, dv


def triton_bwd_from_cudnn(dout, q, k, v, out, stats, lay, p):
    """Our Triton varlen backward from the cuDNN forward's output and natural-log log-sum-exp ``[T_q, Hq]``."""
    from .triton_varlen_bwd import triton_varlen_bwd

    return triton_varlen_bwd(
        dout, q, k, v, out, stats[:, :, 0], lay["cu_q"], lay["cu_k"], lay["max_q"], lay["max_k"], p["scale"]
    )


_BACKWARD_FNS = {"triton": triton_bwd_from_cudnn, "fa2": fa2_bwd_from_cudnn, "cudnn": cudnn_varlen_bwd}


class _CudnnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lay, p):
        out, stats = cudnn_varlen_fwd(q, k, v, lay, p)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.lay, ctx.p = lay, p
        return out

    @staticmethod
    @differentiable_once("the cudnn varlen attention")
    def backward(ctx, dout):
        q, k, v, out, stats = ctx.saved_tensors
        name, dout = ctx.p["backward"], dout.contiguous()
        if name == "triton" and BACKWARD == "auto":
            try:
                dq, dk, dv = triton_bwd_from_cudnn(dout, q, k, v, out, stats, ctx.lay, ctx.p)
                return dq, dk, dv, None, None
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                note_failure(("triton", *_static(q, k)), "Triton varlen backward", "FA2's backward", exc)
                name = "cudnn" if ctx.p["deterministic"] or not _optional.torch_varlen()[0] else "fa2"
        dq, dk, dv = _BACKWARD_FNS[name](dout, q, k, v, out, stats, ctx.lay, ctx.p)
        return dq, dk, dv, None, None


def graph_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    scale: float,
    causal: bool = True,
    deterministic: bool = False,
    align: str | None = None,
) -> torch.Tensor:
    """cuDNN SDPA over the segments of ``meta`` (the provider contract, fp16/bf16 on SM90+, no dropout).

    ``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` contiguous; returns ``[n_real, Hq, D]``. The per-document
    device tensors are cached in ``meta.cache``; the diagonal is top-left when ``meta.all_square`` (host ints), else
    bottom-right. ``align="BOTTOM_RIGHT"`` forces the bottom-right diagonal (always correct; for measurements).
    """
    hq, d = q.shape[1], q.shape[2]
    lay = _layout(meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, hq, k.shape[1], d, meta.cache)
    if align not in (None, "BOTTOM_RIGHT"):
        raise ValueError(f"align must be None (from the layout) or 'BOTTOM_RIGHT', got {align!r}")
    align = align or ("TOP_LEFT" if meta.all_square else "BOTTOM_RIGHT")
    p = _params(q, k, lay, scale, deterministic, q.shape[0], k.shape[0], align, causal)
    return _CudnnVarlen.apply(q, k, v, lay, p)
