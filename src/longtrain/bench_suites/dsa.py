"""DSA kernels on one GPU: our Triton sparse MLA forward/backward and fused indexer top-k vs the baselines.

Usage (repository root, CUDA machine; ``longtrain bench dsa`` and ``python -m longtrain.bench_suites.dsa`` run the
same)::

    PYTHONPATH=src python benchmarks/dsa.py                 # full benchmark, report -> benchmarks/results/
    PYTHONPATH=src python benchmarks/dsa.py --sweep         # launch-config sweep of every kernel (+ compiler stats)
    PYTHONPATH=src python benchmarks/dsa.py --memcheck      # one small launch of each kernel (for compute-sanitizer)

Shapes: GLM-5.2 sparse MLA (H = 64, D_qk = 576, D_v = 512, K = 2048) and its indexer (H_I = 32, D_I = 128).
Index sets: query ``t`` at position ``p`` of its document selects ``min(p + 1, K)`` random keys of the causal
prefix of its document (``1doc``: one document of T tokens, as in the TileLang anchors; ``docs``: documents
of U[K, 4K] tokens). FLOPs count valid slots only: fwd ``2·valid·H·(D_qk+D_v)``, bwd
``2·valid·H·(3·D_qk+2·D_v)``; indexer ``2·H_I·D_I`` per scored causal pair. Timing: ``triton.testing.do_bench``
median (20th/80th percentiles), L2 flushed between repetitions. Baselines in the same run: the library's
plain-torch paths (gather-based sparse MLA; materialised indexer scores + ``torch.topk`` on 2048-row chunks),
the cuDNN frontend backward where its package is installed, and TileLang's DeepSeek-V3.2 sparse MLA kernels where
they are carried (:mod:`longtrain.bench_suites.tilelang_baseline`; otherwise rows saying why not).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from longtrain.bench_suites.report import RESULTS_DIR, write_report
from longtrain.dsa.triton import IndexerConfig, KernelConfig

D_QK, D_V, TOPK, H_I, D_I = 576, 512, 2048, 32, 128

# Candidate launch configs for the sweep: (block_k, num_warps, num_stages).
# Forward: (block_k, num_warps, num_stages, layout index: 0 heads, 1 keys, 2 keys_logits[, impl]); for
# impl "sm90" num_stages is the number of gathered tiles in flight.
FWD_SWEEP = [
    (128, 8, 1, 2), (128, 8, 1, 1), (64, 8, 1, 0),  # portable, one stage (the previous candidates)
    (64, 8, 2, 0), (64, 8, 2, 1), (64, 8, 2, 2), (32, 8, 2, 0), (32, 8, 3, 0), (32, 8, 4, 0), (16, 8, 6, 0),
    (64, 16, 2, 0),
    (64, 8, 2, 0, "sm90"), (32, 8, 2, 0, "sm90"), (32, 8, 3, 0, "sm90"), (32, 8, 4, 0, "sm90"),
]  # fmt: skip
# SM90 kernel with both warpgroups computing every logit (SPLIT_KEYS=False): (block_k, tiles in flight).
FWD_SM90_DUP_SWEEP = [(64, 2), (32, 4)]
IDX_SWEEP = [  # (block_m, block_n, num_warps, num_stages, select_block, select_warps)
    (64, 128, 8, 3, 2048, 8),
    (64, 128, 8, 2, 2048, 8),
    (64, 64, 4, 3, 2048, 8),
    (64, 128, 8, 3, 1024, 4),
]


# ------------------------------------------------------------------------------------------------ inputs


def doc_lengths(total: int, layout: str, topk: int, seed: int = 0) -> list[int]:
    if layout == "1doc":
        return [total]
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = int(torch.randint(topk, 4 * topk + 1, (1,), generator=gen))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def causal_index_sets(lengths: list[int], topk: int, device, seed: int = 0):
    """``(idx [T, K] int32 ascending then -1, topk_length [T] int32, starts [T], causal_lengths [T])``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    idx = torch.full((total, topk), -1, dtype=torch.int32, device=device)
    starts = torch.empty(total, dtype=torch.int32, device=device)
    causal = torch.empty(total, dtype=torch.int32, device=device)
    row = 0
    for n in lengths:
        width = min(topk, n)
        for r0 in range(0, n, 1024):
            r1 = min(n, r0 + 1024)
            pos = torch.arange(r0, r1, device=device)
            scores = torch.rand((r1 - r0, n), generator=gen, device=device)
            scores.masked_fill_(torch.arange(n, device=device)[None, :] > pos[:, None], -1.0)
            chosen = scores.topk(width, dim=1).indices
            count = torch.clamp(pos + 1, max=topk)
            chosen = torch.where(torch.arange(width, device=device)[None, :] < count[:, None], chosen, n)
            chosen = chosen.sort(dim=1).values
            idx[row + r0 : row + r1, :width] = torch.where(chosen < n, chosen + row, -1).to(torch.int32)
            causal[row + r0 : row + r1] = (pos + 1).to(torch.int32)
        starts[row : row + n] = row
        row += n
    length = torch.clamp(causal, max=topk).to(torch.int32)
    return idx, length, starts, causal


def mla_inputs(total: int, heads: int, device, seed: int = 0, d_qk: int = D_QK):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((total, heads, d_qk), generator=gen, device=device).to(torch.bfloat16)
    kv = torch.randn((total, 1, d_qk), generator=gen, device=device).to(torch.bfloat16)
    return q, kv


