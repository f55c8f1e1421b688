"""The warp-specialized SM90 sparse MLA forward's schedules (``WS_SCHEDULE``), alternating: one program per item,
runs of ``WS_RUN`` consecutive items per program, persistent (one program per SM taking every G-th (query row, head
block) item) and dynamic (one program per SM taking its next item from a counter).

``python benchmarks/dsa_fwd_persistent.py [--out-dir DIR] [--baseline-file FILE] [--case T,H,K] [--rounds N]
[--regs R,P] [--runs 2,4,8] [--contention BLOCKS,MS] [--staged-out]`` writes
``dsa_fwd_persistent_<date>.md``: the forward at ``config=None`` every way on one document (GLM-5.2 dims, random
causal index sets as in ``dsa.py``), each way ``--rounds`` times, with whether each gives the same output bit for bit
(they run the same arithmetic per item). ``--baseline-file`` also times a copy of an earlier
``sparse_mla_fwd_sm90_ws.py`` (one program per item, its own launch signature ``(..., lse, T_k, K_slots,
qk_scale)``), e.g. the last commit's, in the same run. ``--contention BLOCKS,MS`` adds rows timed while a kernel of
``BLOCKS`` programs that each hold an SM for ``MS`` ms runs on another stream, launched just before the forward (as
the NCCL kernels of an all-gather that FSDP overlaps with a layer hold their SMs). ``--staged-out`` times only runs
of 4 and persistent programs, each with the output stored straight from the accumulators and through the last tile
(``WS_STAGED_OUT``). ``--memcheck`` runs small launches only, for ``compute-sanitizer --tool memcheck``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, reproduce_args, write_report  # noqa: E402
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


def _variants(runs: list[int], baseline: Path | None, staged: bool = False) -> dict[str, tuple[str, int, bool, bool]]:
    """name -> (WS_SCHEDULE, WS_RUN, WS_PREFETCH_Q, WS_STAGED_OUT); ``baseline file`` runs the earlier copy's kernel;
    ``staged``: only runs of 4 and persistent programs, each with the output stored directly and staged."""
    if staged:
        return {f"{name}{', staged output' if st else ''}": (sched, run, False, st)
                for name, sched, run in (("runs of 4", "runs", 4), ("persistent", "persistent", 1))
                for st in (False, True)}  # fmt: skip
    table = {"per item": ("runs", 1, False, False)}
    table.update({f"runs of {r}": ("runs", r, False, False) for r in runs})
    table.update({"persistent": ("persistent", 1, False, False), "dynamic": ("dynamic", 1, False, False),
                  "dynamic, queries prefetched to L2": ("dynamic", 1, True, False)})  # fmt: skip
    if baseline is not None:
        table["baseline file"] = ("runs", 1, False, False)
    return table


def _run(name: str, knobs: tuple[str, int, bool, bool], baseline_launch, fn):
    saved = (ws.WS_SCHEDULE, ws.WS_RUN, ws.WS_PREFETCH_Q, ws.WS_STAGED_OUT, fwd_mod._launch_sm90_ws)
    try:
        ws.WS_SCHEDULE, ws.WS_RUN, ws.WS_PREFETCH_Q, ws.WS_STAGED_OUT = knobs
        if name == "baseline file":
            fwd_mod._launch_sm90_ws = baseline_launch
        return fn()
    finally:
        ws.WS_SCHEDULE, ws.WS_RUN, ws.WS_PREFETCH_Q, ws.WS_STAGED_OUT, fwd_mod._launch_sm90_ws = saved


@triton.jit
def _busy_kernel(out_ptr, ns):
    """Hold an SM for ``ns`` nanoseconds (128 threads: with their registers no 384-thread forward program, which takes
    the whole register file, fits beside one)."""
    lane = tl.arange(0, 128)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lane], dtype=tl.int64, is_pure=False, pack=1)
    elapsed = tl.zeros([128], tl.int64)
    while tl.min(elapsed, axis=0) < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lane], dtype=tl.int64, is_pure=False,
                                        pack=1)  # fmt: skip
        elapsed = now - t0
    tl.store(out_ptr + tl.program_id(0) * 128 + lane, elapsed)


def _contended_ms(fwd, blocks: int, busy_ms: float, reps: int = 10) -> tuple[float, float, float]:
    """Median, 20th and 80th percentile of the forward's time (launch to end, on the current stream) with ``blocks``
    busy programs of ``busy_ms`` launched just before it on another stream (``fwd=None``: the busy kernel alone)."""
    side = torch.cuda.Stream()
    sink = torch.empty(blocks * 128, dtype=torch.int64, device="cuda")
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _busy_kernel[(blocks,)](sink, int(busy_ms * 1e6), num_warps=4)
        if fwd is None:  # the busy kernel alone: end once it has
            torch.cuda.current_stream().wait_stream(side)
        else:
            fwd()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    q = statistics.quantiles(times, n=5)
    return statistics.median(times), q[0], q[3]


def memcheck() -> None:
    """Small launches for compute-sanitizer: persistent, runs of 3, per item and dynamic, H = 64, 96 and 128, with
    and without lengths (rows without slots, invalid and out-of-range slots), the default ring and a forced 32 x 4,
    more items than SMs."""
    from longtrain.dsa.triton import KernelConfig

    dev = torch.device("cuda")
    ring = KernelConfig(impl="sm90", layout="warp_specialized", block_k=32, num_warps=4, num_stages=4)
    for heads in (64, 96, 128):
        for name, knobs in (("persistent", ("persistent", 1, False, True)), ("runs of 3", ("runs", 3, True, False)),
                            ("per item", ("runs", 1, False, True)), ("dynamic", ("dynamic", 1, True, True)),
                            ("runs of 4", ("runs", 4, False, False))):  # fmt: skip
            for with_len in (True, False):
                for cfg in (None, ring):
                    idx, length, _, _ = causal_index_sets([300], 256, dev)
                    idx[3, :6] = torch.tensor([-1, 10**6, 2**30, 3, 3, -5], dtype=torch.int32, device=dev)
                    length[7] = 0
                    q, kv = mla_inputs(300, heads, dev)
                    fwd = functools.partial(run_fwd, q, kv, idx, length if with_len else None, cfg)
                    out, _ = _run(name, knobs, None, fwd)
                    torch.cuda.synchronize()
                    print("memcheck case", heads, name, with_len, cfg is not None, bool(out.isfinite().all()))


def main(out_dir: Path, baseline: Path | None, cases, rounds: int, regs: tuple[int, int] | None, runs: list[int],
         contention: tuple[int, float] | None, staged: bool = False) -> None:  # fmt: skip
    baseline_launch = _baseline_launcher(baseline) if baseline is not None else None
    if regs is not None:
        ws.WS_NUM_REGS = regs
    variants = _variants(runs, baseline, staged)
    dev = torch.device("cuda")
    rows: list[dict] = []
    for total, heads, topk in cases:
        idx, length, _, _ = causal_index_sets([total], topk, dev)
        q, kv = mla_inputs(total, heads, dev)
        valid = int(length.sum())
        fwd = functools.partial(run_fwd, q, kv, idx, length, None)
        first = None
        for rnd in range(1, rounds + 1):
            for name, knobs in variants.items():
                o, _ = _run(name, knobs, baseline_launch, fwd)
                first = o if first is None else first
                timings = [("none", _run(name, knobs, baseline_launch, functools.partial(bench, fwd, rep_ms=400)))]
                if contention is not None:
                    timed = functools.partial(_contended_ms, fwd, *contention)
                    timings.append((f"{contention[0]} SMs for {contention[1]} ms",
                                    _run(name, knobs, baseline_launch, timed)))  # fmt: skip
                for other, ms in timings:
                    rows.append(dict(
                        shape=f"T={total} H={heads} K={topk} 1doc", variant=name, run=rnd, other_stream=other,
                        regs="file's" if name == "baseline file" else str(ws.WS_NUM_REGS), fwd_ms=ms[0], p20=ms[1],
                        p80=ms[2], tflops=2 * valid * heads * (D_QK + D_V) / ms[0] / 1e9,
                        out_equal=bool(torch.equal(o, first)),
                    ))  # fmt: skip
                    print(rows[-1], flush=True)
    if contention is not None:
        busy = _contended_ms(None, *contention)
        rows.append(dict(shape="-", variant="the busy kernel alone", run=1, other_stream=f"{contention[0]} SMs for "
                         f"{contention[1]} ms", regs="-", fwd_ms=busy[0], p20=busy[1], p80=busy[2], tflops=0.0,
                         out_equal=True))  # fmt: skip
    write_report(
        "dsa_fwd_persistent", rows,
        ["shape", "variant", "other_stream", "regs", "run", "fwd_ms", "p20", "p80", "tflops", "out_equal"],
        "Sparse MLA forward at config=None (bf16, one document, query t selects min(t+1, K) random causal keys; FLOPs "
        "over valid slots, 2 * valid * H * (576 + 512)): the warp-specialized kernel with one program per item, with "
        "runs of consecutive items per program (WS_RUN), persistent (one program per SM, items pid, pid + G, ...) or "
        "dynamic (one program per SM, each next item from a counter), "
        f"alternating, each {rounds} times; regs: the setmaxnreg budgets of its right-half and producer warpgroups "
        "(the softmax warpgroup gets 504 minus their sum)"
        + (f", and the kernel of `{baseline.name}` (an earlier copy of the module, one program per item)"
           if baseline is not None else "")
        + "; triton.testing.do_bench medians with 20th/80th percentiles. out_equal: bit for bit against the first "
        "variant's output. other_stream: rows timed (CUDA events, launch to end, 10 repetitions) while a kernel whose "
        "programs each hold one SM for that long runs on another stream, launched just before the forward, as the NCCL "
        "kernels of an overlapped all-gather do; the last row is that kernel alone. Reproduce: `python "
        f"benchmarks/dsa_fwd_persistent.py {reproduce_args()}`.",
        out_dir=out_dir, title="Sparse MLA forward: schedules of the warp-specialized programs",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--baseline-file", type=Path, default=None)
    parser.add_argument("--case", action="append", default=None, help="T,H,K (repeatable); default: four shapes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--regs", default=None, help="R,P: WS_NUM_REGS for this run (right half, producer)")
    parser.add_argument("--runs", default="2,4,8", help="WS_RUN values to time besides 1 (comma-separated)")
    parser.add_argument("--contention", default=None, help="BLOCKS,MS: also time beside a kernel holding BLOCKS SMs")
    parser.add_argument("--memcheck", action="store_true", help="small launches only, for compute-sanitizer")
    parser.add_argument("--staged-out", action="store_true", help="only runs of 4 and persistent, output staged or not")
    args = parser.parse_args()
    if args.memcheck:
        memcheck()
        sys.exit(0)
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else CASES
    regs = tuple(int(x) for x in args.regs.split(",")) if args.regs else None
    runs = [int(x) for x in args.runs.split(",") if x]
    contention = (int(args.contention.split(",")[0]), float(args.contention.split(",")[1])) if args.contention else None
    main(args.out_dir, args.baseline_file, cases, args.rounds, regs, runs, contention, args.staged_out)
