"""The warp-specialized SM90 sparse MLA backward against the two-warpgroup fused kernel (CUDA; experiment).

``python benchmarks/dsa_bwd_ws.py [--out-dir DIR] [--tokens 16384] [--heads 64,128]`` writes ``dsa_bwd_ws_<date>.md``:
at T tokens of one document (K = 2048, GLM-5.2 dims, random causal index sets as in ``dsa.py``), the backward at
``config=None`` (today's default), the two-warpgroup fused kernel forced (``layout="fused"``) and the
warp-specialized one (``layout="warp_specialized"``), each with the largest relative difference of its dq and dkv
from the default's (fp32 atomics in another order and bf16 roundings: not 0), then the deterministic mode through
each at T = 4096 (with whether two runs agree bit for bit). Correctness against float64 is the GPU test's
(``tests/gpu/test_dsa_triton_gpu.py -k bwd_ws``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import D_QK, D_V, TOPK, bench, causal_index_sets, mla_inputs, run_bwd, run_fwd  # noqa: E402
from longtrain.dsa.triton import KernelConfig  # noqa: E402

FUSED = KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1)
WS = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _case(rows: list[dict], total: int, heads: int, deterministic: bool) -> None:
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], TOPK, dev)
    valid = int(length.sum())
    flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    ref = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=deterministic)
    for name, cfg in (("default (config=None)", None), ("sm90 fused (two warpgroups)", FUSED),
                      ("sm90 warp_specialized", WS)):  # fmt: skip
        cfgs = (cfg, None, None)
        row = dict(shape=f"T={total} H={heads} K={TOPK} 1doc", mode="deterministic" if deterministic else "atomic",
                   kernel=name)  # fmt: skip
        try:
            dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs, deterministic=deterministic)
            again = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs, deterministic=deterministic)
            torch.cuda.synchronize()
            ms = bench(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs,
                                                 deterministic=deterministic), rep_ms=300)  # fmt: skip
            row.update(ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, dq_rel=_rel(dq, ref[0]),
                       dkv_rel=_rel(dkv, ref[1]), finite=bool(torch.isfinite(dq).all() and torch.isfinite(dkv).all()),
                       repeat_equal=bool(torch.equal(dq, again[0]) and torch.equal(dkv, again[1])))  # fmt: skip
        except Exception as exc:  # a variant that fails is a row, not a crash
            row.update(note=f"{type(exc).__name__}: {exc}"[:200])
        print(row, flush=True)
        rows.append(row)


def main(out_dir: Path, total: int, heads_list: tuple[int, ...]) -> None:
    rows: list[dict] = []
    for heads in heads_list:
        _case(rows, total, heads, False)
    _case(rows, 4096, 64, False)
    _case(rows, 4096, 64, True)
    write_report(
        "dsa_bwd_ws", rows, ["shape", "mode", "kernel", "ms", "p20", "p80", "tflops", "dq_rel", "dkv_rel", "finite",
                             "repeat_equal", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, 2048) random causal keys, FLOPs over valid "
        "slots: 2 * valid * H * (3 * 576 + 2 * 512)), the whole backward (preprocess, probabilities + dkv, dq), "
        "triton.testing.do_bench median with 20th/80th percentiles. dq_rel / dkv_rel: largest difference from the "
        "default's in the same mode, relative to its largest element. repeat_equal: a second run equal bit for bit. "
        "Reproduce: `python benchmarks/dsa_bwd_ws.py`.",
        out_dir=out_dir, title="Sparse MLA backward: the warp-specialized SM90 kernel (H200)",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", default="64,128")
    args = parser.parse_args()
    main(args.out_dir, args.tokens, tuple(int(h) for h in args.heads.split(",")))
