"""What the cross-rank guarantees cost: non-finite isolation per attention call, the rank check per step.

1. Isolation. For each GPU provider, ``runtime.attend`` on 32K packed tokens (bf16, GQA 32:8, head dim 128,
   documents U[512, 8192] and U[64, 2048], the layouts of ``blockdiag_attention.py``) with the runtime's
   non-finite isolation (the fused sanitize kernel on q/k/v, the rows-seeing table, the NaN fill) and without it
   (the provider marked as isolating by itself). Forward and backward ms, median of ``do_bench``.
2. The rank check. ``check_ranks_agree`` (one fingerprint exchange through the default store) timed over
   ``--steps`` fresh steps of a one-rank group on this machine (of the W-rank group under
   ``torchrun --nproc-per-node W``, CPU), and the number of fingerprint exchanges of a
   step of 8 attention layers (the per-layer cost: must be 0 after the first).

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/guarantee_cost.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402
from blockdiag_attention import HKV, HQ, LAYOUTS, D  # noqa: E402
from longtrain.blockdiag_cp import build_cp_step, consensus, cp_varlen_attention, providers, runtime  # noqa: E402
from longtrain.blockdiag_cp.providers import cudnn  # noqa: E402
from longtrain.packing import doc_lengths, ids_from_lengths  # noqa: E402

# "cudnn" runs its CuTe DSL route where it can; "cudnn:graph" forces the graph route (which isolates by itself)
PROVIDERS = ["cudnn", "cudnn:graph", "cudnn_fa4", "fa4", "fa4_cudnn", "flash", "flex"]


def _time(do_bench, fn, q, k, v, dout):
    fn(q, k, v)
    torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    with torch.no_grad():
        fwd = do_bench(lambda: fn(q, k, v), rep=200)
    both = do_bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), rep=300)
    return fwd, max(both - fwd, 0.0)


def isolation_rows(tokens: int) -> list[dict]:
    from triton.testing import do_bench

    dev = torch.device("cuda")
    rows = []
    for lo, hi, seed in LAYOUTS.values():
        lengths = doc_lengths(tokens, lo, hi, seed)
        ids = ids_from_lengths(lengths).to(dev)
        step = build_cp_step(ids, None, device=dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(tokens, h, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for h in (HQ, HKV, HKV))  # fmt: skip
        dout = torch.randn(tokens, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
        for label in PROVIDERS:
            name, _, route = label.partition(":")
            row = {"layout": f"U[{lo},{hi}]", "provider": label}
            reason = providers.unavailable_reason(name, torch.bfloat16, dev)
            if reason is not None:
                rows.append({**row, "status": f"unavailable: {reason}"})
                continue
            entry = providers.PROVIDERS[name]

            def fn(q, k, v, name=name, meta=step.varlen_meta):
                return runtime.attend(q, k, v, meta, name)

            saved_route = cudnn.ROUTE
            try:
                cudnn.ROUTE = route or "auto"
                providers.PROVIDERS[name] = replace(entry, isolates_nonfinite=False)
                iso = _time(do_bench, fn, q, k, v, dout)
                providers.PROVIDERS[name] = replace(entry, isolates_nonfinite=True)
                raw = _time(do_bench, fn, q, k, v, dout)
                row.update(
                    fwd_ms_isolated=iso[0], fwd_ms_raw=raw[0], bwd_ms_isolated=iso[1], bwd_ms_raw=raw[1],
                    fwd_overhead_pct=100 * (iso[0] / raw[0] - 1), total_overhead_pct=100 * (sum(iso) / sum(raw) - 1),
                    status="ok",
                )  # fmt: skip
            except Exception as exc:
                traceback.print_exc()
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
            finally:
                providers.PROVIDERS[name] = entry
                cudnn.ROUTE = saved_route
            rows.append(row)
            print(row, flush=True)
    return rows


def check_rows(steps: int) -> list[dict]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: the real W-rank group
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", "0")), world_size=world)
    try:
        ids = torch.tensor([1] * 300 + [2] * 500 + [3] * 150 + [0] * 74)
        q = torch.zeros(ids.numel(), 8, 64)
        times = []
        for _ in range(steps):
            step = build_cp_step(ids, dist.group.WORLD)
            start = time.perf_counter()
            runtime.check_ranks_agree(step, q, q)
            times.append(1e3 * (time.perf_counter() - start))
        calls = []
        real = consensus.exchange_fingerprints
        consensus.exchange_fingerprints = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        try:  # 8 attention layers of one step (a one-rank step makes no check at all)
            step = build_cp_step(ids, dist.group.WORLD)
            x = torch.randn(step.local_len, 8, 64)
            for _ in range(8):
                cp_varlen_attention(x, x, x, step)
        finally:
            consensus.exchange_fingerprints = real
    finally:
        dist.destroy_process_group()
    times.sort()
    return [{
        "what": f"check_ranks_agree, {world}-rank gloo group (default TCP store)", "steps": steps,
        "median_ms": statistics.median(times), "p90_ms": times[int(0.9 * len(times))],
        "exchanges_in_8_layers": len(calls),
    }]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    header = machine_header()
    check = check_rows(args.steps)
    print(check, flush=True)
    if dist.is_initialized() or int(os.environ.get("RANK", "0")) != 0:
        return 0
    iso = isolation_rows(args.tokens) if torch.cuda.is_available() else []
    rows = iso + check
    columns = [("layout", "documents"), ("provider", "provider"), ("fwd_ms_raw", "fwd ms raw"),
               ("fwd_ms_isolated", "fwd ms isolated"), ("bwd_ms_raw", "bwd ms raw"),
               ("bwd_ms_isolated", "bwd ms isolated"), ("fwd_overhead_pct", "fwd overhead %"),
               ("total_overhead_pct", "fwd+bwd overhead %"), ("status", "status"), ("what", "rank check"),
               ("median_ms", "median ms/step"), ("p90_ms", "p90 ms"),
               ("exchanges_in_8_layers", "exchanges in 8 layers")]  # fmt: skip
    notes = (
        f"{args.tokens} tokens, bf16, Hq={HQ}, Hkv={HKV}, D={D}, per-document causal, runtime.attend on a one-rank "
        "step. 'isolated': the runtime's wrapper forced on (sanitize pass over q/k/v, NaN fill of the rows that "
        "attended a non-finite value); 'raw': forced off. "
        "Backward = median(fwd+bwd) - median(fwd)."
    )
    md, js = write_report("guarantee_cost", rows, columns, notes, header=header, out_dir=args.out_dir,
                          title="Cost of non-finite isolation and of the per-step rank check")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
