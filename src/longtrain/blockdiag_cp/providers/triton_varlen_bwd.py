"""Triton backward of bottom-right causal varlen attention over packed documents (GQA native), tuned for Hopper.

``triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)`` returns ``(dq, dk, dv)`` from a
forward's output and natural-log log-sum-exp (cuDNN's stats or FlashAttention's lse, any strides). Kernels:

- ``triton_varlen_bwd_kernel_preprocess``: ``delta = rowsum(out * dout)`` and the base-2 log-sum-exp, both stored
  ``[Hq, T_q]`` fp32 so the main kernels read them contiguously; rows that see no key (lse = ±inf or NaN) get
  ``lse2 = +inf`` and ``delta = 0``: every probability of theirs is exactly 0.
- ``triton_varlen_bwd_kernel_dkdv``: one program per (key block of a document, K/V head). It keeps its K/V
  block resident and loops over the ``Hq / Hkv`` query heads of its group and over the query blocks of its
  document that see the block (no atomics: deterministic). Blocks on the causal diagonal or at a document's
  last partial query block apply the mask; all others run unmasked.
- ``triton_varlen_bwd_kernel_dq``: one program per (query block of a document, query head), looping over the
  key blocks its rows see (``dq_mode="kernel"``, deterministic), or, with ``dq_mode="atomic"``, the dK/dV
  kernel also adds ``dS K`` into an fp32 accumulator with atomics (two fewer matmuls, not deterministic).

The work lists (which block of which document each program takes) are built on the device with torch ops from
``cu_q``/``cu_k`` (no host sync) and ordered by decreasing work so the longest documents' blocks start first;
they are cached while the same ``cu_q``/``cu_k`` tensors come back unchanged (all layers of a step). Every
query row and key row outside the documents (before ``cu[0]`` or after ``cu[-1]``) gets a zero gradient.

Launch configurations are tuned once per static shape (head dim, head counts, dtype, device), never per token
count; ``config=`` forces one (tests, the interpreter, prewarm). Importing this module imports Triton.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields, replace

import torch
import triton

from longtrain import _optional

from .triton_varlen_bwd_kernels import (
    triton_varlen_bwd_kernel_dkdv,
    triton_varlen_bwd_kernel_dq,
    triton_varlen_bwd_kernel_preprocess,
)

__all__ = [
    "CANDIDATES",
    "INTERPRET_CONFIG",
    "TritonVarlenBwdConfig",
    "config_from_dict",
    "triton_varlen_bwd",
    "triton_varlen_bwd_kernel_dkdv",
    "triton_varlen_bwd_kernel_dq",
    "triton_varlen_bwd_kernel_preprocess",
    "triton_varlen_unavailable_reason",
    "tuned_configs",
]

LOG2E = 1.4426950408889634
_DQ_MODES = ("kernel", "atomic")
_TABLE_W = 8  # int32 fields per work item: q_start, q_len, k_start, k_len, block_start, 3 unused (alignment)


def _check_pow2(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or value > high or value & (value - 1):
        raise ValueError(f"TritonVarlenBwdConfig.{name} must be a power of two in [{low}, {high}], got {value!r}")


@dataclass(kw_only=True, frozen=True)
class TritonVarlenBwdConfig:
    """One launch configuration of the three backward kernels."""

    dkv_block_m: int = 32
    """Query rows per inner step of the dK/dV kernel."""
    dkv_block_n: int = 64
    """Keys per dK/dV program (the resident K/V block)."""
    dkv_warps: int = 4
    """Warps per dK/dV program."""
    dkv_stages: int = 3
    """Software-pipelining depth of the dK/dV kernel's query-block loads."""
    dq_block_m: int = 128
    """Query rows per dQ program (the resident Q/dO block); unused with ``dq_mode="atomic"``."""
    dq_block_n: int = 64
    """Keys per inner step of the dQ kernel."""
    dq_warps: int = 8
    """Warps per dQ program."""
    dq_stages: int = 3
    """Software-pipelining depth of the dQ kernel's key-block loads."""
    dq_mode: str = "kernel"
    """``"kernel"``: a separate deterministic dQ kernel; ``"atomic"``: dQ added by the dK/dV kernel with fp32
    atomics (no extra matmuls, not bitwise deterministic)."""
    overlap: bool = False
    """CUDA, ``dq_mode="kernel"``: launch the dQ kernel on a side stream so it runs alongside the dK/dV kernel
    (each fills the other's tail; results are unchanged, the two kernels write disjoint outputs)."""

    def __post_init__(self) -> None:
        for name in ("dkv_block_m", "dkv_block_n", "dq_block_m", "dq_block_n"):
            _check_pow2(name, getattr(self, name), 16, 256)
        for name in ("dkv_warps", "dq_warps"):
            _check_pow2(name, getattr(self, name), 1, 16)
        for name in ("dkv_stages", "dq_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 6:
                raise ValueError(f"TritonVarlenBwdConfig.{name} must be an int in [1, 6], got {value!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"TritonVarlenBwdConfig.overlap must be a bool, got {self.overlap!r}")
        if self.dq_mode not in _DQ_MODES:
            raise ValueError(
                f"TritonVarlenBwdConfig.dq_mode must be one of {', '.join(_DQ_MODES)}, got {self.dq_mode!r}"
            )

    def short(self) -> str:
        """Compact text, e.g. ``dkv64x128w8s2/dq128x64w8s2`` (benchmark tables)."""
        dkv = f"dkv{self.dkv_block_m}x{self.dkv_block_n}w{self.dkv_warps}s{self.dkv_stages}"
        if self.dq_mode == "atomic":
            return f"{dkv}/dq-atomic"
        dq = f"dq{self.dq_block_m}x{self.dq_block_n}w{self.dq_warps}s{self.dq_stages}"
        return f"{dkv}/{dq}" + ("/overlap" if self.overlap else "")


#: Configurations the autotuner times on the first call of each static shape (head dim, heads, dtype, device).
CANDIDATES: tuple[TritonVarlenBwdConfig, ...] = (
    TritonVarlenBwdConfig(),
    TritonVarlenBwdConfig(overlap=True),
    TritonVarlenBwdConfig(dkv_stages=4, overlap=True),
    TritonVarlenBwdConfig(dkv_block_m=64, dkv_block_n=128, dkv_warps=8, dq_stages=4, overlap=True),
)
#: The forced configuration under the Triton interpreter (small tiles keep CPU tests quick).
INTERPRET_CONFIG = TritonVarlenBwdConfig(
    dkv_block_m=16, dkv_block_n=32, dkv_warps=1, dkv_stages=1, dq_block_m=32, dq_block_n=16, dq_warps=1, dq_stages=1
)


def _documents(cu_q: torch.Tensor, cu_k: torch.Tensor, t_q: int, t_k: int) -> tuple[torch.Tensor, ...]:
    """Per-document ``(q_start, q_len, k_start, k_len)`` int64, plus four pseudo-documents that cover the query
    and key rows before ``cu[0]`` and after ``cu[-1]`` (queries without keys, keys without queries: zero grads).

    Offsets are clamped into ``[0, T]`` and made non-decreasing, so malformed metadata cannot address memory
    outside the tensors (its gradients are then meaningless, never an illegal access).
    """
    cq = cu_q.to(torch.int64).clamp(0, t_q).cummax(0).values
    ck = cu_k.to(torch.int64).clamp(0, t_k).cummax(0).values
    zero = cq.new_zeros(1)
    tq, tk = cq.new_full((1,), t_q), ck.new_full((1,), t_k)
    q_first, q_last, k_first, k_last = cq[:1], cq[-1:], ck[:1], ck[-1:]
    # documents, then: queries before cu_q[0], keys before cu_k[0], queries after cu_q[-1], keys after cu_k[-1]
    q_start = torch.cat([cq[:-1], zero, zero, q_last, tq])
    q_len = torch.cat([cq[1:] - cq[:-1], q_first, zero, tq - q_last, zero])
    k_start = torch.cat([ck[:-1], zero, zero, k_last, k_last])
    k_len = torch.cat([ck[1:] - ck[:-1], zero, k_first, zero, tk - k_last])
    return q_start, q_len, k_start, k_len


def _work_list(docs: tuple[torch.Tensor, ...], block: int, by_keys: bool, bound: int) -> torch.Tensor:
    """``[bound, 8] int32`` work items (one block of one document each), heaviest first; the rest are zero rows.

    ``by_keys``: items are key blocks (dK/dV kernel), their work the number of query rows that see them;
    else query blocks (dQ kernel), their work the number of keys their last row sees.
    """
    q_start, q_len, k_start, k_len = docs
    lens = k_len if by_keys else q_len
    n_blocks = (lens + block - 1) // block
    ends = n_blocks.cumsum(0)
    idx = torch.arange(bound, device=lens.device)
    doc = torch.searchsorted(ends, idx, right=True)
    valid = doc < lens.numel()
    doc = doc.clamp(max=lens.numel() - 1)
    start = (idx - (ends[doc] - n_blocks[doc])) * block
    lq, lk = q_len[doc], k_len[doc]
    off = lk - lq
    if by_keys:
        work = lq - (start - off).clamp(min=0)
    else:
        work = torch.minimum(lk, start + block + off)
    work = torch.where(valid, work.clamp(min=0), -1)
    zeros = torch.zeros_like(start)
    table = torch.stack([q_start[doc], lq, k_start[doc], lk, start, zeros, zeros, zeros], 1)
    table = torch.where(valid[:, None], table, 0)
    order = torch.argsort(work, descending=True, stable=True)
    return table[order].to(torch.int32).contiguous()


_TABLES: OrderedDict[tuple, tuple] = OrderedDict()
_TABLES_MAX = 32
_LOCK = threading.Lock()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never cache them
        return None


def _work_lists(cu_q, cu_k, t_q: int, t_k: int, kv_block: int, q_block: int | None):
    """``(dkv_table, dq_table or None)``, cached while the same ``cu_q``/``cu_k`` objects stay unmodified."""
    vq, vk = _version(cu_q), _version(cu_k)
    key = (id(cu_q), id(cu_k), vq, vk, t_q, t_k, kv_block, q_block, str(cu_q.device))
    cacheable = vq is not None and vk is not None
    if cacheable:
        with _LOCK:
            hit = _TABLES.get(key)
        if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k:
            return hit[2]
    docs = _documents(cu_q, cu_k, t_q, t_k)
    n_docs = docs[0].numel()
    dkv = _work_list(docs, kv_block, True, triton.cdiv(t_k, kv_block) + n_docs)
    dq = _work_list(docs, q_block, False, triton.cdiv(t_q, q_block) + n_docs) if q_block is not None else None
    if cacheable:
        with _LOCK:
            _TABLES[key] = (weakref.ref(cu_q), weakref.ref(cu_k), (dkv, dq))
            while len(_TABLES) > _TABLES_MAX:
                _TABLES.popitem(last=False)
    return dkv, dq


# ----------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------


def _new(shape, dtype, device) -> torch.Tensor:
    """Allocation of every kernel-written buffer (tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_all(
    dout, q, k, v, out, lse, cu_q, cu_k, scale: float, cfg: TritonVarlenBwdConfig, grads=None, kernels=("dkdv", "dq")
):
    """Run the kernels with ``cfg``; writes into ``grads = (dq, dk, dv)`` when given.

    ``kernels`` selects the main kernels after the preprocess (the benchmark times them one at a time).
    """
    t_q, hq, d = q.shape
    t_k, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    dev = q.device
    block_d = max(16, triton.next_power_of_2(d))
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dq, dk, dv = grads if grads is not None else (_new(q.shape, q.dtype, dev), _new(k.shape, k.dtype, dev),
                                                  _new(v.shape, v.dtype, dev))  # fmt: skip
    atomic = cfg.dq_mode == "atomic"
    dkv_table, dq_table = _work_lists(cu_q, cu_k, t_q, t_k, cfg.dkv_block_n, None if atomic else cfg.dq_block_m)
    delta = _new((hq, t_q), torch.float32, dev)
    lse2 = _new((hq, t_q), torch.float32, dev)
    if t_q:
        block_t = 32 if block_d > 128 else 64
        triton_varlen_bwd_kernel_preprocess[(triton.cdiv(t_q, block_t), hq)](
            out, dout, lse, delta, lse2, t_q,
            out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), lse.stride(0), lse.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=4,
        )  # fmt: skip
    dqa = torch.zeros((t_q, hq, d), dtype=torch.float32, device=dev) if atomic else delta
    qk_scale = scale * LOG2E
    run_dq = not atomic and t_q > 0 and "dq" in kernels
    dq_args = (q, k, v, dout, dq, lse2, delta, dq_table, t_q, qk_scale, scale, cfg, group, block_d, dot_prec)
    side = None
    if run_dq and cfg.overlap and dev.type == "cuda" and t_k and "dkdv" in kernels:
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        ready = torch.cuda.Event()
        ready.record(main)  # the preprocess's delta / lse2 and the caller's inputs; not the dK/dV kernel below
    if t_k and "dkdv" in kernels:
        triton_varlen_bwd_kernel_dkdv[(dkv_table.shape[0] * hkv,)](
            q, k, v, dout, dk, dv, lse2, delta, dqa, dkv_table, t_q, qk_scale, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
            dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            dqa.stride(0) if atomic else 0, dqa.stride(1) if atomic else 0,
            H_KV=hkv, GROUP=group, D=d, BLOCK_D=block_d, BLOCK_M=cfg.dkv_block_m, BLOCK_N=cfg.dkv_block_n,
            DQ_ATOMIC=atomic, DOT_PREC=dot_prec, num_warps=cfg.dkv_warps, num_stages=cfg.dkv_stages,
        )  # fmt: skip
    if atomic:
        dq.copy_(dqa)
    elif side is not None:
        # Launched after the dK/dV kernel, so the block scheduler hands it SMs as the dK/dV kernel's tail frees them.
        side.wait_event(ready)
        with torch.cuda.stream(side):
            _launch_dq(*dq_args)
        main.wait_stream(side)  # every buffer used on the side stream is freed after this point on `main`
    elif run_dq:
        _launch_dq(*dq_args)
    return dq, dk, dv


def _launch_dq(q, k, v, dout, dq, lse2, delta, dq_table, t_q, qk_scale, scale, cfg, group, block_d, dot_prec):
    hq, d = q.shape[1], q.shape[2]
    triton_varlen_bwd_kernel_dq[(dq_table.shape[0] * hq,)](
        q, k, v, dout, dq, lse2, delta, dq_table, t_q, qk_scale, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0),
        dout.stride(1), dq.stride(0), dq.stride(1),
        H_Q=hq, GROUP=group, D=d, BLOCK_D=block_d, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        DOT_PREC=dot_prec, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )  # fmt: skip


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


_TUNED: dict[tuple, TritonVarlenBwdConfig] = {}


def tuned_configs() -> dict[tuple, TritonVarlenBwdConfig]:
    """The autotuner's choices so far: ``(head_dim, Hq, Hkv, dtype, device) -> config`` (a copy)."""
    return dict(_TUNED)


def _tune_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    return (q.shape[2], q.shape[1], k.shape[1], q.dtype, str(q.device))


def _autotune(args, scale: float) -> TritonVarlenBwdConfig:
    """Time every candidate once on this call's inputs (first call of a static shape only) and keep the fastest."""
    dout, q, k, v, out, lse, cu_q, cu_k = args
    key = _tune_key(q, k)
    best = _TUNED.get(key)
    if best is not None:
        return best
    if q.device.type != "cuda":
        best = INTERPRET_CONFIG
    else:
        from triton.testing import do_bench

        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        timings = []
        for cand in CANDIDATES:
            try:
                ms = do_bench(lambda c=cand: _launch_all(*args, scale, c, grads), warmup=5, rep=20)
            except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError):
                continue  # this tile does not fit this GPU / head dim
            timings.append((ms, cand))
        if not timings:
            raise RuntimeError(f"no Triton varlen backward configuration runs for {key}; pass config= explicitly")
        best = min(timings, key=lambda x: x[0])[1]
    _TUNED[key] = best
    return best


def triton_varlen_unavailable_reason(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why :func:`triton_varlen_bwd` cannot run for ``dtype`` on ``device``, or None (launches nothing)."""
    dev = torch.device(device)
    ok, reason = _optional.triton()
    if not ok:
        return reason
    if dev.type == "cuda":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"the Triton varlen backward needs bf16/fp16 (or fp32) on CUDA, got {dtype}"
        ok, reason = _optional.cuda_sm(8, 0)
        return None if ok else f"the Triton varlen backward {reason}"
    if dev.type == "cpu":
        if not _optional.triton_interpret():
            return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter); use a CUDA device for speed"
        if dtype not in (torch.float32, torch.float16):
            return f"under the Triton interpreter use fp32/fp16 (its bf16 tl.dot is inexact), got {dtype}"
        return None
    return f"the Triton varlen backward runs on CUDA (or CPU under TRITON_INTERPRET=1), not on {dev.type}"


def _validate(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config) -> None:
    named = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_q": cu_q, "cu_k": cu_k}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q must be [T_q, Hq, D] and k/v [T_k, Hkv, D], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    t_q, hq, d = q.shape
    hkv = k.shape[1]
    for name, t, want in (("out", out, q.shape), ("dout", dout, q.shape), ("v", v, k.shape)):
        if t.shape != want:
            raise ValueError(f"{name} must have shape {tuple(want)}, got {tuple(t.shape)}")
    if k.shape[2] != d:
        raise ValueError(f"k/v head dim ({k.shape[2]}) must equal q's ({d})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv})")
    if d % 16 or not 16 <= d <= 256:
        raise ValueError(f"head dim must be a multiple of 16 in [16, 256], got {d}")
    if lse.shape != (t_q, hq) or lse.dtype != torch.float32:
        raise ValueError(
            f"lse must be [T_q, Hq] = {(t_q, hq)} fp32 (cuDNN stats[:, :, 0] or FlashAttention's lse.t()), got "
            f"{tuple(lse.shape)} {lse.dtype}"
        )
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in (("cu_q", cu_q), ("cu_k", cu_k)):
        if t.dim() != 1 or t.numel() < 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 [N+1] tensor of cumulative offsets, got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_q and cu_k must both be [N+1], got {cu_q.numel()} and {cu_k.numel()} entries")
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move every input to one device")
    for name, value in (("max_q", max_q), ("max_k", max_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int (the longest document's length), got {value!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None (head_dim ** -0.5), got {scale!r}")
    if config is not None and not isinstance(config, TritonVarlenBwdConfig):
        raise TypeError(f"config must be a TritonVarlenBwdConfig or None, got {type(config).__name__}")
    reason = triton_varlen_unavailable_reason(q.dtype, q.device)
    if reason is not None:
        raise RuntimeError(f"triton_varlen_bwd cannot run here: {reason}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    *,
    config: TritonVarlenBwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of bottom-right causal varlen attention over packed documents.

    Args:
        dout: ``[T_q, Hq, D]`` gradient of the attention output (finite), same dtype as ``q``.
        q: ``[T_q, Hq, D]`` bf16/fp16 on CUDA (fp32 allowed), fp32/fp16 under ``TRITON_INTERPRET=1``.
        k, v: ``[T_k, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: never repeated in memory).
        out: ``[T_q, Hq, D]`` the forward's output.
        lse: ``[T_q, Hq]`` fp32 natural-log log-sum-exp of the scaled scores (cuDNN ``stats[:, :, 0]``, or
            FlashAttention's varlen ``lse.t()``; any strides). ±inf / NaN mark rows that see no key.
        cu_q, cu_k: ``[N+1]`` int32 cumulative document offsets; document ``i`` has queries
            ``[cu_q[i], cu_q[i+1])`` and keys ``[cu_k[i], cu_k[i+1])``; query ``r`` of a document with ``Lq``
            queries and ``Lk`` keys sees keys ``c <= r + Lk - Lq`` (causal, aligned bottom-right).
        max_q, max_k: host ints, the longest document's query / key count (checked non-negative; every
            kernel bound is derived from ``cu_q``/``cu_k`` on the device, so no host sync happens here).
        scale: softmax scale; None means ``D ** -0.5``.
        config: a forced :class:`TritonVarlenBwdConfig`; None autotunes once per static shape (CUDA) or uses
            :data:`INTERPRET_CONFIG` (interpreter).

    Returns:
        ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])`` in the inputs' dtype. Rows outside every
        document and rows that see no key get zero gradients. Deterministic unless ``dq_mode="atomic"``.
    """
    _validate(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config)
    d = q.shape[2]
    scale = float(scale) if scale is not None else d**-0.5
    args = tuple(_last_dim_contiguous(t) for t in (dout, q, k, v, out)) + (lse, cu_q, cu_k)
    cfg = config if config is not None else _autotune(args, scale)
    return _launch_all(*args, scale, cfg)


def config_from_dict(values: dict) -> TritonVarlenBwdConfig:
    """A :class:`TritonVarlenBwdConfig` from a mapping (benchmark JSON); unknown keys raise ``ValueError``."""
    names = {f.name for f in fields(TritonVarlenBwdConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown TritonVarlenBwdConfig fields {unknown}; valid: {sorted(names)}")
    return replace(TritonVarlenBwdConfig(), **values)