def indexer_inputs(total: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((total, H_I, D_I), generator=gen, device=device).to(torch.bfloat16)
    k = torch.randn((total, D_I), generator=gen, device=device).to(torch.bfloat16)
    w = torch.randn((total, H_I), generator=gen, device=device) * (H_I**-0.5 * D_I**-0.5)
    return q, k, w


# ------------------------------------------------------------------------------------------------ timing


def bench(fn, rep_ms: int = 100) -> tuple[float, float, float]:
    import triton

    med, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return med, p20, p80


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def compiled_stats(jit_fn) -> list[dict]:
    """Registers, spills, shared memory and atomics of every compiled variant of a Triton kernel."""
    rows = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for kernel in cache[0].values():
            with contextlib.suppress(Exception):
                kernel._init_handles()
            ptx = kernel.asm.get("ptx", "") if hasattr(kernel, "asm") else ""
            consts = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            block = {str(k[-1] if isinstance(k, tuple) else k): v for k, v in dict(consts).items()}
            rows.append(
                {
                    "kernel": getattr(kernel, "name", "?"),
                    "BLOCK": {k: v for k, v in block.items() if str(k).startswith("BLOCK") or k in ("H", "D_R")},
                    "warps": kernel.metadata.num_warps,
                    "stages": kernel.metadata.num_stages,
                    "regs": getattr(kernel, "n_regs", None),
                    "spills": getattr(kernel, "n_spills", None),
                    "smem": kernel.metadata.shared,
                    "wgmma": ptx.count("wgmma.mma_async"),
                    "mma.sync": ptx.count("mma.sync"),
                    "red": ptx.count("red.global"),
                    "atom": ptx.count("atom.global"),
                    "red.v4": ptx.count(".v4.f32"),
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------ kernels


def run_fwd(q, kv, idx, length, cfg, sink=None):
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    return sparse_mla_fwd(q, kv.view(kv.shape[0], -1), idx, D_QK**-0.5, D_V, length, sink, cfg)


def run_bwd(q, kv, out, dout, lse, idx, length, cfgs=(None, None, None), deterministic=False, sink=None):
    from longtrain.dsa.triton.sparse_mla_bwd import sparse_mla_bwd

    return sparse_mla_bwd(
        q, kv.view(kv.shape[0], -1), out, dout, lse, idx, D_QK**-0.5, D_V, length, sink,
        deterministic=deterministic, compute_dkv=True, configs=cfgs,
    )  # fmt: skip


def small_bwd_case(total: int, topk: int, heads: int, device):
    """A small sparse MLA backward's inputs for compute-sanitizer runs: one document, row 5's first slots invalid,
    out of range and repeated; ``(q, kv, idx, length, out, lse, dout)``."""
    idx, length, _, _ = causal_index_sets([total], topk, device)
    idx[5, :6] = torch.tensor([-1, total, 2**30, 3, 3, -7], dtype=torch.int32, device=device)
    q, kv = mla_inputs(total, heads, device)
    out, lse = run_fwd(q, kv, idx, length, None)
    return q, kv, idx, length, out, lse, torch.randn_like(out)


def _precompile_job(job: tuple) -> str:
    """Run one tiny launch of a kernel variant in a fresh process: fills Triton's on-disk cache in parallel."""
    kind, params = job
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    try:
        if kind in ("fwd", "bwd"):
            heads, d_qk, cfg = params
            d_v = min(D_V, d_qk)
            q, kv = mla_inputs(8, heads, dev, d_qk=d_qk)
            idx = torch.randint(0, 8, (8, TOPK), dtype=torch.int32, device=dev)
            length = torch.full((8,), TOPK, dtype=torch.int32, device=dev)
            if kind == "fwd":
                from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

                sparse_mla_fwd(q, kv.view(8, -1), idx, d_qk**-0.5, d_v, length, None, cfg)
            else:
                from longtrain.dsa.triton.sparse_mla_bwd import sparse_mla_bwd

                out = torch.randn((8, heads, d_v), device=dev).to(q.dtype)
                lse = torch.randn((8, heads), device=dev)
                sparse_mla_bwd(
                    q, kv.view(8, -1), out, torch.randn_like(out), lse, idx, d_qk**-0.5, d_v, length,
                    None, deterministic=False, compute_dkv=True, configs=cfg,
                )  # fmt: skip
        else:
            from longtrain.dsa.triton.indexer_topk import indexer_topk_fwd

            q, k, w = indexer_inputs(300, dev)
            starts = torch.zeros(300, dtype=torch.int32, device=dev)
            causal = torch.arange(1, 301, dtype=torch.int32, device=dev)
            indexer_topk_fwd(q, k, w, starts, causal, 128, params)
        torch.cuda.synchronize()
        return f"{kind} {params}: ok {time.perf_counter() - t0:.1f}s"
    except Exception as exc:
        return f"{kind} {params}: FAILED {type(exc).__name__}: {str(exc)[:300]}"


def precompile(jobs: list[tuple], workers: int = 16) -> None:
    import multiprocessing as mp

    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_precompile_job, jobs):
            print("  precompile", line, flush=True)
    print(f"precompile: {len(jobs)} variants in {time.perf_counter() - t0:.1f}s", flush=True)


def _fused_cfg() -> KernelConfig:
    return KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1)


def _ws_bwd_cfg() -> KernelConfig:
    return KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1)


def _portable_ds() -> tuple:
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    return mb._DS_CANDIDATES[0]


def _kcfg(t):
    layout = ("heads", "keys", "keys_logits", "stacked")[t[3]] if len(t) > 3 else "heads"
    impl = t[4] if len(t) > 4 else "triton"
    return KernelConfig(block_k=t[0], block_h=64, num_warps=t[1], num_stages=t[2], layout=layout, impl=impl)


def _sm90_jobs(heads: int) -> list[tuple]:
    from longtrain.dsa.triton.sparse_mla_fwd import _SM90_CANDIDATES

    return [("fwd", (heads, D_QK, _kcfg((bk, 8, nb, 0, "sm90")))) for bk, nb in _SM90_CANDIDATES]


