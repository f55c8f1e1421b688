"""Where the sparse MLA backward's time goes, and launch configs past its autotuner's candidates (CUDA; experiment).

``python benchmarks/dsa_bwd_variants.py [--out-dir DIR] [--heads 64] [--tokens 16384] [--kernels ds,dq,dkv]`` writes
``dsa_bwd_variants_<date>.md``: at T tokens of one document (K = 2048, GLM-5.2 dims),

- the autotuned backward, its per-kernel split (``torch.profiler``: preprocess, probabilities ``ds``, ``dq``, ``dkv``)
  and each kernel's autotuned pick;
- for each of the three kernels, the whole backward with that kernel forced to each config of a wider list
  (the other two at their autotuned picks), with the largest difference of its dq / dkv from the autotuned
  backward's (the dkv atomics add in a different order, so the difference is a rounding, not 0);
- ``--fused``: the backward at its SM90 default (the fused probabilities + dkv kernel, then dq) and its per-kernel
  split, and with the dq kernel forced to other configs, at 64 and 128 heads, ``dsa_bwd_fused_<date>.md`` (41a7454
  also timed issuing a tile's last dkv atomics under the next tile's first wgmma: slower,
  ``dsa_bwd_fused_41a7454_2026-12-02.md``);
- ``--reduce-probe``: fp32 reduction throughput into random rows of a ``[16384, 512]`` table (what bounds the dkv
  kernel): ``tl.atomic_add`` (``red``) of ``[BLOCK_K, BOX]`` tiles and of single ``[BOX]`` rows, against TMA
  reductions (``cp.reduce.async.bulk.tensor`` add, a tensor descriptor's ``atomic_add``) of ``[1, BOX]`` boxes,
  ``dsa_reduce_probe_<date>.md``.

Not shipped: a config that wins moves into ``longtrain.dsa.triton.sparse_mla_bwd``'s candidate lists.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import (  # noqa: E402
    D_QK,
    D_V,
    TOPK,
    bench,
    causal_index_sets,
    mla_inputs,
    precompile,
    run_bwd,
    run_fwd,
)
from longtrain.dsa.triton import KernelConfig  # noqa: E402

# (block_k, num_warps, num_stages[, col_groups[, block_h]]) per kernel: the autotuner's candidates and neighbours.
WIDER = {
    "ds": [
        (32, 4, 2),
        (32, 4, 3),
        (32, 4, 4),
        (16, 4, 2),
        (16, 4, 4),
        (64, 4, 2),
        (64, 8, 1),
        (32, 8, 2),
        (16, 8, 3),
        # (..., 1, block_h): 32 heads per program (two programs per row, half the resident Q / dO each)
        (32, 4, 2, 1, 32),
        (64, 4, 2, 1, 32),
        (32, 4, 3, 1, 32),
        (64, 8, 2, 1, 32),
        (32, 8, 2, 1, 32),
        (16, 4, 2, 1, 32),
    ],
    "dq": [(64, 8, 2), (32, 8, 3), (128, 8, 1), (32, 4, 2), (32, 4, 3), (64, 4, 2), (16, 4, 4), (64, 8, 3)],
    "dkv": [
        (64, 8, 2),
        (64, 8, 3),
        (64, 4, 2),
        (32, 8, 2),
        (32, 4, 2),
        # (block_k, num_warps, num_stages, col_groups): the value columns split over 2 or 4 programs per row
        (64, 4, 2, 2),
        (64, 4, 3, 2),
        (64, 8, 2, 2),
        (32, 4, 2, 2),
        (64, 4, 2, 4),
        (64, 4, 3, 4),
        (64, 8, 2, 4),
        (32, 4, 3, 4),
    ],
}
KERNELS = ("ds", "dq", "dkv")


@triton.jit
def _reduce_rows_kernel(
    dst_desc, dst_ptr, keys_ptr, src_ptr, ROWS: tl.constexpr, D: tl.constexpr, BOX: tl.constexpr, MODE: tl.constexpr
):
    """Add ``ROWS`` rows of ``D`` fp32 into random rows of ``dst``: MODE 0 = red of [BOX] rows, 1 = TMA boxes."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BOX)
    for r in range(ROWS):
        i = pid * ROWS + r
        key = tl.load(keys_ptr + i)  # scalar
        for c in tl.static_range(D // BOX):
            v = tl.load(src_ptr + (i % 64) * D + c * BOX + offs)  # [BOX] (a small, cached source)
            if MODE == 1:
                dst_desc.atomic_add([key, c * BOX], tl.reshape(v, [1, BOX]))
            else:
                tl.atomic_add(dst_ptr + key.to(tl.int64) * D + c * BOX + offs, v, sem="relaxed")


@triton.jit
def _reduce_tiles_kernel(dst_ptr, keys_ptr, src_ptr, D: tl.constexpr, BLOCK_K: tl.constexpr, BOX: tl.constexpr):
    """The dkv kernel's pattern: [BLOCK_K, BOX] tiles added into BLOCK_K random rows (tl.atomic_add)."""
    pid = tl.program_id(0)
    offs_k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    keys = tl.load(keys_ptr + offs_k).to(tl.int64)  # [BLOCK_K]
    for c in tl.static_range(D // BOX):
        offs = c * BOX + tl.arange(0, BOX)
        v = tl.load(src_ptr + (offs_k % 64)[:, None] * D + offs[None, :])  # [BLOCK_K, BOX]
        tl.atomic_add(dst_ptr + keys[:, None] * D + offs[None, :], v, sem="relaxed")


def reduce_probe(out_dir: Path) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    n_keys, d, n_items = 16384, 512, 1 << 20
    src = torch.randn(64, d, device=dev)
    keys = torch.randint(0, n_keys, (n_items,), device=dev, dtype=torch.int32)
    dst = torch.zeros(n_keys, d, device=dev)
    rows: list[dict] = []

    def add(what, fn):
        try:
            dst.zero_()
            fn()
            torch.cuda.synchronize()
            # Every variant adds the same rows: check the sum against a torch index_add.
            ref = torch.zeros_like(dst).index_add_(0, keys.long(), src[torch.arange(n_items, device=dev) % 64])
            err = ((dst - ref).abs().max() / ref.abs().max()).item()
            ms = bench(fn)[0]
            row = dict(what=what, ms=ms, GBps=n_items * d * 4 / ms / 1e6, rel_err=err)
        except Exception as exc:  # an unsupported variant is a row, not a stop
            row = dict(what=what, note=f"failed: {type(exc).__name__}: {exc}"[:200])
        print(row, flush=True)
        rows.append(row)

    for bk, box, w in ((64, 64, 4), (64, 128, 4), (32, 128, 4), (64, 256, 8)):
        add(f"red, [{bk}, {box}] tiles, {w} warps",
            lambda bk=bk, box=box, w=w: _reduce_tiles_kernel[(n_items // bk,)](dst, keys, src, D=d, BLOCK_K=bk,
                                                                                 BOX=box, num_warps=w))  # fmt: skip
    for mode, name in ((0, "red"), (1, "TMA reduce")):
        for box, rows_per, w in ((64, 16, 1), (128, 16, 1), (256, 16, 2), (128, 64, 1), (256, 64, 4)):
            desc = TensorDescriptor(dst, [n_keys, d], [d, 1], [1, box])
            add(f"{name}, [1, {box}] rows, {rows_per} rows per program, {w} warps",
                lambda desc=desc, box=box, rows_per=rows_per, w=w, mode=mode: _reduce_rows_kernel[
                    (n_items // rows_per,)](desc, dst, keys, src, ROWS=rows_per, D=d, BOX=box, MODE=mode,
                                            num_warps=w))  # fmt: skip
    write_report(
        "dsa_reduce_probe", rows, ["what", "ms", "GBps", "rel_err", "note"],
        f"{n_items} rows of {d} fp32 added into {n_keys} random rows (L2-resident table, values from a cached "
        "source): GB/s of added data. rel_err: against torch index_add_. Reproduce: "
        "`python benchmarks/dsa_bwd_variants.py --reduce-probe`.",
        out_dir=out_dir, title="fp32 reductions into random rows: red against TMA",
    )  # fmt: skip


def _cfg(c: tuple) -> KernelConfig:
    """``(block_k, num_warps, num_stages[, col_groups[, block_h]])`` as a launch config (64 heads per program)."""
    groups, block_h = (c[3] if len(c) > 3 else 1), (c[4] if len(c) > 4 else 64)
    return KernelConfig(block_k=c[0], block_h=block_h, num_warps=c[1], num_stages=c[2], col_groups=groups)


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
        if "sparse_mla_bwd" in ev.key and "_kernel_" in ev.key:  # the portable kernels and the SM90 ones
            short = ev.key.split("_kernel_")[-1].split("(")[0]
            total_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            out[short] = out.get(short, 0.0) + total_us / 1e3
    return out


def fused(out_dir: Path, heads_list: tuple[int, ...], total: int) -> None:
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], TOPK, dev)
    valid = int(length.sum())
    rows: list[dict] = []
    for heads in heads_list:
        q, kv = mla_inputs(total, heads, dev)
        bwd_flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
        out, lse = run_fwd(q, kv, idx, length, None)
        dout = torch.randn_like(out)
        # The default, then the dq kernel forced: the SM90 one's other rings, and the portable one's candidates.
        dq_cfgs = [None] + [KernelConfig(impl="sm90", block_k=bk, num_stages=nb) for bk, nb in ((32, 3), (32, 4))]
        dq_cfgs += [_cfg(c) for c in mb._DQ_CANDIDATES]
        for dq_cfg in dq_cfgs:
            call = functools.partial(run_bwd, q, kv, out, dout, lse, idx, length, cfgs=(None, dq_cfg, None))
            call()
            ms = bench(call, rep_ms=300)
            split = _split(call)
            note = "split " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items())
            c = dq_cfg
            what = "-" if c is None else f"{c.impl} {c.block_k} x {c.num_warps} x {c.num_stages}"
            rows.append(dict(shape=f"T={total} H={heads} K={TOPK} 1doc", kernel="all (SM90 default)" if dq_cfg is None
                             else "dq forced", cfg=what, ms=ms[0], p20=ms[1], p80=ms[2],
                             tflops=bwd_flops / ms[0] / 1e9, note=note))  # fmt: skip
            print(rows[-1], flush=True)
    write_report(
        "dsa_bwd_fused", rows, ["shape", "kernel", "cfg", "ms", "p20", "p80", "tflops", "note"],
        "Sparse MLA backward at its SM90 default (the fused probabilities + dkv kernel, then dq; bf16, one document, "
        "random causal index sets, L2 flushed) and its per-kernel split, then with the dq kernel forced (impl "
        "block_k x num_warps x num_stages). Reproduce: "
        "`python benchmarks/dsa_bwd_variants.py --fused`.",
        out_dir=out_dir, title="Sparse MLA backward: the fused SM90 kernel's split",
    )  # fmt: skip


def main(out_dir: Path, heads: int, total: int, kernels: tuple[str, ...] = KERNELS) -> None:
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    mb.sm90_backward_plan = lambda *args, **kwargs: None  # this experiment times the portable kernels only
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
    for name in kernels:
        for c in WIDER[name]:
            cfg = tuple(_cfg(c if other == name else picks[other]) for other in KERNELS)
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
    for name in kernels:
        for c in WIDER[name]:
            cfgs = tuple(_cfg(c if other == name else picks[other]) for other in KERNELS)
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
        out_dir=out_dir, title="Sparse MLA backward: per-kernel split and wider launch configs",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--kernels", default="ds,dq,dkv", help="kernels whose wider configs are timed")
    parser.add_argument("--reduce-probe", action="store_true")
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    if args.fused:
        fused(args.out_dir, (64, 128) if args.heads == 64 else (args.heads,), args.tokens)
    elif args.reduce_probe:
        reduce_probe(args.out_dir)
    else:
        main(args.out_dir, args.heads, args.tokens, tuple(args.kernels.split(",")))
