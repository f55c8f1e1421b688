"""Block-diagonal (document-causal) attention: every backend side by side on one GPU.

Packed documents of lengths drawn from U[512, 8192] (seed 1) and U[64, 2048] (seed 2) filling 32K and 64K
tokens; Hq=32, Hkv=8 (GQA 4:1), D=128, bf16. For each backend: forward and backward TFLOP/s with the
project convention (forward ``4 * MaskArea * Hq * D``, backward 2.5x that, MaskArea of a causal document of
length L = L(L+1)/2), median with p20/p80 from ``triton.testing.do_bench`` after a warm-up (compile,
autotune), and the peak memory of one forward+backward above the inputs. A backend that cannot run reports
``unavailable: <reason>`` or ``OOM`` instead of disappearing.

Run on a GPU (``longtrain bench blockdiag`` runs it too)::

    python benchmarks/blockdiag_attention.py [--tokens 32768 65536] [--out-dir DIR]   # from a checkout
    python -m longtrain.bench_suites.blockdiag_attention [...]                        # from an installed package

It writes ``blockdiag_attention_<date>.md`` and ``.json`` (machine header first) to ``--out-dir``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import traceback

import torch

from longtrain.bench_suites.report import machine_header, write_report
from longtrain.blockdiag_cp import (
    build_cp_step,
    cp_varlen_attention,
    kernels,
    providers,
    runtime,
    varlen_attention,
)
from longtrain.blockdiag_cp.meta import meta_from_dict, validate_meta_dict
from longtrain.blockdiag_cp.providers import cudnn, cudnn_cute, cudnn_graph, flash
from longtrain.packing import BENCH_LAYOUTS, doc_lengths, ids_from_lengths

HQ, HKV, D = 32, 8, 128
LAYOUTS = BENCH_LAYOUTS


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> the SDPA-layout view ``[1, H, T, D]`` (no copy)."""
    return t.transpose(0, 1).unsqueeze(0)