def run_fwd_sm90_dup(q, kv, idx, length, block_k, num_buf):
    """The SM90 kernel with SPLIT_KEYS=False (sweep only: each warpgroup computes all logits)."""
    from longtrain.dsa.triton.sparse_mla_fwd import LOG2E
    from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sparse_mla_fwd_sm90_kernel

    total, heads, d_qk = q.shape
    out = torch.empty((total, heads, D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((total, heads), dtype=torch.float32, device=q.device)
    sparse_mla_fwd_sm90_kernel[(total * ((heads + 63) // 64),)](
        q, kv.view(kv.shape[0], -1), idx, length, q, out, lse, kv.shape[0], idx.shape[1], D_QK**-0.5 * LOG2E,
        H=heads, D_V=D_V, D_R=d_qk - D_V, HAS_LEN=True, HAS_SINK=False, BLOCK_K=block_k, NUM_BUF=num_buf,
        SPLIT_KEYS=False, num_warps=8,
    )  # fmt: skip
    return out, lse


def _bwd_jobs(heads: int) -> list[tuple]:
    """Precompile jobs covering every backward candidate of the three kernels (zipped, shortest padded)."""
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    lists = [mb._DS_CANDIDATES, mb._DQ_CANDIDATES, mb._DKV_CANDIDATES]
    n = max(len(x) for x in lists)
    return [("bwd", (heads, D_QK, tuple(_kcfg(x[min(i, len(x) - 1)]) for x in lists))) for i in range(n)]


def _icfg(t):
    return IndexerConfig(
        block_m=t[0], block_n=t[1], num_warps=t[2], num_stages=t[3], select_block=t[4], select_warps=t[5]
    )


# ------------------------------------------------------------------------------------------------ modes


def sweep(total: int, out_dir: Path, fwd_only: bool = False) -> dict:
    """Time every candidate config at the GLM-5.2 shape (one document of ``total`` tokens)."""
    from longtrain.dsa.triton import indexer_topk as it
    from longtrain.dsa.triton import sparse_mla_bwd as mb
    from longtrain.dsa.triton import sparse_mla_fwd as mf
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as m90

    dev = torch.device("cuda")
    jobs = [("fwd", (64, D_QK, _kcfg(c))) for c in FWD_SWEEP] + _bwd_jobs(64)
    if not fwd_only:
        jobs += [("idx", _icfg(c)) for c in IDX_SWEEP]
    precompile(jobs)
    result = {"fwd": [], "bwd": [], "indexer": []}
    idx, length, starts, causal = causal_index_sets([total], TOPK, dev)
    valid = int(length.sum())
    q, kv = mla_inputs(total, 64, dev)
    fwd_flops = 2 * valid * 64 * (D_QK + D_V)
    bwd_flops = 2 * valid * 64 * (3 * D_QK + 2 * D_V)
    ref_out, ref_lse = None, None

    def fwd_row(c, fn):
        nonlocal ref_out, ref_lse
        try:
            out, lse = fn()
            if ref_out is None:
                ref_out, ref_lse = out, lse
            diff = (out.float() - ref_out.float()).abs().max().item()
            same = torch.isfinite(lse) == torch.isfinite(ref_lse)
            lse_diff = (lse - ref_lse).abs().where(torch.isfinite(ref_lse), 0.0).max().item() if same.all() else -1
            ms = bench(fn)
            row = dict(cfg=c, ms=ms[0], p20=ms[1], p80=ms[2], tflops=fwd_flops / ms[0] / 1e9, max_diff=diff,
                       lse_diff=lse_diff, finite=bool(torch.isfinite(out).all()))  # fmt: skip
        except Exception as exc:
            row = dict(cfg=c, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print("fwd", row, flush=True)
        result["fwd"].append(row)

    for c in FWD_SWEEP:
        fwd_row(c, lambda c=c: run_fwd(q, kv, idx, length, _kcfg(c)))
    for bk, nb in FWD_SM90_DUP_SWEEP:
        fwd_row(("sm90-dup", bk, nb), lambda bk=bk, nb=nb: run_fwd_sm90_dup(q, kv, idx, length, bk, nb))
    fwd_row("default (config=None)", lambda: run_fwd(q, kv, idx, length, None))
    for name, kernel in (("fwd", mf.sparse_mla_fwd_kernel), ("fwd_sm90", m90.sparse_mla_fwd_sm90_kernel)):
        for r in compiled_stats(kernel):
            print("compiled", name, r, flush=True)
    if fwd_only:
        result["compiled"] = {"fwd": compiled_stats(mf.sparse_mla_fwd_kernel),
                              "fwd_sm90": compiled_stats(m90.sparse_mla_fwd_sm90_kernel)}  # fmt: skip
        (out_dir / "sweep.json").write_text(json.dumps(result, indent=1, default=str))
        return result
    dout = torch.randn_like(ref_out)
    # Backward: the autotuner times every candidate of each of the three kernels at this shape.
    run_bwd(q, kv, ref_out, dout, ref_lse, idx, length)
    for name in ("ds", "dq", "dkv"):
        tuned = mb._AUTOTUNED[name]
        timings = {str(k): v for k, v in getattr(tuned, "configs_timings", {}).items()}
        row = dict(kernel=name, best=str(tuned.best_config), timings=timings)
        print("bwd", row, flush=True)
        result["bwd"].append(row)
    ms = bench(lambda: run_bwd(q, kv, ref_out, dout, ref_lse, idx, length))
    row = dict(kernel="total (autotuned)", ms=ms[0], p20=ms[1], p80=ms[2], tflops=bwd_flops / ms[0] / 1e9)
    print("bwd", row, flush=True)
    result["bwd"].append(row)
    iq, ik, iw = indexer_inputs(total, dev)
    pairs = int(causal.to(torch.int64).sum())
    ref_sel = None
    for c in IDX_SWEEP:
        try:
            sel = it.indexer_topk_fwd(iq, ik, iw, starts, causal, TOPK, _icfg(c))
            if ref_sel is None:
                ref_sel = sel
            same = bool(torch.equal(sel, ref_sel))
            ms = bench(lambda c=c: it.indexer_topk_fwd(iq, ik, iw, starts, causal, TOPK, _icfg(c)))
            row = dict(
                cfg=c, ms=ms[0], p20=ms[1], p80=ms[2], logits_tflops=2 * H_I * D_I * pairs / ms[0] / 1e9, same=same
            )
        except Exception as exc:
            row = dict(cfg=c, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        print("indexer", row, flush=True)
        result["indexer"].append(row)
    result["compiled"] = {
        "fwd": compiled_stats(mf.sparse_mla_fwd_kernel),
        "fwd_sm90": compiled_stats(m90.sparse_mla_fwd_sm90_kernel),
        "bwd_ds": compiled_stats(mb.sparse_mla_bwd_kernel_ds),
        "bwd_dq": compiled_stats(mb.sparse_mla_bwd_kernel_dq),
        "bwd_dkv": compiled_stats(mb.sparse_mla_bwd_kernel_dkv),
        "scores": compiled_stats(it.indexer_topk_fwd_kernel_scores),
        "select": compiled_stats(it.indexer_topk_fwd_kernel_select),
    }
    for name, rows in result["compiled"].items():
        for r in rows:
            print("compiled", name, r, flush=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def memcheck() -> None:
    """One small launch of every kernel variant the library ships (run under compute-sanitizer)."""
    from longtrain.dsa.triton import indexer_topk_triton, sparse_mla_triton
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    dev = torch.device("cuda")
    idx, length, starts, causal = causal_index_sets([40, 50], 64, dev)
    idx[3] = -1
    idx[5, :10] = 10**6
    q, kv = mla_inputs(90, 64, dev)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    sink = torch.zeros(64, device=dev, requires_grad=True)
    from longtrain.dsa.triton import SparseMLAConfig
    from longtrain.dsa.triton import sparse_mla_bwd as mb
    from longtrain.dsa.triton.sparse_mla_fwd import _FWD_CANDIDATES

    cfg = SparseMLAConfig(
        fwd=_kcfg(_FWD_CANDIDATES[0]),
        bwd=_kcfg(mb._DS_CANDIDATES[0]),
        bwd_dq=_kcfg(mb._DQ_CANDIDATES[0]),
        bwd_dkv=_kcfg(mb._DKV_CANDIDATES[0]),
    )
    for det in (False, True):
        out = sparse_mla_triton(q, kv, idx, D_QK**-0.5, d_v=D_V, topk_length=length, attn_sink=sink,
                                deterministic=det, config=cfg)  # fmt: skip
        torch.autograd.grad(out, (q, kv, sink), torch.randn_like(out))
    from longtrain.dsa.triton.sparse_mla_fwd import _sm90_default

    if _sm90_default(q, D_V):  # the SM90 and stacked probabilities kernels (forced), with and without lengths
        o90, lse90 = sparse_mla_fwd(q.detach(), kv.detach().view(90, -1), idx, 0.1, D_V, length, None, None)
        fused = {"fused": _fused_cfg(), "ws": _ws_bwd_cfg()}
        # (32, 8, 1, 3): the portable probabilities kernel
        for c in ((64, 8, 2, 0, "sm90"), (32, 8, 3, 0, "sm90"), (32, 8, 1, 3), "fused", "ws"):
            for ln in (length, None):
                dout90 = torch.randn_like(o90)
                cfg90 = fused[c] if c in fused else _kcfg(c)
                dq90 = _kcfg((32, 8, 4, 0, "sm90")) if c == "fused" else None  # the SM90 dq kernel's deeper ring
                run_bwd(q.detach(), kv.detach(), o90, dout90, lse90, idx, ln, cfgs=(cfg90, dq90, None))
                if c in fused:  # its deterministic mode (per-slot pieces, then the fixed-order reduction)
                    run_bwd(q.detach(), kv.detach(), o90, dout90, lse90, idx, ln, cfgs=(cfg90, None, None),
                            deterministic=True)  # fmt: skip
        # The dq kernel at 128 heads per program (two programs per row, half of the columns each), two rings.
        q128, kv128 = mla_inputs(90, 128, dev)
        o128, lse128 = sparse_mla_fwd(q128, kv128.view(90, -1), idx, 0.1, D_V, length, None, None)
        for bk, nb in ((64, 4), (32, 2)):
            dq128 = KernelConfig(impl="sm90", block_k=bk, num_stages=nb, block_h=128)
            for ln in (length, None):
                run_bwd(q128, kv128, o128, torch.randn_like(o128), lse128, idx, ln, cfgs=(None, dq128, None))
    for groups in (2, 4):  # the dkv kernel split over value-column groups (and the rope tail's own launch)
        c = mb._DKV_CANDIDATES[0]
        cfg_g = dataclasses.replace(cfg, bwd_dkv=KernelConfig(block_k=c[0], block_h=64, num_warps=c[1],
                                                                num_stages=c[2], col_groups=groups))  # fmt: skip
        out = sparse_mla_triton(q, kv, idx, D_QK**-0.5, d_v=D_V, topk_length=length, attn_sink=sink, config=cfg_g)
        torch.autograd.grad(out, (q, kv, sink), torch.randn_like(out))
    out, _ = sparse_mla_fwd(q.detach(), kv.detach().view(90, -1), idx, 0.1, D_V, None, None, cfg.fwd)
    from longtrain.dsa.triton.sparse_mla_fwd import _SM90_CANDIDATES, _sm90_default

    if _sm90_default(q, D_V):  # the SM90 kernel's gathers: every candidate ring depth, with and without lengths
        for bk, nb in _SM90_CANDIDATES:
            c90 = _kcfg((bk, 8, nb, 0, "sm90"))
            for ln in (length, None):
                o90, _ = sparse_mla_fwd(q.detach(), kv.detach().view(90, -1), idx, 0.1, D_V, ln, sink.detach(), c90)
                assert bool(torch.isfinite(o90).all())
        # The warp-specialized kernel: every ring depth the benchmark times, with and without lengths.
        for bk, nb in ((32, 4), (32, 3), (64, 2)):
            cws = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=bk, num_stages=nb)
            for ln in (length, None):
                ows, _ = sparse_mla_fwd(q.detach(), kv.detach().view(90, -1), idx, 0.1, D_V, ln, sink.detach(), cws)
                assert bool(torch.isfinite(ows).all())
        # The ping-pong kernel, with and without lengths (64 slots: one pair whose second tile is empty).
        cpp = KernelConfig(impl="sm90", layout="ping_pong", num_warps=4, block_k=64, num_stages=2)
        for ln in (length, None):
            opp, _ = sparse_mla_fwd(q.detach(), kv.detach().view(90, -1), idx, 0.1, D_V, ln, sink.detach(), cpp)
            assert bool(torch.isfinite(opp).all())
    iq, ik, iw = indexer_inputs(90, dev)
    sel = indexer_topk_triton(iq, ik, iw, starts, causal, 16, config=IndexerConfig(block_m=64, block_n=128))
    # The sampled select (rows wider than select_cand) and its whole-row fallback (zero-weight rows tie throughout).
    _, _, st600, ca600 = causal_index_sets([600], 64, dev)
    iq, ik, iw = indexer_inputs(600, dev)
    iw[550:] = 0.0
    for sample in (64, 0):
        cfg_s = IndexerConfig(block_m=64, block_n=128, select_sample=sample, select_cand=256)
        indexer_topk_triton(iq, ik, iw, st600, ca600, 24, config=cfg_s)
    # Both scoring kernels: the portable one forced, and on SM90 the Gluon one at both tile widths, three ring depths
    # and both loaders.
    from longtrain.dsa.triton.indexer_topk_sm90 import sm90_scores_unfit

    scores_cfgs = [IndexerConfig(scores_impl="triton")]
    if sm90_scores_unfit(dev, iq.dtype, iq.shape[-1], False, 256, 3) is None:
        scores_cfgs += [IndexerConfig(scores_impl="sm90", sm90_block_n=bn, sm90_num_buf=nb, sm90_loader=ld)
                        for bn, nb in ((256, 5), (256, 3), (128, 8)) for ld in ("cp_async", "tma")]  # fmt: skip
    for cfg_s in scores_cfgs:
        indexer_topk_triton(iq, ik, iw, st600, ca600, 24, config=cfg_s)
    if len(scores_cfgs) > 1:  # the SM90 kernel on FP8 codes, launched directly (not routed by the library yet)
        from longtrain.dsa.triton.indexer_topk import indexer_fp8_operands_triton
        from longtrain.dsa.triton.indexer_topk_sm90 import indexer_topk_fwd_sm90_scores

        q8, k8, w8, ks = indexer_fp8_operands_triton(iq, ik, iw)
        scratch = torch.empty((600, 600), dtype=torch.int32, device=dev)
        indexer_topk_fwd_sm90_scores(q8, k8, w8, ks, st600, ca600, scratch, 0, 600, 24, IndexerConfig())
    from longtrain.dsa.triton._common import indexer_fp8_unfit

    if indexer_fp8_unfit(dev) is None:  # the FP8 scores' variant of the scoring kernel (SM89+)
        indexer_topk_triton(iq, ik, iw, st600, ca600, 24, fp8=True)
    torch.cuda.synchronize()
    print("memcheck case done", bool(torch.isfinite(out).all()), int((sel >= 0).sum()), flush=True)


def _mla_case(add, total: int, heads: int, topk: int, layout: str) -> None:
    from longtrain.dsa import ops

    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets(doc_lengths(total, layout, topk), topk, dev)
    valid = int(length.sum())
    q, kv = mla_inputs(total, heads, dev)
    shape = f"T={total} H={heads} K={topk} {layout} (mean valid {valid / total:.0f})"
    fwd_flops = 2 * valid * heads * (D_QK + D_V)
    bwd_flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)

    def fwd():
        return run_fwd(q, kv, idx, length, None)

    out, lse = fwd()
    dout = torch.randn_like(out)

    def bwd():
        return run_bwd(q, kv, out, dout, lse, idx, length)

    from longtrain.dsa.triton.sparse_mla_fwd import _sm90_default, sm90_forward_kind

    ms = bench(fwd)
    kind = sm90_forward_kind(q, D_V)
    ws_default = kind == "warp_specialized"
    impl = {None: "triton (ours)", "heads": "triton (ours, SM90 Gluon kernel)",
            "warp_specialized": "triton (ours, SM90 warp-specialized kernel)"}[kind]  # fmt: skip
    add(op="sparse_mla_fwd", impl=impl, shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
        tflops=fwd_flops / ms[0] / 1e9, peak_mib=peak_mib(fwd))  # fmt: skip
    if ws_default:  # the two-warpgroup SM90 kernel (the previous default) on the same inputs
        c90 = _kcfg((64, 8, 2, 0, "sm90"))
        ms = bench(lambda: run_fwd(q, kv, idx, length, c90))
        add(op="sparse_mla_fwd", impl="triton (ours, SM90 two-warpgroup kernel, 64 keys x 2 tiles)", shape=shape,
            ms=ms[0], p20=ms[1], p80=ms[2], tflops=fwd_flops / ms[0] / 1e9)  # fmt: skip
    if _sm90_default(q, D_V) and total == 16384 and topk == TOPK and layout == "1doc":
        # The portable kernel on the same inputs: its best config here, and its previous default.
        for c, what in (((64, 8, 2, 0), "64 keys x 2 stages, idx ahead"), ((128, 8, 1, 2), "128 keys x 1 stage")):
            ms = bench(lambda c=c: run_fwd(q, kv, idx, length, _kcfg(c)))
            add(op="sparse_mla_fwd", impl=f"triton (ours, portable kernel, {what})", shape=shape, ms=ms[0],
                p20=ms[1], p80=ms[2], tflops=fwd_flops / ms[0] / 1e9)  # fmt: skip
    ms = bench(bwd)
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_backward_plan

    plan = sm90_backward_plan(q, D_V, None, compute_dkv=True, dkv_forced=False)
    kind = {
        None: "",
        "fused": ", SM90 fused probabilities + dkv kernel",
        "ds": ", SM90 probabilities kernel",
        "fused_ws": ", SM90 warp-specialized probabilities + dkv kernel",
    }
    add(op="sparse_mla_bwd", impl=f"triton (ours{kind[plan and plan[0]]})", shape=shape, ms=ms[0], p20=ms[1],
        p80=ms[2], tflops=bwd_flops / ms[0] / 1e9, peak_mib=peak_mib(bwd))  # fmt: skip
    if _sm90_default(q, D_V) and layout == "1doc":
        # The other probabilities kernels on the same inputs, forced (dq / dkv autotuned): the SM90 stacked one
        # (then the dkv kernel), the portable one, and the fused one that is not the default.
        variants = [(_kcfg((64, 8, 2, 0, "sm90")), "SM90 stacked probabilities kernel 64 keys x 2 tiles + dkv kernel"),
                    (_kcfg(_portable_ds()), "portable probabilities kernel {} keys x {} warps x {} stages + dkv "
                     "kernel".format(*_portable_ds()))]  # fmt: skip
        if plan is None or plan[0] != "fused":
            variants.append((_fused_cfg(), "SM90 two-warpgroup fused probabilities + dkv kernel"))
        if plan is None or plan[0] != "fused_ws":
            variants.append((_ws_bwd_cfg(), "SM90 warp-specialized probabilities + dkv kernel"))
        for cfg, what in variants:
            cfgs = (*cfg, None) if isinstance(cfg, tuple) else (cfg, None, None)
            what = f"triton (ours, {what})"
            try:
                ms = bench(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs))
                add(op="sparse_mla_bwd", impl=what, shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
                    tflops=bwd_flops / ms[0] / 1e9)  # fmt: skip
            except Exception as exc:  # a variant that fails is a row, not a stop
                add(op="sparse_mla_bwd", impl=what, shape=shape, note=f"failed: {type(exc).__name__}: {exc}"[:200])
    if heads == 64 and topk == TOPK and layout == "1doc":
        _cudnn_rows(add, q, kv, idx, length, dout, shape, fwd_flops + bwd_flops, bwd_flops)
    if total == 16384 and topk == TOPK and layout == "1doc":  # TileLang's kernels on the same inputs, where carried
        from longtrain.bench_suites.tilelang_baseline import tilelang_rows

        tilelang_rows(add, bench, q, kv, idx, out, dout, shape, fwd_flops, bwd_flops)
    if not (total == 4096 and heads == 64 and topk == TOPK):
        return
    ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length, deterministic=True), rep_ms=200)
    add(op="sparse_mla_bwd", impl="triton (ours), deterministic", shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
        tflops=bwd_flops / ms[0] / 1e9)  # fmt: skip
    if _sm90_default(q, D_V):  # the deterministic mode through the two-warpgroup fused kernel
        cfgs = (_fused_cfg(), None, None)
        ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs, deterministic=True), rep_ms=200)
        add(op="sparse_mla_bwd", impl="triton (ours), deterministic, SM90 two-warpgroup fused kernel",
            shape=shape, ms=ms[0], p20=ms[1], p80=ms[2], tflops=bwd_flops / ms[0] / 1e9)  # fmt: skip
    # The deterministic mode as it was before its pieces followed dkv's precision: fp32 pieces in 512 MiB.
    from longtrain.dsa.triton import sparse_mla_bwd as smb

    saved = smb.DET_PIECES, smb.DETERMINISTIC_SCRATCH_ELEMENTS
    smb.DET_PIECES, smb.DETERMINISTIC_SCRATCH_ELEMENTS = "fp32", 1 << 27
    try:
        ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length, deterministic=True), rep_ms=200)
    finally:
        smb.DET_PIECES, smb.DETERMINISTIC_SCRATCH_ELEMENTS = saved
    add(op="sparse_mla_bwd", impl="triton (ours), deterministic, fp32 pieces, 512 MiB scratch", shape=shape,
        ms=ms[0], p20=ms[1], p80=ms[2], tflops=bwd_flops / ms[0] / 1e9)  # fmt: skip

    def torch_fwd():
        return ops.sparse_mla_torch_fwd(q, kv, idx, D_QK**-0.5, D_V, length, None)

    def torch_bwd():
        return ops.sparse_mla_torch_bwd(dout, q, kv, idx, D_QK**-0.5, D_V, length, None, (True, True, False))

    ms = bench(torch_fwd, rep_ms=300)
    add(op="sparse_mla_fwd", impl="torch reference (gather)", shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
        tflops=fwd_flops / ms[0] / 1e9, peak_mib=peak_mib(torch_fwd))  # fmt: skip
    ms = bench(torch_bwd, rep_ms=300)
    add(op="sparse_mla_bwd", impl="torch reference (gather, autograd)", shape=shape, ms=ms[0], p20=ms[1],
        p80=ms[2], tflops=bwd_flops / ms[0] / 1e9, peak_mib=peak_mib(torch_bwd))  # fmt: skip


