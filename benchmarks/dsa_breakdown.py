"""Where the sparse MLA forward and backward spend their GPU time: every kernel's share, per shape (CUDA).

``python benchmarks/dsa_breakdown.py [--out-dir DIR] [--case T,H,K ...]`` writes ``dsa_breakdown_<date>.md``: for
each case (one document, random causal index sets as in ``dsa.py``) and each pass (forward, backward at the
defaults, deterministic backward at its defaults, bf16 pieces in 2 GiB here, and with fp32 pieces in 512 MiB, its
defaults until the thirty-fourth session), the kernels that ``torch.profiler`` saw over ``ITERS`` calls, with their
device time per call and share of the pass's kernel time, beside the pass's ``do_bench`` median (the gap is launch
and host time). Kernel names are shortened to the Triton function's name. For the kernels that add or store dkv's fp32
pieces (the probabilities + dkv kernel, the deterministic reduction) a column gives the rate of those bytes,
``valid slots x head blocks x D_qk x 4`` (x 2 for bf16 pieces), to set beside the reduction probe's ceiling
(``python benchmarks/dsa_bwd_ws.py --pattern-probe``). ``--bf16-pieces`` adds the deterministic backward with bf16
pieces (``sparse_mla_bwd.DET_PIECES``) and a 2 GiB scratch, alone and with the SM partition (``DQ_OVERLAP =
"partition"``); ``--fp16-pieces`` the same with bf16 and with scaled fp16 pieces (their scales not counted in the
rate).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, reproduce_args, write_report  # noqa: E402
from longtrain.bench_suites.dsa import bench, causal_index_sets, mla_inputs, run_bwd, run_fwd  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd as smb  # noqa: E402

ITERS = 10
CASES = ["16384,64,2048", "4096,128,512", "4096,64,2048"]
# Kernels whose traffic is dkv's fp32 pieces: each (valid slot, block of 64 heads) adds (or stores, or reads back)
# one D_qk-wide row.
PIECE_KERNELS = ("sparse_mla_bwd_sm90_ws_kernel", "sparse_mla_bwd_kernel_dkv_reduce")
DET_PASS = "backward, deterministic (its defaults: bf16 pieces, 2 GiB)"
FP32_PASS = "backward, deterministic, fp32 pieces, 512 MiB"
BF16_PASS = "backward, deterministic, bf16 pieces, 2 GiB"
FP16_PASS = "backward, deterministic, scaled fp16 pieces, 2 GiB"


def kernel_times(fn) -> dict[str, float]:
    """Device microseconds per call of ``fn`` by kernel name, over ``ITERS`` profiled calls."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        totals[re.sub(r"_0d1d.*|\(.*", "", evt.name)[:80]] += evt.device_time / ITERS
    return dict(totals)


def _with_settings(fn, **settings):
    """``fn`` run with ``sparse_mla_bwd``'s module settings changed for the call, restored after."""

    def run():
        saved = {k: getattr(smb, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(smb, k, v)
            return fn()
        finally:
            for k, v in saved.items():
                setattr(smb, k, v)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--case", action="append", help=f"T,H,K (repeatable; default: {' '.join(CASES)})")
    bf16_help = "also the deterministic backward with bf16 pieces (DET_PIECES), 2 GiB scratch, with and without the "
    bf16_help += "SM partition"
    ap.add_argument("--bf16-pieces", action="store_true", help=bf16_help)
    ap.add_argument("--fp16-pieces", action="store_true", help="also the deterministic backward with bf16 and with "
                    "scaled fp16 pieces (DET_PIECES), 2 GiB scratch")  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for case in args.case or CASES:
        total, heads, topk = (int(x) for x in case.split(","))
        idx, length, _, _ = causal_index_sets([total], topk, dev)
        q, kv = mla_inputs(total, heads, dev)
        out, lse = run_fwd(q, kv, idx, length, None)
        dout = torch.randn_like(out)
        piece_bytes = int(length.sum()) * -(-heads // 64) * q.shape[-1] * 4
        passes = {
            "forward": partial(run_fwd, q, kv, idx, length, None),
            "backward": partial(run_bwd, q, kv, out, dout, lse, idx, length),
            DET_PASS: partial(run_bwd, q, kv, out, dout, lse, idx, length, deterministic=True),
        }
        passes[FP32_PASS] = _with_settings(passes[DET_PASS], DET_PIECES="fp32", DETERMINISTIC_SCRATCH_ELEMENTS=1 << 27)
        if args.bf16_pieces:
            det = passes[DET_PASS]
            bf16 = dict(DET_PIECES="bf16", DETERMINISTIC_SCRATCH_ELEMENTS=1 << 30)
            passes[BF16_PASS] = _with_settings(det, **bf16)
            passes[BF16_PASS + ", SM partition 32"] = _with_settings(det, **bf16, DQ_OVERLAP="partition")
        if args.fp16_pieces:
            det = passes[DET_PASS]
            passes[BF16_PASS] = _with_settings(det, DET_PIECES="bf16", DETERMINISTIC_SCRATCH_ELEMENTS=1 << 30)
            passes[FP16_PASS] = _with_settings(det, DET_PIECES="fp16", DETERMINISTIC_SCRATCH_ELEMENTS=1 << 30)
        for name, fn in passes.items():
            fn()
            torch.cuda.synchronize()
            med, _, _ = bench(fn)
            times = kernel_times(fn)
            whole = sum(times.values())
            shape = f"T={total} H={heads} K={topk}"
            rows.append(dict(shape=shape, op=name, kernel="(all kernels)", us=whole, share=1.0, median_ms=med))
            for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]):
                row = dict(shape=shape, op=name, kernel=kernel, us=us, share=us / whole)
                if kernel in PIECE_KERNELS and name != "forward":
                    two_bytes = name.startswith((DET_PASS, BF16_PASS, FP16_PASS))  # bf16 inputs: bf16 pieces
                    row["piece_gbps"] = piece_bytes / (2 if two_bytes else 1) / us / 1e3
                rows.append(row)
            print(shape, name, f"median {med:.3f} ms, kernels {whole / 1000:.3f} ms", flush=True)
    cols = [
        "shape",
        "op",
        "kernel",
        ("us", "us per call"),
        "share",
        ("median_ms", "do_bench ms"),
        ("piece_gbps", "dkv pieces GB/s"),
    ]
    notes = (
        f"torch.profiler over {ITERS} calls after one warm call; `us per call`: the kernel's device time summed over "
        "its launches, per call; `do_bench ms`: the pass's median with the L2 flushed (the profiled calls run back to "
        "back, so their kernels see a warmer L2); `dkv pieces GB/s`: the fp32 dkv rows the kernel adds, stores or "
        "reads back (valid slots x head blocks x D_qk x 4 bytes, x 2 with bf16 pieces) per second of its device "
        "time. Reproduce: "
        f"`python benchmarks/dsa_breakdown.py {reproduce_args()}`."
    )
    md, _ = write_report("dsa_breakdown", rows, cols, notes, out_dir=args.out_dir,
                         title="Sparse MLA: GPU time by kernel")  # fmt: skip
    print(md.read_text())


if __name__ == "__main__":
    main()
