"""The warp-specialized SM90 sparse MLA forward persistent (``WS_PERSISTENT``: one program per SM taking every G-th
(query row, head block) item) against one program per item, alternating.

``python benchmarks/dsa_fwd_persistent.py [--out-dir DIR] [--baseline-file FILE] [--case T,H,K] [--rounds N]
[--regs R,P]`` writes
``dsa_fwd_persistent_<date>.md``: the forward at ``config=None`` both ways on one document (GLM-5.2 dims, random causal
index sets as in ``dsa.py``), each way twice, with whether the two give the same output bit for bit (they run the same
arithmetic per item). ``--baseline-file`` also times a copy of an earlier ``sparse_mla_fwd_sm90_ws.py`` (one program
per item, its own launch signature ``(..., lse, T_k, K_slots, qk_scale)``), e.g. the last commit's, in the same run.
``--memcheck`` runs small launches only, for ``compute-sanitizer --tool memcheck``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import D_QK, D_V, bench, causal_index_sets, mla_inputs, run_fwd  # noqa: E402
from longtrain.dsa.triton import sparse_mla_fwd as fwd_mod  # noqa: E402
from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws  # noqa: E402

CASES = ((16384, 64, 2048), (16384, 128, 2048), (4096, 64, 2048), (4096, 128, 512))


def _baseline_launcher(path: Path):
    """A ``_launch_sm90_ws`` replacement that runs the kernel of an earlier copy of the module at ``path``."""
    spec = importlib.util.spec_from_file_location("ws_baseline", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    def launch(grid, args, meta, block_k, num_buf):
        old.sparse_mla_fwd_sm90_ws_kernel[grid](
            *args, **meta, BLOCK_K=block_k, NUM_BUF=num_buf, REGS_RIGHT=old.WS_NUM_REGS[0],
            REGS_PRODUCER=old.WS_NUM_REGS[1], PREFETCH_IDX=getattr(old, "WS_PREFETCH_IDX", False), num_warps=4,
            maxnreg=old.WS_MAXNREG,
        )  # fmt: skip

    return launch


def _variants(baseline: Path | None) -> list[str]:
    return ["persistent", "persistent, queries prefetched to L2", "per item"] + (
        ["baseline file"] if baseline is not None else []
    )


def _run(variant: str, baseline_launch, fn):
    saved = (ws.WS_PERSISTENT, ws.WS_PREFETCH_Q, fwd_mod._launch_sm90_ws)
    try:
        ws.WS_PERSISTENT = variant.startswith("persistent")
        ws.WS_PREFETCH_Q = variant.endswith("L2")
        if variant == "baseline file":
            fwd_mod._launch_sm90_ws = baseline_launch
        return fn()
    finally:
        ws.WS_PERSISTENT, ws.WS_PREFETCH_Q, fwd_mod._launch_sm90_ws = saved


def memcheck() -> None:
    """Small launches for compute-sanitizer: persistent and per item, H = 64, 96 and 128, with and without lengths (rows
    without slots, invalid and out-of-range slots), the default ring and a forced 32 x 4, more items than SMs."""
    from longtrain.dsa.triton import KernelConfig

    dev = torch.device("cuda")
    ring = KernelConfig(impl="sm90", layout="warp_specialized", block_k=32, num_warps=4, num_stages=4)
    default = ws.WS_PERSISTENT
    for heads in (64, 96, 128):
        for persistent in (True, False):
            ws.WS_PERSISTENT = persistent
            for with_len in (True, False):
                for cfg in (None, ring):
                    idx, length, _, _ = causal_index_sets([300], 256, dev)
                    idx[3, :6] = torch.tensor([-1, 10**6, 2**30, 3, 3, -5], dtype=torch.int32, device=dev)
                    length[7] = 0
                    q, kv = mla_inputs(300, heads, dev)
                    out, _ = run_fwd(q, kv, idx, length if with_len else None, cfg)
                    torch.cuda.synchronize()
                    print("memcheck case", heads, persistent, with_len, cfg is not None, bool(out.isfinite().all()))
    ws.WS_PERSISTENT = default


def main(out_dir: Path, baseline: Path | None, cases, rounds: int, regs: tuple[int, int] | None) -> None:
    baseline_launch = _baseline_launcher(baseline) if baseline is not None else None
    if regs is not None:
        ws.WS_NUM_REGS = regs
    dev = torch.device("cuda")
    rows: list[dict] = []
    for total, heads, topk in cases:
        idx, length, _, _ = causal_index_sets([total], topk, dev)
        q, kv = mla_inputs(total, heads, dev)
        valid = int(length.sum())
        fwd = functools.partial(run_fwd, q, kv, idx, length, None)
        first = None
        for rnd in range(1, rounds + 1):
            for variant in _variants(baseline):
                o, _ = _run(variant, baseline_launch, fwd)
                first = o if first is None else first
                ms = _run(variant, baseline_launch, functools.partial(bench, fwd, rep_ms=400))
                rows.append(dict(
                    shape=f"T={total} H={heads} K={topk} 1doc", variant=variant, run=rnd,
                    regs="file's" if variant == "baseline file" else str(ws.WS_NUM_REGS), fwd_ms=ms[0], p20=ms[1],
                    p80=ms[2], tflops=2 * valid * heads * (D_QK + D_V) / ms[0] / 1e9,
                    out_equal=bool(torch.equal(o, first)),
                ))  # fmt: skip
                print(rows[-1], flush=True)
    write_report(
        "dsa_fwd_persistent", rows, ["shape", "variant", "regs", "run", "fwd_ms", "p20", "p80", "tflops", "out_equal"],
        "Sparse MLA forward at config=None (bf16, one document, query t selects min(t+1, K) random causal keys; FLOPs "
        "over valid slots, 2 * valid * H * (576 + 512)): the warp-specialized kernel persistent (one program per SM, "
        f"items pid, pid + G, ...) or one program per item, alternating, each {rounds} times; regs: the setmaxnreg "
        "budgets of its right-half and producer warpgroups (the softmax warpgroup gets 504 minus their sum)"
        + (f", and the kernel of `{baseline.name}` (an earlier copy of the module, one program per item)"
           if baseline is not None else "")
        + "; triton.testing.do_bench medians with 20th/80th percentiles. out_equal: bit for bit against the first "
        "variant's output. Reproduce: `python benchmarks/dsa_fwd_persistent.py`.",
        out_dir=out_dir, title="Sparse MLA forward: persistent warp-specialized programs",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--baseline-file", type=Path, default=None)
    parser.add_argument("--case", action="append", default=None, help="T,H,K (repeatable); default: four shapes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--regs", default=None, help="R,P: WS_NUM_REGS for this run (right half, producer)")
    parser.add_argument("--memcheck", action="store_true", help="small launches only, for compute-sanitizer")
    args = parser.parse_args()
    if args.memcheck:
        memcheck()
        sys.exit(0)
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else CASES
    regs = tuple(int(x) for x in args.regs.split(",")) if args.regs else None
    main(args.out_dir, args.baseline_file, cases, args.rounds, regs)