def _cudnn_rows(add, q, kv, idx, length, dout, shape: str, flops: float, bwd_flops: float | None = None) -> None:
    """Forward + backward through ``sparse_mla_attention``: backend "cudnn" (FlashMLA's forward, or ours where
    FlashMLA is not installed, with cuDNN's backward) next to backend "triton" on the same inputs. With
    ``bwd_flops``, each backend's backward alone too: the median of forward + backward minus that of its forward
    (run with grad, as the pair runs it), the rule of every backward row here."""
    from longtrain import _optional
    from longtrain.dsa import ops

    ok, why = _optional.cudnn_dsa()
    fwd_name = "FlashMLA fwd" if _optional.flash_mla()[0] else "our Triton fwd"
    qc = q.detach().requires_grad_(True)
    kvc = kv.detach().requires_grad_(True)
    for backend, impl in (("cudnn", f"cudnn backend: {fwd_name} + cuDNN frontend bwd"), ("triton", "triton (ours)")):
        if backend == "cudnn" and not ok:
            add(op="sparse_mla_fwd+bwd", impl="cudnn backend", shape=shape, note=f"unavailable: {why}")
            continue

        def fwd(backend=backend):
            return ops.sparse_mla_attention(qc, kvc, idx, D_QK**-0.5, d_v=D_V, topk_length=length, backend=backend)

        def fwd_bwd(fwd=fwd):
            torch.autograd.grad(fwd(), (qc, kvc), dout)

        try:
            ms = bench(fwd_bwd)
            add(op="sparse_mla_fwd+bwd", impl=impl, shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
                tflops=flops / ms[0] / 1e9)  # fmt: skip
            if bwd_flops is not None:
                alone = ms[0] - bench(fwd)[0]
                add(op="sparse_mla_bwd", impl=f"{impl}: backward (forward + backward minus forward)", shape=shape,
                    ms=alone, tflops=bwd_flops / alone / 1e9)  # fmt: skip
        except Exception as exc:
            add(op="sparse_mla_fwd+bwd", impl=impl, shape=shape, note=f"failed: {exc!s:.150}")


