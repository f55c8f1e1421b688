"""How much the FP8 indexer (``indexer_topk(..., fp8=True)``) changes the selection: numerics, on any machine.

``python benchmarks/dsa_fp8_overlap.py [--tokens 4096 16384] [--out-dir DIR]`` writes
``benchmarks/results/dsa_indexer_fp8_overlap_<date>.md``.

Inputs are the DSA benchmark's (``benchmarks/dsa.py``): GLM-5.2's indexer (H_I = 32, D_I = 128, K = 2048), bf16 q and
k from a normal distribution, fp32 head weights, one causal document or documents U[K, 4K]. Both selections come
from the torch route, whose scores are exact float32 sums: the bf16 inputs' scores, and the FP8 scores (E4M3 codes
with power-of-two scales, ``longtrain.dsa.reference.indexer_fp8_operands``). So the overlap is the quantization's
effect alone; the FP8 kernel on a GPU adds its tensor cores' accumulation rounding (``benchmarks/dsa.py
--indexer-case`` reports the kernel's overlap next to its time). Overlap = the mean over rows wider than K of the
share of the bf16 selection the FP8 selection also holds. Random inputs are a hard case: their scores are close
together (a trained indexer's top scores stand further apart).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import (  # noqa: E402
    D_I,
    H_I,
    TOPK,
    causal_index_sets,
    doc_lengths,
    indexer_inputs,
    selection_overlap_rows,
)
from longtrain.dsa import ops  # noqa: E402
from longtrain.dsa.reference import indexer_fp8_operands  # noqa: E402


def measure(total: int, layout: str) -> dict:
    dev = torch.device("cpu")
    _, _, starts, causal = causal_index_sets(doc_lengths(total, layout, TOPK), TOPK, dev)
    iq, ik, iw = indexer_inputs(total, dev)
    t0 = time.perf_counter()
    exact = ops._indexer_topk_torch(iq, ik, iw, starts, causal, TOPK)
    q8, k8, wf, ks = indexer_fp8_operands(iq, ik, iw)
    fp8 = ops._indexer_topk_torch(q8.float(), k8.float() * ks[:, None], wf, starts, causal, TOPK)
    wide = causal > TOPK
    per_row = selection_overlap_rows(fp8[wide], exact[wide])
    return dict(
        tokens=total,
        layout=layout,
        rows_wider_than_k=int(wide.sum()),
        overlap=float(per_row.mean()),
        worst_row=float(per_row.min()),
        p01_row=float(per_row.quantile(0.01)),
        seconds=time.perf_counter() - t0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--layouts", nargs="+", default=["1doc", "docs"])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    rows = []
    for total in args.tokens:
        for layout in args.layouts:
            row = measure(total, layout)
            print(row, flush=True)
            rows.append(row)
    notes = (
        f"GLM-5.2 indexer: H_I = {H_I}, D_I = {D_I}, K = {TOPK}; bf16 q, k ~ N(0, 1), fp32 head weights "
        "N(0, 1) / sqrt(H_I D_I). Both selections from the torch route (exact float32 scores): bf16 inputs vs "
        "their FP8 codes (fp8=True). overlap = mean over rows wider than K of |FP8 selection & bf16 selection| / K; "
        "worst_row / p01_row = the smallest and the 1st-percentile row. seconds = both selections on this machine. "
        "Reproduce: `python benchmarks/dsa_fp8_overlap.py --tokens " + " ".join(map(str, args.tokens)) + "`."
    )
    md, _ = write_report(
        "dsa_indexer_fp8_overlap",
        rows,
        ["tokens", "layout", "rows_wider_than_k", "overlap", "worst_row", "p01_row", "seconds"],
        notes,
        out_dir=args.out_dir,
        title="FP8 indexer: selection overlap with the bf16 selection (numerics)",
    )
    print("report:", md)


if __name__ == "__main__":
    main()
