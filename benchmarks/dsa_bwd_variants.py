"""Where the sparse MLA backward's time goes, and launch configs past its autotuner's candidates (CUDA; experiment).

``python benchmarks/dsa_bwd_variants.py [--out-dir DIR] [--heads 64] [--tokens 16384]`` writes
``dsa_bwd_variants_<date>.md``: at T tokens of one document (K = 2048, GLM-5.2 dims),

- the autotuned backward, its per-kernel split (``torch.profiler``: preprocess, probabilities ``ds``, ``dq``, ``dkv``)
  and each kernel's autotuned pick;
- for each of the three kernels, the whole backward with that kernel forced to each config of a wider list
  (the other two at their autotuned picks), with the largest difference of its dq / dkv from the autotuned
  backward's (the dkv atomics add in a different order, so the difference is a rounding, not 0).

Not shipped: a config that wins moves into ``longtrain.dsa.triton.sparse_mla_bwd``'s candidate lists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import (  # noqa: E402
    D_QK,
    D_V,
    TOPK,
    _kcfg,
    bench,
    causal_index_sets,
    mla_inputs,
    precompile,
    run_bwd,
    run_fwd,
)

# (block_k, num_warps, num_stages) per kernel: the autotuner's candidates and their neighbours.
WIDER = {
    "ds": [(32, 4, 2), (32, 4, 3), (32, 4, 4), (16, 4, 2), (16, 4, 4), (64, 4, 2), (64, 8, 1), (32, 8, 2), (16, 8, 3)],
    "dq": [(64, 8, 2), (32, 8, 3), (128, 8, 1), (32, 4, 2), (32, 4, 3), (64, 4, 2), (16, 4, 4), (64, 8, 3)],
    "dkv": [(64, 8, 2), (64, 8, 3), (64, 4, 2), (32, 8, 2), (32, 8, 3), (128, 8, 1), (32, 4, 2), (16, 8, 4)],
}
KERNELS = ("ds", "dq", "dkv")


def _picked(name: str) -> tuple[int, int, int]:
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    best = mb._AUTOTUNED[name].best_config
    return best.kwargs["BLOCK_K"], best.num_warps, best.num_stages


def _split(fn) -> dict[str, float]:
    """CUDA ms per call of each backward kernel (one profiled call after a warm one)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if "sparse_mla_bwd_kernel" in ev.key:
            short = ev.key.split("sparse_mla_bwd_kernel_")[-1].split("(")[0]
            total_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            out[short] = out.get(short, 0.0) + total_us / 1e3
    return out


def main(out_dir: Path, heads: int, total: int) -> None:
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], TOPK, dev)
    valid = int(length.sum())
    q, kv = mla_inputs(total, heads, dev)
    bwd_flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    shape = f"T={total} H={heads} K={TOPK} 1doc"

    ref_dq, ref_dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length)  # autotunes the three kernels
    picks = {name: _picked(name) for name in KERNELS}
    jobs = []
    for name in KERNELS:
        for c in WIDER[name]:
            cfg = tuple(_kcfg(c if other == name else picks[other]) for other in KERNELS)
            jobs.append(("bwd", (heads, D_QK, cfg)))
    precompile(jobs)

    rows: list[dict] = []
    ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length), rep_ms=300)
    split = _split(lambda: run_bwd(q, kv, out, dout, lse, idx, length))
    note = "split " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items())
    note += "; picks " + ", ".join(f"{k} {picks[k]}" for k in KERNELS)
    rows.append(dict(shape=shape, kernel="all (autotuned)", cfg="-", ms=ms[0], p20=ms[1], p80=ms[2],
                     tflops=bwd_flops / ms[0] / 1e9, note=note))  # fmt: skip
    print(rows[-1], flush=True)
    scale_dq = ref_dq.float().abs().max().item()
    scale_dkv = ref_dkv.float().abs().max().item()
    for name in KERNELS:
        for c in WIDER[name]:
            cfgs = tuple(_kcfg(c if other == name else picks[other]) for other in KERNELS)
            try:
                dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs)
                diff = max((dq.float() - ref_dq.float()).abs().max().item() / scale_dq,
                           (dkv.float() - ref_dkv.float()).abs().max().item() / scale_dkv)  # fmt: skip
                ms = bench(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs), rep_ms=300)
                split = _split(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs))
                row = dict(shape=shape, kernel=name, cfg=str(c), ms=ms[0], p20=ms[1], p80=ms[2],
                           tflops=bwd_flops / ms[0] / 1e9, kernel_ms=split.get(name, float("nan")),
                           rel_diff=diff)  # fmt: skip
            except Exception as exc:  # a config that does not compile or launch is a row, not a stop
                row = dict(shape=shape, kernel=name, cfg=str(c), note=f"failed: {type(exc).__name__}: {exc}"[:200])
            print(row, flush=True)
            rows.append(row)
    write_report(
        "dsa_bwd_variants", rows,
        ["shape", "kernel", "cfg", "ms", "p20", "p80", "tflops", "kernel_ms", "rel_diff", "note"],
        "Sparse MLA backward (bf16, one document, random causal index sets, L2 flushed): the autotuned run and each "
        "kernel forced to each config (block_k, num_warps, num_stages) with the other two at their autotuned picks. "
        "kernel_ms: that kernel's CUDA time in one profiled call (every row chunk). rel_diff: largest difference of "
        "dq / dkv from the autotuned run's, relative to its largest magnitude. Reproduce: "
        "`python benchmarks/dsa_bwd_variants.py`.",
        out_dir=out_dir, title="Sparse MLA backward: per-kernel split and wider launch configs (H200)",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    main(args.out_dir, args.heads, args.tokens)