def _indexer_case(add, total: int, layout: str, selects: list[tuple[int, int, int]] | None = None) -> None:
    from longtrain.dsa.triton.indexer_topk import indexer_topk_fwd

    dev = torch.device("cuda")
    _, _, starts, causal = causal_index_sets(doc_lengths(total, layout, TOPK), TOPK, dev)
    iq, ik, iw = indexer_inputs(total, dev)
    flops = 2 * H_I * D_I * int(causal.to(torch.int64).sum())
    shape = f"T={total} H_I={H_I} D_I={D_I} K={TOPK} {layout}"
    cfg = IndexerConfig()

    def ours():
        return indexer_topk_fwd(iq, ik, iw, starts, causal, TOPK, cfg)

    def torch_ref():
        return torch_indexer_chunked(iq, ik, iw, starts, causal, TOPK)

    def whole_row():
        return indexer_topk_fwd(iq, ik, iw, starts, causal, TOPK, whole_cfg)

    whole_cfg = dataclasses.replace(cfg, select_sample=0)
    overlap = selection_overlap(ours(), torch_ref()) if total <= 16384 else None
    same = bool(torch.equal(ours(), whole_row()))
    ms = bench(ours)
    add(op="indexer_topk", impl="triton (ours, fused)", shape=shape, ms=ms[0], p20=ms[1], p80=ms[2],
        tflops=flops / ms[0] / 1e9, peak_mib=peak_mib(ours))  # fmt: skip
    ms = bench(whole_row)
    add(op="indexer_topk", impl="triton (ours, fused; whole-row radix select, select_sample=0)", shape=shape,
        ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, peak_mib=peak_mib(whole_row),
        note=f"selection {'identical to' if same else 'DIFFERS from'} the default's")  # fmt: skip
    _fp8_row(add, iq, ik, iw, starts, causal, cfg, ours(), shape, flops, total <= 16384)
    for sample, cand, warps in selects or []:
        other = dataclasses.replace(cfg, select_sample=sample, select_cand=cand, select_warps=warps)

        def variant(other=other):
            return indexer_topk_fwd(iq, ik, iw, starts, causal, TOPK, other)

        same = bool(torch.equal(ours(), variant()))
        ms = bench(variant)
        add(op="indexer_topk", impl=f"triton (ours, fused; select_sample={sample}, select_cand={cand}, "
            f"select_warps={warps})", shape=shape, ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9,
            note=f"selection {'identical to' if same else 'DIFFERS from'} the default's")  # fmt: skip
    if overlap is None:  # about a second per call at 64K tokens: timed up to 16K only
        return
    ms = bench(torch_ref, rep_ms=300)
    add(op="indexer_topk", impl="torch reference (scores + topk, 2048-row chunks)", shape=shape, ms=ms[0],
        p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, peak_mib=peak_mib(torch_ref),
        note=f"selection overlap with ours {overlap:.5f}")  # fmt: skip


