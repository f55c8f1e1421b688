"""Load imbalance of contiguous block-diagonal CP sharding, simulated in one process.

For W in {2, 4, 8} and the document distributions of ``blockdiag_attention.py`` (32K and 64K tokens, document
lengths U[512, 8192] seed 1 and U[64, 2048] seed 2), every rank's local shard work is computed:

- the mask area of its queries (attended (query, key) pairs), from the per-rank varlen metadata; the
  imbalance is max/mean over ranks. The same quantity under the round-robin "head + tail chunk" layout is
  shown for comparison (that layout balances one causal document, but is not what block-diagonal CP uses);
- the K/V tokens a rank must receive: all-gather ``S - L`` versus the needed-only exchanges
  (``s_first .. real_end`` minus its own rows; max over ranks);
- on CUDA, the measured time of each rank's ``_cp_blockdiag_varlen`` call (forward, and forward+backward) with
  the fastest available backend (Hq=32, Hkv=8, D=128, bf16), run one rank after the other on one GPU, and
  the max/mean of those times. Without CUDA the timing columns read "n/a (no CUDA)".

Run from the repository root::

    PYTHONPATH=src python benchmarks/cp_imbalance.py [--worlds 2 4 8] [--tokens 32768 65536] [--out-dir DIR]

It writes ``cp_imbalance_<date>.md`` and ``.json`` (machine header first) to ``--out-dir`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402
from blockdiag_attention import HKV, HQ, LAYOUTS, D, doc_lengths  # noqa: E402
from longtrain.blockdiag_cp import kernels, resolve_backend  # noqa: E402

NO_CUDA = "n/a (no CUDA)"


def ids_from_lengths(lengths: list[int], full_len: int) -> torch.Tensor:
    """``[full_len] int64`` document ids (1, 2, ...) with a zero tail."""
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    return torch.cat([ids, torch.zeros(full_len - ids.numel(), dtype=torch.int64)])


def meta_mask_area(meta: dict) -> int:
    """Attended (query, key) pairs of one rank from its metadata: per segment ``q·(k - q) + q·(q + 1)/2``."""
    if meta["n_real"] == 0:
        return 0
    cq, ck = meta["cu_q"].tolist(), meta["cu_k"].tolist()
    area = 0
    for i in range(len(cq) - 1):
        q, k = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        area += q * (k - q) + q * (q + 1) // 2
    return area


def position_weight(ids: torch.Tensor) -> torch.Tensor:
    """Keys each position attends to: its index inside its document plus one (0 for padding)."""
    pos = torch.arange(ids.numel())
    change = torch.cat([torch.ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])
    start = torch.cummax(torch.where(change, pos, 0), dim=0).values
    return torch.where(ids > 0, pos - start + 1, 0)


def round_robin_areas(ids: torch.Tensor, world: int) -> list[int]:
    """Mask area per rank under the head+tail layout: rank r owns chunks r and 2W-1-r of 2W equal chunks."""
    chunks = position_weight(ids).view(2 * world, -1).sum(1)
    return [int(chunks[r] + chunks[2 * world - 1 - r]) for r in range(world)]


def time_ranks(ids: torch.Tensor, world: int, metas: list[dict], backend: str) -> tuple[list[float], list[float]]:
    """Median ms of each rank's varlen call (forward; forward+backward), one rank after the other."""
    from triton.testing import do_bench

    dev = torch.device("cuda")
    full_len = ids.numel()
    local_len = full_len // world
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(1, HKV, full_len, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, HKV, full_len, D, device=dev, dtype=torch.bfloat16, generator=gen)
    ids_dev = ids.to(dev)[None]
    fwd, fwd_bwd = [], []
    for r, meta in enumerate(metas):
        meta = {key: (val.to(dev) if isinstance(val, torch.Tensor) else val) for key, val in meta.items()}
        q = torch.randn(1, HQ, local_len, D, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
        dout = torch.randn_like(q)

        def call(q=q, kk=kk, vv=vv, meta=meta, r=r):
            out = kernels._cp_blockdiag_varlen(q, kk, vv, ids_dev, r * local_len, None, backend, meta=meta)
            if out is None:
                raise RuntimeError(f"{backend} varlen declined on rank {r}")
            return out

        def step(call=call, q=q, kk=kk, vv=vv, dout=dout):
            torch.autograd.grad(call(), (q, kk, vv), dout, allow_unused=True)

        call()
        step()  # warm-up: compile / autotune / graph caches
        fwd.append(do_bench(lambda call=call: call(), quantiles=[0.5], rep=100))
        fwd_bwd.append(do_bench(step, quantiles=[0.5], rep=200))
    return fwd, fwd_bwd


def _imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else float("nan")


def run(worlds: list[int], token_counts: list[int]) -> tuple[list[dict], str]:
    cuda = torch.cuda.is_available()
    backend = resolve_backend("auto", torch.bfloat16, "cuda") if cuda else None
    rows = []
    for tokens in token_counts:
        for layout, (lo, hi, seed) in LAYOUTS.items():
            lengths = doc_lengths(tokens, lo, hi, seed)
            for world in worlds:
                full_len = tokens + (-tokens) % (2 * world)
                local_len = full_len // world
                ids = ids_from_lengths(lengths, full_len)
                metas = [
                    kernels.precompute_blockdiag_varlen_meta(
                        ids, row_offset=r * local_len, local_len=local_len, device="cpu"
                    )
                    for r in range(world)
                ]
                areas = [meta_mask_area(m) for m in metas]
                weight = position_weight(ids).view(world, local_len).sum(1).tolist()
                assert areas == weight, (areas, weight)  # the metadata and the direct count agree
                needed = [0 if m["n_real"] == 0 else (m["real_end"] - m["s_first"]) - m["n_real"] for m in metas]
                row = {
                    "tokens": tokens,
                    "docs": f"{layout} U[{lo},{hi}] ({len(lengths)} docs)",
                    "W": world,
                    "area_max_over_mean": _imbalance(areas),
                    "busiest_rank": max(range(world), key=lambda r: areas[r]),
                    "rr_area_max_over_mean": _imbalance(round_robin_areas(ids, world)),
                    "kv_recv_allgather": full_len - local_len,
                    "kv_recv_needed_max": max(needed),
                }
                if cuda:
                    fwd, fwd_bwd = time_ranks(ids, world, metas, backend)
                    row.update(
                        backend=backend,
                        fwd_ms_max=max(fwd),
                        fwd_max_over_mean=_imbalance(fwd),
                        fwd_bwd_ms_max=max(fwd_bwd),
                        fwd_bwd_max_over_mean=_imbalance(fwd_bwd),
                    )
                else:
                    row.update(backend=NO_CUDA, fwd_max_over_mean=NO_CUDA, fwd_bwd_max_over_mean=NO_CUDA)
                rows.append(row)
                print(row, flush=True)
    notes = (
        "Mask area = attended (query, key) pairs of a rank's local queries (same document, key <= query), from "
        "the per-rank varlen metadata (checked against a direct count). max/mean = the busiest rank's work over "
        "the mean: the step time of a CP group follows the busiest rank. rr_area = the same under the round-robin "
        "head+tail layout (not used by block-diagonal CP; shown to size the cost of contiguous sharding). "
        "kv_recv = K/V tokens a rank receives per layer (all-gather: S - L on every rank; needed-only halo/a2a: "
        "the left straddle of its first document, max over ranks). Timing (CUDA only): each rank's "
        "`_cp_blockdiag_varlen` call run one after the other on one GPU with the auto backend, Hq=32, Hkv=8, "
        "D=128, bf16, median of triton.testing.do_bench; it excludes communication."
    )
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default="cp_imbalance")
    args = parser.parse_args(argv)
    header = machine_header()
    rows, notes = run(args.worlds, args.tokens)
    columns = [
        "tokens",
        "docs",
        "W",
        ("area_max_over_mean", "mask area max/mean"),
        ("busiest_rank", "busiest rank"),
        ("rr_area_max_over_mean", "round-robin area max/mean"),
        ("kv_recv_allgather", "K/V recv all-gather"),
        ("kv_recv_needed_max", "K/V recv needed-only (max)"),
        "backend",
        ("fwd_ms_max", "fwd ms (busiest)"),
        ("fwd_max_over_mean", "fwd time max/mean"),
        ("fwd_bwd_ms_max", "fwd+bwd ms (busiest)"),
        ("fwd_bwd_max_over_mean", "fwd+bwd time max/mean"),
    ]
    md, js = write_report(
        args.name, rows, columns, notes, header=header, out_dir=args.out_dir, title="Contiguous CP load imbalance"
    )
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
