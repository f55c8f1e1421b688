"""CP load balance of contiguous and balanced sharding, simulated in one process.

For W in {2, 4, 8}, the document layouts of ``blockdiag_attention.py`` (documents U[512, 8192] seed 1 and
U[64, 2048] seed 2) and one long document, at 32K and 128K tokens, and each sharding mode of
:func:`longtrain.blockdiag_cp.plan_cp_shards` (``contiguous``: the seed's split; ``balanced`` with each
``--chunks`` value, default 128):

- the planner's causal work (same-document query-key pairs of a rank's queries) max/mean over ranks, next to
  per-document head-tail (torch's layout: every document cut into 2W pieces, no minimum piece size);
- the K/V tokens a rank receives per layer: all-gather ``S - L`` (both modes) versus the all-to-all-v of exactly
  the needed keys (max over ranks), and the varlen calls per rank;
- the host time of planning a step (the plan and one rank's pieces, as every rank does once per step);
- on CUDA, each rank's attention (its varlen call over the gathered keys, the provider ``auto`` picks,
  Hq=32, Hkv=8, D=128, bf16) timed forward+backward one rank after the other on one GPU, and the busiest rank's
  time over the mean. Without CUDA the timing columns read "n/a (no CUDA)".

Run from the repository root::

    PYTHONPATH=src python benchmarks/cp_imbalance.py [--worlds 2 4 8] [--tokens 32768 131072] [--time-tokens 32768]

It writes ``cp_imbalance_<date>.md`` and ``.json`` (machine header first) to ``--out-dir`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402
from blockdiag_attention import HKV, HQ, LAYOUTS, D  # noqa: E402
from longtrain.blockdiag_cp import plan_cp_shards, resolve_backend, runtime  # noqa: E402
from longtrain.blockdiag_cp import sharding as sharding_module  # noqa: E402
from longtrain.blockdiag_cp.meta import segment_rank  # noqa: E402
from longtrain.blockdiag_cp.sharding import rank_pieces  # noqa: E402
from longtrain.packing import doc_lengths, ids_from_lengths  # noqa: E402

NO_CUDA = "n/a (no CUDA)"


def head_tail_work(lens: list[int], world: int) -> list[int]:
    """Causal work per rank when every document is cut into 2W near-equal pieces, rank r taking r and 2W-1-r."""
    work = [0] * world
    for n in lens:
        b = [round(i * n / (2 * world)) for i in range(2 * world + 1)]
        for r in range(world):
            for piece in (r, 2 * world - 1 - r):
                lo, hi = b[piece], b[piece + 1]
                work[r] += (hi * (hi + 1) - lo * (lo + 1)) // 2
    return work


def query_segments(plan, lens: list[int], rank: int) -> int:
    """Same-document query segments rank ``rank`` owns: its pieces cut at document boundaries (padding excluded)."""
    bounds, acc = [], 0
    for n in lens:
        bounds.append((acc, acc + n))
        acc += n
    return sum(1 for a, b in plan.pieces[rank] for lo, hi in bounds if min(b, hi) > max(a, lo))


def _imbalance(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def rank_calls(plan, ids: torch.Tensor, rank: int, device) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """``(query rows, key positions, meta)`` of each varlen call rank ``rank`` makes (global key positions)."""
    if plan.is_contiguous:
        local = plan.local_len
        meta = segment_rank(ids, rank * local, local, device)
        if meta.n_real == 0:
            return []
        rows = torch.arange(meta.n_real, device=device)
        keys = torch.arange(meta.s_first, meta.real_end)
        return [(rows, keys, meta.rebased(0, meta.kv_len))]
    pieces = rank_pieces(plan, rank, device)
    if not pieces.passes:
        return []
    return [(pieces.q_rows, torch.cat([p.key_pos for p in pieces.passes]), pieces.meta)]


def time_ranks(plan, ids: torch.Tensor, backend: str) -> list[float]:
    """Median ms of each rank's forward+backward attention (all its varlen calls), one rank after the other."""
    from triton.testing import do_bench

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    k_all = torch.randn(plan.seq_len, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v_all = torch.randn(plan.seq_len, HKV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    times = []
    for r in range(plan.world_size):
        calls = rank_calls(plan, ids, r, dev)
        q = torch.randn(plan.local_len, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        ins = [(rows, k_all[keys.to(dev)].requires_grad_(), v_all[keys.to(dev)].requires_grad_(), meta)
               for rows, keys, meta in calls]  # fmt: skip
        if not ins:
            times.append(0.0)
            continue

        def step(q=q, ins=ins):
            outs, leaves = [], [q]
            for rows, kk, vv, meta in ins:
                outs.append(runtime.attend(q.index_select(0, rows), kk, vv, meta, backend))
                leaves += [kk, vv]
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

        step()  # warm-up: compile / autotune / plan caches
        times.append(do_bench(step, quantiles=[0.5], rep=100))
    return times


def run(
    worlds: list[int],
    token_counts: list[int],
    time_tokens: list[int],
    chunks: tuple[int, ...] = (128,),
    whole_first: bool = False,
) -> tuple[list[dict], str]:
    cuda = torch.cuda.is_available()
    backend = resolve_backend("auto", torch.bfloat16, "cuda") if cuda else None
    rows = []
    for tokens in token_counts:
        layouts = {f"U[{lo},{hi}]": doc_lengths(tokens, lo, hi, seed) for lo, hi, seed in LAYOUTS.values()}
        layouts["one document"] = [tokens]
        for name, lens in layouts.items():
            for world in worlds:
                pad = (-tokens) % (2 * world)
                ids = ids_from_lengths(lens, pad)
                modes = [("contiguous", None, False)] + [("balanced", c, False) for c in chunks]
                modes += [("balanced", c, True) for c in chunks] if whole_first else []
                for mode, chunk, first in modes:
                    t0 = time.perf_counter()
                    extra = {} if chunk is None else {"chunk": chunk}
                    if first:  # the planner experiment (not a public option): sharding._balanced's whole_first
                        plan = sharding_module._plan(lens, world, mode, chunk, pad, whole_first=1.0)
                    else:
                        plan = plan_cp_shards(lens, world, sharding=mode, pad=pad, **extra)
                    calls = [rank_calls(plan, ids, r, "cpu") for r in range(world)]
                    plan_ms = (time.perf_counter() - t0) * 1e3 / world  # (the plan + every rank's passes) / W
                    owned = [set(t.tolist()) for t in plan.token_index]
                    recv = [len({int(p) for _, keys, _ in calls[r] for p in keys} - owned[r]) for r in range(world)]
                    row = {
                        "tokens": tokens,
                        "docs": f"{name} ({len(lens)} docs)",
                        "W": world,
                        "sharding": mode + (" (whole-first)" if first else ""),
                        "chunk": "-" if chunk is None else chunk,
                        "work_max_over_mean": plan.imbalance,
                        "head_tail_max_over_mean": _imbalance(head_tail_work(lens, world)),
                        "calls_max": max(len(c) for c in calls),
                        "segments_max": max(query_segments(plan, lens, r) for r in range(world)),
                        "kv_recv_allgather": plan.seq_len - plan.local_len,
                        "kv_recv_a2a_max": max(recv),
                        "plan_ms": plan_ms,
                    }
                    if cuda and tokens in time_tokens:
                        times = time_ranks(plan, ids, backend)
                        row.update(backend=backend, fwd_bwd_ms_max=max(times), time_max_over_mean=_imbalance(times),
                                   fwd_bwd_ms_mean=statistics.mean(times))  # fmt: skip
                    else:
                        row.update(backend=NO_CUDA if not cuda else "not timed", time_max_over_mean="-")
                    rows.append(row)
                    print(row, flush=True)
    notes = (
        "Causal work = same-document (query, key) pairs with key <= query of a rank's queries; max/mean = the "
        "busiest rank over the mean (a CP group's step time follows its busiest rank). head-tail = every document "
        "cut into 2W near-equal pieces, rank r taking pieces r and 2W-1-r (torch's per-document layout, no minimum "
        "piece size). Balanced = plan_cp_shards(sharding='balanced', chunk=C), C per row; balanced (whole-first) = the "
        "planner experiment of --whole-first (documents whole while the rank's work stays at most the mean; not a "
        "public option). calls = varlen calls per "
        "rank and attention layer. segments = same-document query runs of a rank's rows (the sequences of its varlen "
        "call), max over ranks. kv_recv = K/V tokens a rank receives per layer: all-gather S - L on every rank "
        "(both modes); all-to-all-v the needed keys it does not own (max over ranks). plan_ms = host time of the plan "
        "and every rank's pieces divided by W (each rank builds the plan and its own pieces once per step). "
        "Timing (CUDA only): each rank's varlen "
        "calls (forward+backward, over K/V already gathered) one rank after the other on one GPU, median of "
        "triton.testing.do_bench; communication excluded."
    )
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--time-tokens", type=int, nargs="*", default=[32768], help="token counts to time on CUDA")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default="cp_imbalance")
    parser.add_argument("--chunks", type=int, nargs="+", default=[128], help="balanced plans' smallest piece(s)")
    parser.add_argument(
        "--whole-first", action="store_true",
        help="also the planner experiment that keeps documents whole where a rank stays under the mean work",
    )  # fmt: skip
    args = parser.parse_args(argv)
    header = machine_header()
    rows, notes = run(args.worlds, args.tokens, args.time_tokens, tuple(args.chunks), args.whole_first)
    columns = [
        "tokens", "docs", "W", "sharding", "chunk",
        ("work_max_over_mean", "causal work max/mean"),
        ("head_tail_max_over_mean", "head-tail max/mean"),
        ("calls_max", "varlen calls/rank"),
        ("segments_max", "query segments/rank (max)"),
        ("kv_recv_allgather", "K/V recv all-gather"),
        ("kv_recv_a2a_max", "K/V recv a2a (max)"),
        ("plan_ms", "plan ms/step"),
        "backend",
        ("fwd_bwd_ms_max", "fwd+bwd ms (busiest)"),
        ("fwd_bwd_ms_mean", "fwd+bwd ms (mean)"),
        ("time_max_over_mean", "fwd+bwd time max/mean"),
    ]  # fmt: skip
    md, js = write_report(args.name, rows, columns, notes, header=header, out_dir=args.out_dir,
                          title="CP load balance: contiguous and balanced sharding")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