def _fp8_row(add, iq, ik, iw, starts, causal, cfg, exact_sel, shape, flops, with_reference: bool) -> None:
    """The FP8 indexer (``fp8=True``: E4M3 codes, quantization included in the time), with its selection's overlap
    with the bf16 one and, up to 16K tokens, with the float32 torch selection of the same FP8 scores."""
    from longtrain.dsa.reference import indexer_fp8_operands
    from longtrain.dsa.triton.indexer_topk import indexer_topk_triton_unchecked

    def fp8():
        return indexer_topk_triton_unchecked(iq, ik, iw, starts, causal, TOPK, cfg, fp8=True)

    sel = fp8()
    wide = causal > TOPK  # rows with a choice to make
    note = f"selection overlap with the bf16 selection {selection_overlap(sel[wide], exact_sel[wide]):.5f}"
    if with_reference:
        q8, k8, wf, ks = indexer_fp8_operands(iq, ik, iw)
        ref = torch_indexer_chunked(q8.float(), k8.float() * ks[:, None], wf, starts, causal, TOPK)
        note += f", with the torch selection of the FP8 scores {selection_overlap(sel[wide], ref[wide]):.5f}"
    note += " (rows wider than K)"
    ms = bench(fp8)
    add(op="indexer_topk", impl="triton (ours, fused; FP8 E4M3 scores, fp8=True)", shape=shape, ms=ms[0], p20=ms[1],
        p80=ms[2], tflops=flops / ms[0] / 1e9, peak_mib=peak_mib(fp8), note=note)  # fmt: skip


