"""The warp-specialized and ping-pong SM90 sparse MLA forwards against the two-warpgroup one (CUDA; experiment).

``python benchmarks/dsa_fwd_ws.py [--out-dir DIR] [--tokens 16384,4096] [--heads 64,128]`` writes
``dsa_fwd_ws_<date>.md``: at T tokens of one document (K = 2048, GLM-5.2 dims, random causal index sets as in
``dsa.py``), the forward at ``config=None`` (today's default), the two-warpgroup SM90 kernel forced to its first
candidate, the warp-specialized kernel (``KernelConfig(impl="sm90", layout="warp_specialized")``) at each ring and
the ping-pong kernel (``KernelConfig(impl="sm90", layout="ping_pong", num_warps=4, block_k=64, num_stages=2)``),
each with the largest difference of its output from the default's (both round the same fp32 softmax to bf16 in different
orders: a rounding, not 0) and whether its LSE is finite where the default's is. Correctness against float64 is the
GPU test's (``tests/gpu/test_dsa_triton_gpu.py -k "sm90ws or sm90pp"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import D_QK, D_V, TOPK, bench, causal_index_sets, mla_inputs, run_fwd  # noqa: E402
from longtrain.dsa.triton import KernelConfig  # noqa: E402
from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws  # noqa: E402

WS_RINGS = ((64, 2), (32, 4), (32, 3))
PING_PONG = KernelConfig(impl="sm90", layout="ping_pong", num_warps=4, block_k=64, num_stages=2)


def main(out_dir: Path, totals: tuple[int, ...], heads_list: tuple[int, ...]) -> None:
    dev = torch.device("cuda")
    rows: list[dict] = []
    for total, heads in ((t, h) for t in totals for h in heads_list):
        idx, length, _, _ = causal_index_sets([total], TOPK, dev)
        valid = int(length.sum())
        q, kv = mla_inputs(total, heads, dev)
        flops = 2 * valid * heads * (D_QK + D_V)
        ref_out, ref_lse = run_fwd(q, kv, idx, length, None)
        cfgs = [("default (config=None)", None), ("sm90 heads 64 x 2", KernelConfig(impl="sm90", num_stages=2))]
        cfgs += [
            (f"sm90 warp_specialized {bk} x {nb}",
             KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=bk, num_stages=nb))
            for bk, nb in WS_RINGS
        ]  # fmt: skip
        cfgs.append(("sm90 ping_pong 64 x 2", PING_PONG))
        cfgs.append(("default, the producer loading a tile's indices after the wait", "indices-after-wait"))
        for name, cfg in cfgs:
            row = dict(shape=f"T={total} H={heads} K={TOPK} 1doc", kernel=name)
            prefetch = ws.WS_PREFETCH_IDX
            if cfg == "indices-after-wait":
                cfg, ws.WS_PREFETCH_IDX = None, False
            try:
                out, lse = run_fwd(q, kv, idx, length, cfg)
                torch.cuda.synchronize()
                ms = bench(
                    lambda cfg=cfg, q=q, kv=kv, idx=idx, length=length: run_fwd(q, kv, idx, length, cfg), rep_ms=300
                )
                finite = torch.isfinite(ref_lse)
                row.update(ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9,
                           max_diff=(out.float() - ref_out.float()).abs().max().item(),
                           lse_diff=(lse - ref_lse).abs().where(finite, 0.0).max().item(),
                           same_finite=bool(torch.equal(torch.isfinite(lse), finite)))  # fmt: skip
            except Exception as exc:  # a variant that fails is a row, not a crash
                row.update(note=f"{type(exc).__name__}: {exc}"[:200])
            finally:
                ws.WS_PREFETCH_IDX = prefetch
            print(row, flush=True)
            rows.append(row)
    write_report(
        "dsa_fwd_ws", rows, ["shape", "kernel", "ms", "p20", "p80", "tflops", "max_diff", "lse_diff", "same_finite",
                             "note"],
        "Sparse MLA forward (bf16, one document, query t selects min(t+1, 2048) random causal keys, FLOPs over valid "
        "slots: 2 * valid * H * (576 + 512)), triton.testing.do_bench median with 20th/80th percentiles, L2 flushed. "
        "max_diff / lse_diff: against the default's output / LSE. Reproduce: `python benchmarks/dsa_fwd_ws.py`.",
        out_dir=out_dir, title="Sparse MLA forward: the warp-specialized and ping-pong SM90 kernels",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tokens", default="16384", help="comma-separated token counts")
    parser.add_argument("--heads", default="64,128")
    args = parser.parse_args()
    main(args.out_dir, tuple(int(t) for t in args.tokens.split(",")), tuple(int(h) for h in args.heads.split(",")))