def mask_area(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def _varlen_attn_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, "torch.nn.attention.varlen not in this torch"
    params = inspect.signature(varlen_attn).parameters
    return (varlen_attn, params), None


def backends(meta, total: int):
    """name -> (callable(q, k, v) -> out, reason-if-unavailable). q/k/v are packed THD tensors of one row."""
    out: dict[str, tuple] = {}
    dev = meta.cu_q.device
    cu, max_len = meta.cu_q, meta.max_q

    def provider(name, **kw):
        return lambda q, k, v: runtime.attend(q, k, v, meta, name, **kw)

    out["flash (torch FA2, GQA native)"] = (lambda q, k, v: flash.torch_flash_varlen(q, k, v, cu, cu, max_len, max_len),
                                            flash.torch_flash_reason())  # fmt: skip

    va, why = _varlen_attn_fn()
    if va is None:
        out["torch varlen_attn (K/V repeated)"] = (None, why)
    else:
        fn, params = va
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        gqa = "enable_gqa" in params

        def torch_varlen(q, k, v):
            if not gqa:
                k = k.repeat_interleave(HQ // HKV, dim=1)
                v = v.repeat_interleave(HQ // HKV, dim=1)
            extra = {"enable_gqa": True} if gqa else {}
            return fn(q, k, v, cu, cu, max_len, max_len, **causal, **extra)

        name = "torch varlen_attn" + (" (enable_gqa)" if gqa else " (K/V repeated)")
        out[name] = (torch_varlen, None)

    fa = flash.flash_attn_module()
    if fa is None:
        out["flash_attn package"] = (None, "flash_attn not installed")
    else:
        out["flash_attn package"] = (
            lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True),
            None,
        )
    for name, label in (
        ("flex", "flex (compiled, block mask)"),
        ("te", "te (thd)"),
        ("fa4", "fa4 (FlashAttention-4)"),
        ("cudnn_fa4", "cudnn_fa4 (CuTe fwd + FA4 bwd)"),
        ("fa4_cudnn", "fa4_cudnn (FA4 fwd + CuTe bwd)"),
    ):
        out[label] = (provider(name), providers.unavailable_reason(name, torch.bfloat16, dev))

    cudnn_reason = providers.unavailable_reason("cudnn", torch.bfloat16, dev)
    cudnn_rows = (
        ("cudnn (CuTe DSL route: fwd + bwd)", "cute", "auto", None),
        ("cudnn (graph, top-left diagonal + cuDNN bwd)", "graph", "auto", None),
        ("cudnn (graph, bottom-right diagonal + Triton bwd)", "graph", "triton", "BOTTOM_RIGHT"),
        ("cudnn (graph, bottom-right diagonal + FA2 bwd)", "graph", "fa2", "BOTTOM_RIGHT"),
        ("cudnn (graph, bottom-right diagonal + cuDNN bwd)", "graph", "cudnn", "BOTTOM_RIGHT"),
    )
    for label, route, bwd, align in cudnn_rows:

        def run_cudnn(q, k, v, route=route, bwd=bwd, align=align):
            saved = cudnn.ROUTE, cudnn_graph.BACKWARD
            cudnn.ROUTE, cudnn_graph.BACKWARD = route, bwd
            try:
                if route == "cute":
                    return cudnn.attention(q, k, v, meta)
                return cudnn_graph.graph_attention(q, k, v, meta, scale=D**-0.5, align=align)
            finally:
                cudnn.ROUTE, cudnn_graph.BACKWARD = saved

        reason = cudnn_reason
        if reason is None and route == "cute":
            probe = torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16)
            reason = cudnn_cute.cute_unavailable_reason(probe, probe[:, :HKV])
        out[label] = (run_cudnn if reason is None else None, reason)

    ids = meta.cache["_bench_ids"]
    step = build_cp_step(ids, None, device=dev, attn_backend="auto")

    def driver(q, k, v):
        res = kernels._cp_blockdiag_varlen(
            _bhsd(q), _bhsd(k), _bhsd(v), ids, 0, backend="auto", meta=meta.cache["_dict"]
        )
        if res is None:
            raise RuntimeError("_cp_blockdiag_varlen(backend='auto') fell back (returned None)")
        return res.squeeze(0).transpose(0, 1)  # squeeze, not [0]: a select's backward would add a copy

    out["driver _cp_blockdiag_varlen(auto)"] = (driver, None)
    out["cp_varlen_attention (W=1 step, auto)"] = (lambda q, k, v: cp_varlen_attention(q, k, v, step), None)
    out["varlen_attention(auto)"] = (lambda q, k, v: varlen_attention(q, k, v, cu, cu, max_len, max_len), None)
    out["dense mask + SDPA (efficient)"] = (
        lambda q, k, v: kernels.dense_blockdiag_sdpa(_bhsd(q), _bhsd(k), _bhsd(v), ids, 0).squeeze(0).transpose(0, 1),
        None,
    )
    oracle = None if total <= 32768 else "skipped above 32K tokens (oracle)"
    out["reference (per-doc math SDPA)"] = (provider("reference"), oracle)
    return out


def _median3(fn) -> tuple[float, float, float]:
    """(median, min, max) ms of three event-timed calls, for functions too slow for do_bench's repetitions."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[1], times[0], times[2]


def bench_one(fn, q, k, v, dout, flops_fwd: float, do_bench) -> dict:
    row: dict = {}
    fn(q, k, v)  # warm-up: compile, autotune, graph build
    torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()

    def fwd_bwd():
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    slow = _median3(fwd_bwd)[0] > 400.0
    qs = [0.5, 0.2, 0.8]
    with torch.no_grad():
        f50, f20, f80 = _median3(lambda: fn(q, k, v)) if slow else do_bench(lambda: fn(q, k, v), quantiles=qs, rep=200)
    t50, t20, t80 = _median3(fwd_bwd) if slow else do_bench(fwd_bwd, quantiles=qs, rep=300)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    b50 = max(t50 - f50, 1e-6)
    row.update(
        fwd_ms=f50,
        fwd_p20=f20,
        fwd_p80=f80,
        bwd_ms=b50,
        fwdbwd_p20=t20,
        fwdbwd_p80=t80,
        fwd_tflops=flops_fwd / f50 / 1e9,
        bwd_tflops=2.5 * flops_fwd / b50 / 1e9,
        peak_gib=peak / 2**30,
        timing="3 calls (slow)" if slow else "do_bench",
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--only", nargs="*", default=None, help="substrings of backend names to run")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default="blockdiag_attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    from triton.testing import do_bench

    dev = torch.device("cuda")
    rows = []
    for total in args.tokens:
        for layout in args.layouts:
            lo, hi, seed = LAYOUTS[layout]
            lengths = doc_lengths(total, lo, hi, seed)
            ids = ids_from_lengths(lengths)
            meta_dict = kernels.precompute_blockdiag_varlen_meta(ids, 0, total, dev)
            assert validate_meta_dict(meta_dict, total, total, dev) is None
            meta = meta_from_dict(meta_dict)
            meta.cache.update(_bench_ids=ids.to(dev), _dict=meta_dict)
            max_len = meta.max_q
            flops = 4.0 * mask_area(lengths) * HQ * D
            gen = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
            dout = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
            base = {"tokens": total, "layout": f"U[{lo},{hi}] seed {seed}", "docs": len(lengths), "max_doc": max_len}
            for name, (fn, reason) in backends(meta, total).items():
                if args.only and not any(s in name for s in args.only):
                    continue
                row = {**base, "backend": name}
                if fn is None or reason is not None:
                    row["status"] = f"unavailable: {reason}"
                else:
                    try:
                        row.update(bench_one(fn, q, k, v, dout, flops, do_bench))
                        row["status"] = "ok"
                    except torch.OutOfMemoryError:
                        row["status"] = "OOM"
                    except Exception as exc:
                        traceback.print_exc()
                        row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
                    torch.cuda.empty_cache()
                rows.append(row)
                print(
                    f"{total:6d} {layout:5s} {name:40s} "
                    + (
                        f"fwd {row['fwd_tflops']:6.1f}  bwd {row['bwd_tflops']:6.1f} TFLOP/s  "
                        f"({row['fwd_ms']:.3f} / {row['bwd_ms']:.3f} ms, peak {row['peak_gib']:.2f} GiB)"
                        if row.get("status") == "ok"
                        else row["status"]
                    ),
                    flush=True,
                )
    columns = [
        ("tokens", "tokens"),
        ("layout", "documents"),
        ("docs", "n docs"),
        ("max_doc", "max doc"),
        ("backend", "backend"),
        ("fwd_tflops", "fwd TFLOP/s"),
        ("bwd_tflops", "bwd TFLOP/s"),
        ("fwd_ms", "fwd ms (p50)"),
        ("fwd_p20", "fwd p20"),
        ("fwd_p80", "fwd p80"),
        ("bwd_ms", "bwd ms (p50)"),
        ("peak_gib", "peak GiB (fwd+bwd)"),
        ("timing", "timing"),
        ("status", "status"),
    ]
    notes = (
        f"Hq={HQ}, Hkv={HKV}, D={D}, bf16, per-document causal. FLOPs: forward 4*MaskArea*Hq*D with MaskArea = "
        "sum L(L+1)/2, backward 2.5x forward; backward time = median(fwd+bwd) - median(fwd). do_bench medians "
        "(p20/p80) after warm-up; peak memory = max allocated during one forward+backward minus the inputs. "
        "'torch varlen_attn (K/V repeated)' includes the repeat_interleave of K/V (torch 2.11 has no enable_gqa). "
        "The 'driver' row goes through kernels._cp_blockdiag_varlen with a precomputed meta, including the "
        "SDPA-layout packing copies; 'cp_varlen_attention' runs a one-rank CPStep, 'varlen_attention' the public "
        "THD function (offsets validated once, then cached). Functions slower than 400 ms per forward+backward are "
        "timed as the median of 3 calls. "
    )
    if providers.unavailable_reason("cudnn", torch.bfloat16, dev) is None:
        notes += (
            f"cuDNN graph cache after the run: {cudnn_graph.cudnn_graph_cache_stats()}; CuTe DSL mask plans: "
            f"{cudnn_cute.PLAN_STATS} (one plan per layout and autograd mode, reused by every later call with the "
            "same meta). "
        )

    md, js = write_report(args.name, rows, columns, notes, header=machine_header(), out_dir=args.out_dir,
                          title="Block-diagonal attention backends (one GPU)")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