def print_tuning() -> None:
    """The autotuner's per-candidate timings (first tuned shape) and the compiler's resource use."""
    from longtrain.dsa.triton import indexer_topk as it
    from longtrain.dsa.triton import sparse_mla_bwd as mb
    from longtrain.dsa.triton import sparse_mla_fwd as mf
    from longtrain.dsa.triton import sparse_mla_fwd_sm90 as m90

    for name, tuned in list(mf._AUTOTUNED.items()) + list(mb._AUTOTUNED.items()):
        timings = {
            str(k): round(v[0] if isinstance(v, list) else v, 4)
            for k, v in getattr(tuned, "configs_timings", {}).items()
        }
        print(f"tuning {name}: best {tuned.best_config} timings {timings}", flush=True)
    kernels = {
        "fwd": mf.sparse_mla_fwd_kernel,
        "fwd_sm90": m90.sparse_mla_fwd_sm90_kernel,
        "bwd_ds": mb.sparse_mla_bwd_kernel_ds,
        "bwd_dq": mb.sparse_mla_bwd_kernel_dq,
        "bwd_dkv": mb.sparse_mla_bwd_kernel_dkv,
        "scores": it.indexer_topk_fwd_kernel_scores,
        "select": it.indexer_topk_fwd_kernel_select,
    }
    for name, kernel in kernels.items():
        for row in compiled_stats(kernel):
            print("compiled", name, row, flush=True)


