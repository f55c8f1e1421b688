"""The warp-specialized SM90 sparse MLA kernels with the producer loading each tile's slot indices one tile ahead
(``WS_PREFETCH_IDX`` / ``WS_BWD_PREFETCH_IDX``; the forward's default, not the backward's) or after the wait for the
tile's buffer.

``python benchmarks/dsa_ws_prefetch.py [--out-dir DIR]`` writes ``dsa_ws_prefetch_<date>.md``: the forward and the
whole backward at ``config=None`` both ways, alternating, on one document (GLM-5.2 dims, random causal index sets as
in ``dsa.py``), with whether the two ways give the same output / dq bit for bit (they run the same arithmetic).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import D_QK, D_V, bench, causal_index_sets, mla_inputs, run_bwd, run_fwd  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as bwd_ws  # noqa: E402
from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as fwd_ws  # noqa: E402

CASES = ((16384, 64, 2048), (16384, 128, 2048), (4096, 128, 512))


def _both_ways(total: int, heads: int, topk: int) -> tuple[int, dict]:
    """Valid slots, and per way (True: one tile ahead) two (fwd ms, bwd ms, out, dq), timed alternately."""
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    results: dict = {}
    for prefetch in (True, False, True, False):
        fwd_ws.WS_PREFETCH_IDX = bwd_ws.WS_BWD_PREFETCH_IDX = prefetch
        try:
            o, _ = run_fwd(q, kv, idx, length, None)
            dq = run_bwd(q, kv, out, dout, lse, idx, length)[0]
            torch.cuda.synchronize()
            f_ms = bench(lambda: run_fwd(q, kv, idx, length, None), rep_ms=300)
            b_ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length), rep_ms=300)
        finally:
            fwd_ws.WS_PREFETCH_IDX = bwd_ws.WS_BWD_PREFETCH_IDX = True
        results.setdefault(prefetch, []).append((f_ms, b_ms, o, dq))
    return int(length.sum()), results


def main(out_dir: Path) -> None:
    rows: list[dict] = []
    for total, heads, topk in CASES:
        valid, results = _both_ways(total, heads, topk)
        for prefetch, runs in results.items():
            for k, (f_ms, b_ms, o, dq) in enumerate(runs):
                ref = results[True][0]
                rows.append(dict(
                    shape=f"T={total} H={heads} K={topk} 1doc",
                    indices="one tile ahead" if prefetch else "after the wait",
                    run=k + 1, fwd_ms=f_ms[0], fwd_tflops=2 * valid * heads * (D_QK + D_V) / f_ms[0] / 1e9,
                    bwd_ms=b_ms[0], bwd_p20=b_ms[1], bwd_p80=b_ms[2],
                    bwd_tflops=2 * valid * heads * (3 * D_QK + 2 * D_V) / b_ms[0] / 1e9,
                    out_equal=bool(torch.equal(o, ref[2])), dq_equal=bool(torch.equal(dq, ref[3])),
                ))  # fmt: skip
                print(rows[-1], flush=True)
    write_report(
        "dsa_ws_prefetch", rows, ["shape", "indices", "run", "fwd_ms", "fwd_tflops", "bwd_ms", "bwd_p20", "bwd_p80",
                                  "bwd_tflops", "out_equal", "dq_equal"],
        "Sparse MLA forward and whole backward at config=None (bf16, one document, query t selects min(t+1, K) random "
        "causal keys; FLOPs over valid slots: forward 2 * valid * H * (576 + 512), backward 2 * valid * H * (3 * 576 "
        "+ 2 * 512)), the warp-specialized kernels' producers (forward and backward together) loading each tile's "
        "slot indices one tile ahead or after the wait for its buffer, alternating, each way twice; "
        "triton.testing.do_bench medians (backward with 20th/80th percentiles). out_equal / dq_equal: bit for bit "
        "against the first run one tile ahead. Defaults since 2026-12-06: the forward one tile ahead, the backward "
        "after the wait. Reproduce: `python benchmarks/dsa_ws_prefetch.py`.",
        out_dir=out_dir, title="Sparse MLA: slot indices one tile ahead in the warp-specialized producers",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    main(parser.parse_args().out_dir)