def full(quick: bool = False, flush=None) -> list[dict]:
    rows: list[dict] = []

    def add(**row):
        rows.append(row)
        print(row, flush=True)
        if flush is not None:
            flush(rows)  # a run cut short still leaves a report of what it measured

    cases = [(16384, 64, TOPK, "1doc"), (4096, 64, TOPK, "1doc"), (16384, 64, TOPK, "docs"),
             (16384, 128, TOPK, "1doc"), (16384, 64, 512, "1doc")]  # fmt: skip
    for i, case in enumerate(cases[: 2 if quick else None]):
        _mla_case(add, *case)
        torch.cuda.empty_cache()
        if i == 0:
            print_tuning()
    for total, layout in ((4096, "1doc"), (16384, "1doc"), (16384, "docs"))[: 2 if quick else None]:
        _indexer_case(add, total, layout)
        torch.cuda.empty_cache()
    return rows


def torch_indexer_chunked(q, k, w, starts, causal, topk, chunk=2048):
    """Materialised scores (bf16 logits -> fp32) + window mask + ``torch.topk``, 2048 query rows at a time."""
    total = q.shape[0]
    out = torch.full((total, topk), -1, dtype=torch.int32, device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    for r0 in range(0, total, chunk):
        r1 = min(total, r0 + chunk)
        logits = torch.einsum("thd,sd->ths", q[r0:r1], k).float()
        scores = torch.einsum("th,ths->ts", w[r0:r1], logits.clamp_min_(0))
        lo = starts[r0:r1, None].long()
        ok = (keys[None, :] >= lo) & (keys[None, :] < lo + causal[r0:r1, None].long())
        scores.masked_fill_(~ok, float("-inf"))
        vals, ids = scores.topk(min(topk, k.shape[0]), dim=1)
        ids = torch.where(torch.isfinite(vals), ids, k.shape[0]).sort(dim=1).values
        out[r0:r1, : ids.shape[1]] = torch.where(ids < k.shape[0], ids, -1).to(torch.int32)
    return out


def selection_overlap_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, |a ∩ b| / |b| over the valid (``>= 0``) entries of two ``[T, K]`` selections (float64, ``[T]``)."""
    n = int(max(a.max().item(), b.max().item())) + 2
    rows = []
    for r0 in range(0, a.shape[0], 1024):
        aa, bb = a[r0 : r0 + 1024].long(), b[r0 : r0 + 1024].long()
        ma = torch.zeros((aa.shape[0], n), dtype=torch.bool, device=a.device)
        ma.scatter_(1, torch.where(aa >= 0, aa, n - 1), True)
        ma[:, n - 1] = False
        inter = torch.gather(ma, 1, torch.where(bb >= 0, bb, n - 1)) & (bb >= 0)
        rows.append(inter.sum(1).double() / (bb >= 0).sum(1).clamp_min(1).double())
    return torch.cat(rows)


def selection_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of :func:`selection_overlap_rows`."""
    return float(selection_overlap_rows(a, b).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every candidate launch config")
    parser.add_argument("--fwd-only", action="store_true", help="with --sweep: the forward kernels only")
    parser.add_argument("--memcheck", action="store_true", help="one small launch of each kernel")
    parser.add_argument("--precompile", action="store_true", help="compile the shipped configs in parallel first")
    parser.add_argument("--quick", action="store_true", help="first shapes only")
    parser.add_argument("--tokens", type=int, default=16384, help="sweep token count")
    parser.add_argument("--out-dir", default=None, help="report folder (default benchmarks/results)")
    parser.add_argument(
        "--case", action="append", default=None, metavar="T,H,K,LAYOUT",
        help="only these sparse MLA cases (e.g. 16384,64,2048,1doc); report dsa_cases_<date>",
    )  # fmt: skip
    parser.add_argument(
        "--indexer-case", action="append", default=None, metavar="T,LAYOUT",
        help="only these indexer cases (e.g. 16384,1doc); report dsa_indexer_<date>",
    )  # fmt: skip
    parser.add_argument(
        "--select", action="append", default=None, metavar="SAMPLE,CAND,WARPS",
        help="with --indexer-case: also time the selection with these IndexerConfig select_* values",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dsa.py needs a CUDA GPU")
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.memcheck:
        memcheck()
        return
    if args.sweep:
        sweep(args.tokens, out_dir, fwd_only=args.fwd_only)
        return
    if args.precompile:
        from longtrain.dsa.triton.sparse_mla_fwd import _FWD_CANDIDATES

        jobs = [("fwd", (h, D_QK, _kcfg(c))) for h in (64, 128) for c in _FWD_CANDIDATES]
        jobs += _sm90_jobs(64) + _sm90_jobs(128)
        jobs += _bwd_jobs(64) + _bwd_jobs(128)
        jobs += [("idx", IndexerConfig())]
        if args.quick:
            jobs = [j for j in jobs if j[0] == "idx" or j[1][0] == 64]
        precompile(jobs)
    notes = __doc__.split("Shapes:", 1)[1].strip()
    notes += (
        "\n\nAnchors (same H200 kind, anchors.md Appendix C): TileLang sparse_mla_fwd 307 TFLOP/s and bwd 169 at "
        "T=16384 H=64 (1doc); plain-torch indexer 76.7 ms at T=16384. Reproduce: "
        "`PYTHONPATH=src python benchmarks/dsa.py --precompile`."
    )
    columns = ["op", "impl", "shape", "ms", "p20", "p80", "tflops", "peak_mib", "note"]
    title = "DSA kernels: Triton sparse MLA + fused indexer top-k"

    def flush(rows):
        return write_report("dsa", rows, columns, notes, out_dir=out_dir, title=title)

    rows: list[dict] = []

    def add(**row):
        rows.append(row)
        print(row, flush=True)

    if args.indexer_case:
        for case in args.indexer_case:
            total, layout = case.split(",")
            selects = [tuple(int(v) for v in sel.split(",")) for sel in args.select or []]
            _indexer_case(add, int(total), layout, selects)
        print("report:", *write_report("dsa_indexer", rows, columns, notes, out_dir=out_dir, title=title))
        return
    if args.case:
        for case in args.case:
            total, heads, topk, layout = case.split(",")
            _mla_case(add, int(total), int(heads), int(topk), layout)
        print("report:", *write_report("dsa_cases", rows, columns, notes, out_dir=out_dir, title=title))
        return
    rows = full(quick=args.quick, flush=flush)
    print("report:", *flush(rows))


if __name__ == "__main__":
    main()
