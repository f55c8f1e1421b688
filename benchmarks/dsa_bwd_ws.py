"""The warp-specialized SM90 sparse MLA backward against the two-warpgroup fused kernel (CUDA; experiment).

``python benchmarks/dsa_bwd_ws.py [--out-dir DIR] [--tokens 16384] [--heads 64,128]`` writes ``dsa_bwd_ws_<date>.md``:
at T tokens of one document (K = 2048, GLM-5.2 dims, random causal index sets as in ``dsa.py``), the backward at
``config=None`` (today's default), the warp-specialized kernel forced (``layout="warp_specialized"``), the default
with the producer loading each tile's indices one tile ahead, before the wait for the buffer (``WS_BWD_PREFETCH_IDX =
True``; not the default), with ``--fused`` the two-warpgroup fused kernel (``layout="fused"``), each with the
largest relative difference of its dq and dkv from the default's (fp32 atomics in another order and bf16 roundings:
not 0), then T = 4096 (and H = 128, K = 512) and the deterministic mode through each at T = 4096 (with whether two
runs agree bit for bit). ``--runs 1,2,4,0`` instead times the default backward with each number of items per
program of the warp-specialized kernel (``WS_BWD_RUN``), alternating, at issue 17's four shapes
(``dsa_bwd_item_runs_<date>.md``); ``--dq-overlap`` times the default backward with each row chunk's dq kernel on
a second stream beside the next chunk's probabilities + dkv kernel (``sparse_mla_bwd.DQ_OVERLAP``, its stream's
priority and ``DQ_OVERLAP_MIN_CHUNKS``) against one stream, alternating, at the same shapes, atomic and deterministic
(the deterministic mode also with bf16 pieces, ``DET_PIECES``; ``dsa_bwd_dq_overlap_<date>.md``); ``--partition``
the SM partition instead (``DQ_OVERLAP = "partition"``, ``DQ_PARTITION_SMS``; ``dsa_bwd_partition_<date>.md``);
``--memcheck`` runs small backwards over item runs (and with the dq overlap, the partition and bf16 pieces) for
``compute-sanitizer``.
Correctness against float64 is the GPU test's
(``tests/gpu/test_dsa_triton_gpu.py -k "bwd_ws or item_runs"``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import (  # noqa: E402
    D_QK,
    D_V,
    TOPK,
    bench,
    causal_index_sets,
    mla_inputs,
    run_bwd,
    run_fwd,
    small_bwd_case,
)
from longtrain.dsa.triton import KernelConfig  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd as smb  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws  # noqa: E402

FUSED = KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1)
WS = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1)
FUSED_TOO = False  # --fused: also time the two-warpgroup fused kernel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _case(rows: list[dict], total: int, heads: int, deterministic: bool, topk: int = TOPK) -> None:
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    valid = int(length.sum())
    flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    ref = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=deterministic)
    variants = [
        ("default (config=None)", None),
        ("sm90 warp_specialized", WS),
        ("default, the producer loading a tile's indices one tile ahead", "indices-ahead"),
    ]
    if FUSED_TOO:
        variants.insert(1, ("sm90 fused (two warpgroups)", FUSED))
    for name, cfg in variants:
        prefetch = ws.WS_BWD_PREFETCH_IDX
        if cfg == "indices-ahead":
            cfg, ws.WS_BWD_PREFETCH_IDX = None, True
        row = dict(shape=f"T={total} H={heads} K={topk} 1doc", mode="deterministic" if deterministic else "atomic",
                   kernel=name)  # fmt: skip
        try:
            _time_variant(row, q, kv, out, dout, lse, idx, length, (cfg, None, None), deterministic, ref, flops)
        finally:
            ws.WS_BWD_PREFETCH_IDX = prefetch
        print(row, flush=True)
        rows.append(row)


def _time_variant(row, q, kv, out, dout, lse, idx, length, cfgs, deterministic, ref, flops) -> None:
    """One variant's run, repeat and timing into ``row`` (a variant that fails is a row, not a crash)."""
    try:
        dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs, deterministic=deterministic)
        again = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs, deterministic=deterministic)
        torch.cuda.synchronize()
        ms = bench(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs,
                                             deterministic=deterministic), rep_ms=300)  # fmt: skip
        row.update(ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, dq_rel=_rel(dq, ref[0]),
                   dkv_rel=_rel(dkv, ref[1]), finite=bool(torch.isfinite(dq).all() and torch.isfinite(dkv).all()),
                   repeat_equal=bool(torch.equal(dq, again[0]) and torch.equal(dkv, again[1])))  # fmt: skip
    except Exception as exc:
        row.update(note=f"{type(exc).__name__}: {exc}"[:200])


@gluon.jit
def _pattern_kernel(dst_ptr, keys_ptr, n_tiles, D: gl.constexpr, W: gl.constexpr, MMA: gl.constexpr,
                    num_warps: gl.constexpr, FIXED: gl.constexpr = False):  # fmt: skip
    """Add [64, D] fp32 pieces (value row*1e-3 + col*1e-4) into 64 random rows per tile, W columns per access, from
    a wgmma accumulator's layout (MMA) or a blocked one (each warp-wide access whole row segments). ``FIXED``: each
    value as int64 fixed point (x 2^32, rounded) into an int64 table, the order-independent (deterministic) sum."""
    if MMA:
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W, 16])
    else:
        L: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // W, W // 4], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        keys = gl.load(keys_ptr + tile * 64 + rows).to(gl.int64) * D  # [64]
        for c in gl.static_range(D // W):
            val = rows[:, None].to(gl.float32) * 1e-3 + (c * W + cols)[None, :].to(gl.float32) * 1e-4  # [64, W]
            if FIXED:
                x = val * 4294967296.0
                val = gl.where(x >= 0, x + 0.5, x - 0.5).to(gl.int64)  # [64, W]: rounded half away from zero
            gl.atomic_add(dst_ptr + keys[:, None] + c * W + cols[None, :], val, sem="relaxed")


def pattern_probe(out_dir: Path) -> None:
    """fp32 atomics into random rows of an L2-resident ``[16384, D]`` table: the wgmma accumulator's access pattern
    against whole row segments, one tile per program or one program (4 warps) per SM."""
    dev = torch.device("cuda")
    n_keys, n_items = 16384, 1 << 20
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    keys = torch.randint(0, n_keys, (n_items,), device=dev, dtype=torch.int32)
    rows: list[dict] = []
    for d, w in ((576, 64), (512, 128)):
        dst = torch.zeros(n_keys, d, device=dev)
        r = torch.arange(64, device=dev, dtype=torch.float32)[:, None] * 1e-3
        src = r + torch.arange(d, device=dev, dtype=torch.float32)[None, :] * 1e-4
        ref = torch.zeros_like(dst).index_add_(0, keys.long(), src[torch.arange(n_items, device=dev) % 64])
        for mma in (True, False):
            for grid, what in ((n_items // 64, "one tile per program"), (sms, f"{sms} programs (one per SM)")):
                fn = functools.partial(_pattern_kernel[(grid,)], dst, keys, n_items // 64, D=d, W=w, MMA=mma,
                                       num_warps=4)  # fmt: skip
                dst.zero_()
                fn()
                torch.cuda.synchronize()
                err = ((dst - ref).abs().max() / ref.abs().max()).item()
                ms = bench(fn)[0]
                row = dict(table=f"[{n_keys}, {d}] fp32", layout="wgmma accumulator" if mma else "row segments (v4)",
                           cols=w, grid=what, ms=ms, GBps=n_items * d * 4 / ms / 1e6, rel_err=err)  # fmt: skip
                print(row, flush=True)
                rows.append(row)
        # The same sums as int64 fixed point (row segments, one program per SM): bitwise reproducible in any order.
        dst64 = torch.zeros(n_keys, d, device=dev, dtype=torch.int64)
        fn = functools.partial(_pattern_kernel[(sms,)], dst64, keys, n_items // 64, D=d, W=w, MMA=False, num_warps=4,
                               FIXED=True)  # fmt: skip
        fn()
        torch.cuda.synchronize()
        err = ((dst64.double() / 2**32 - ref.double()).abs().max() / ref.abs().max()).item()
        ms = bench(fn)[0]
        row = dict(table=f"[{n_keys}, {d}] int64", layout="row segments, int64 fixed point (2^-32)", cols=w,
                   grid=f"{sms} programs (one per SM)", ms=ms, GBps=n_items * d * 4 / ms / 1e6,
                   rel_err=err)  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    write_report(
        "dsa_reduce_pattern", rows, ["table", "layout", "cols", "grid", "ms", "GBps", "rel_err"],
        f"{n_items} rows added into {n_keys} random rows in tiles of 64 rows, 4 warps per program, fp32 atomics "
        "(`gl.atomic_add`, relaxed): the wgmma accumulator's layout (per warp-wide access 8 rows x 32 bytes) against "
        "a blocked layout (whole row segments of W columns, v4). GB/s of added data; rel_err against torch "
        "index_add_; the int64 rows add the same values as fixed point (x 2^32, rounded; GB/s counted as the fp32 "
        "data it stands for). Reproduce: `python benchmarks/dsa_bwd_ws.py --pattern-probe`.",
        out_dir=out_dir, title="fp32 atomics into random rows: access pattern",
    )  # fmt: skip


def item_runs(out_dir: Path, runs: tuple[int, ...], shapes: tuple[tuple[int, int, int], ...], rounds: int) -> None:
    """The default backward with each ``WS_BWD_RUN`` (items per program; 0: one program per SM), alternating over
    ``rounds`` rounds at each shape, so that a slower or faster stretch of the GPU falls on every variant."""
    dev = torch.device("cuda")
    rows: list[dict] = []
    saved = ws.WS_BWD_RUN
    try:
        for total, heads, topk in shapes:
            idx, length, _, _ = causal_index_sets([total], topk, dev)
            flops = 2 * int(length.sum()) * heads * (3 * D_QK + 2 * D_V)
            q, kv = mla_inputs(total, heads, dev)
            out, lse = run_fwd(q, kv, idx, length, None)
            dout = torch.randn_like(out)
            ws.WS_BWD_RUN = 1
            ref = run_bwd(q, kv, out, dout, lse, idx, length)
            for rnd in range(rounds):
                for run in runs:
                    ws.WS_BWD_RUN = run
                    row = dict(shape=f"T={total} H={heads} K={topk} 1doc", run=run, round=rnd)
                    _time_variant(row, q, kv, out, dout, lse, idx, length, (None, None, None), False, ref, flops)
                    print(row, flush=True)
                    rows.append(row)
    finally:
        ws.WS_BWD_RUN = saved
    write_report(
        "dsa_bwd_item_runs", rows, ["shape", "run", "round", "ms", "p20", "p80", "tflops", "dq_rel", "dkv_rel",
                                    "finite", "repeat_equal", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, K) random causal keys, FLOPs over valid "
        "slots: 2 * valid * H * (3 * 576 + 2 * 512)), the whole backward at the defaults but for the warp-specialized "
        "kernel's items per program (`sparse_mla_bwd_sm90_ws.WS_BWD_RUN`; 0: one program per SM taking every G-th "
        "item), alternating, triton.testing.do_bench median with 20th/80th percentiles. dq_rel / dkv_rel: largest "
        "difference from one program per item (run 1), relative to its largest element (dkv's fp32 atomics add in "
        "another order). Reproduce: `python benchmarks/dsa_bwd_ws.py --runs 1,2,4,0`.",
        out_dir=out_dir, title="Sparse MLA backward: items per program of the warp-specialized kernel",
    )  # fmt: skip


# label: (deterministic mode only, settings of ``sparse_mla_bwd``); every variant starts from the settings below (the
# deterministic mode's fp32 pieces in 512 MiB: its defaults when these experiments ran).
_BF16_DET = {"DET_PIECES": "bf16", "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30}  # the reduction: 8 slots at a time
OVERLAP_VARIANTS = {
    "off": (False, {}),
    "high": (False, {"DQ_OVERLAP": "high"}),
    "high, 8 chunks": (False, {"DQ_OVERLAP": "high", "DQ_OVERLAP_MIN_CHUNKS": 8}),
    "same": (False, {"DQ_OVERLAP": "same"}),
    "high + reduce": (True, {"DQ_OVERLAP": "high", "DET_REDUCE_OVERLAP": True}),
    "off, bf16 pieces": (True, {"DET_PIECES": "bf16"}),
    "high + reduce, bf16 pieces": (True, {"DQ_OVERLAP": "high", "DET_REDUCE_OVERLAP": True, "DET_PIECES": "bf16"}),
}
# --partition: the probabilities + dkv kernel on all SMs but DQ_PARTITION_SMS, dq (and the reductions) beside it.
PARTITION_VARIANTS = {
    "off": (False, {}),
    **{f"partition {n}": (False, {"DQ_OVERLAP": "partition", "DQ_PARTITION_SMS": n}) for n in (16, 32, 48)},
    "off, bf16 pieces 2 GiB": (True, _BF16_DET),
    **{f"partition {n}, bf16 pieces 2 GiB": (
        True, {**_BF16_DET, "DQ_OVERLAP": "partition", "DQ_PARTITION_SMS": n}) for n in (16, 32)},
}  # fmt: skip
_OVERLAP_DEFAULTS = {
    "DQ_OVERLAP": None, "DQ_OVERLAP_MIN_CHUNKS": 4, "DQ_PARTITION_SMS": 32, "DET_REDUCE_OVERLAP": False,
    "DET_PIECES": "fp32", "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 27, "DKV_REDUCE_BATCH": None,
}  # fmt: skip


def _settle(settings: dict) -> None:
    for name, value in {**_OVERLAP_DEFAULTS, **settings}.items():
        setattr(smb, name, value)


def dq_overlap(
    out_dir: Path, shapes: tuple[tuple[int, int, int], ...], rounds: int, det_shapes: int, partition: bool = False
) -> None:
    """The default backward with the dq kernel on one stream and on a second one (``DQ_OVERLAP``, at least
    ``DQ_OVERLAP_MIN_CHUNKS`` row chunks), alternating over ``rounds`` rounds; the deterministic mode too at the first
    ``det_shapes`` shapes. ``partition``: the SM partition's variants instead (``DQ_OVERLAP = "partition"``). dq must
    equal the one-stream dq bit for bit (so must dkv in deterministic mode with the same pieces)."""
    dev = torch.device("cuda")
    rows: list[dict] = []
    variants = PARTITION_VARIANTS if partition else OVERLAP_VARIANTS
    saved = {name: getattr(smb, name) for name in _OVERLAP_DEFAULTS}
    try:
        for n, (total, heads, topk) in enumerate(shapes):
            idx, length, _, _ = causal_index_sets([total], topk, dev)
            flops = 2 * int(length.sum()) * heads * (3 * D_QK + 2 * D_V)
            q, kv = mla_inputs(total, heads, dev)
            out, lse = run_fwd(q, kv, idx, length, None)
            dout = torch.randn_like(out)
            for det in (False, True) if n < det_shapes else (False,):
                _settle({})
                ref = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det)
                for rnd in range(rounds):
                    for label, (det_only, settings) in variants.items():
                        if det_only and not det:
                            continue
                        _settle(settings)
                        row = dict(shape=f"T={total} H={heads} K={topk} 1doc", det="yes" if det else "no",
                                   variant=label, round=rnd)  # fmt: skip
                        _time_variant(row, q, kv, out, dout, lse, idx, length, (None, None, None), det, ref, flops)
                        dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det)
                        row["dq_equal"] = bool(torch.equal(dq, ref[0]))
                        row["dkv_equal"] = bool(torch.equal(dkv, ref[1]))
                        print(row, flush=True)
                        rows.append(row)
    finally:
        _settle(saved)
    name = "dsa_bwd_partition" if partition else "dsa_bwd_dq_overlap"
    write_report(
        name, rows, ["shape", "det", "variant", "round", "ms", "p20", "p80", "tflops", "dq_equal", "dkv_equal",
                     "dkv_rel", "repeat_equal", "finite", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, K) random causal keys, FLOPs over valid "
        "slots: 2 * valid * H * (3 * 576 + 2 * 512)), the whole backward at the defaults but for the variant's "
        "settings of `sparse_mla_bwd` (benchmarks/dsa_bwd_ws.py, OVERLAP_VARIANTS / PARTITION_VARIANTS): off, one "
        "stream; high / same, each row chunk's dq kernel on a second stream of a higher (-1) / the default priority, "
        "beside the next chunk's probabilities + dkv kernel (`DQ_OVERLAP`), with at least 4 row chunks or the number "
        "given (`DQ_OVERLAP_MIN_CHUNKS`); partition N: the probabilities + dkv kernel on a high-priority stream as "
        "one program per SM on all SMs but N, dq and the deterministic reductions on the caller's stream "
        "(`DQ_OVERLAP = \"partition\"`, `DQ_PARTITION_SMS`); + reduce: the deterministic reduction of each chunk's "
        "pieces after its dq on the second stream (`DET_REDUCE_OVERLAP`); bf16 pieces: the deterministic mode's "
        "per-slot dkv pieces rounded to bf16 before the fixed-order sum (`DET_PIECES`; dkv then differs from the fp32 "
        "pieces' by up to a bf16 rounding per piece: dkv_rel, not dkv_equal), with 2 GiB of scratch "
        "(`DETERMINISTIC_SCRATCH_ELEMENTS`) where named (the reduction reads 8 slots at a time with bf16 pieces, "
        "`DKV_REDUCE_BATCH`'s default); alternating, triton.testing.do_bench median with 20th/80th percentiles. "
        "dq_equal / dkv_equal: bit for bit against one stream (dkv's fp32 atomics add in another order outside the"
        " deterministic mode: dkv_rel is "
        "the largest difference relative to its largest element). Reproduce: `python benchmarks/dsa_bwd_ws.py "
        + ("--partition`." if partition else "--dq-overlap`."),
        out_dir=out_dir, title="Sparse MLA backward: " + ("the SM partition" if partition else
                                                          "the dq kernel on a second stream"),
    )  # fmt: skip


def memcheck_runs() -> None:
    """Small backwards for compute-sanitizer through the warp-specialized kernel over runs of items (3: the last run
    shorter) and one program per SM: H = 64, 96, 128, with and without lengths, invalid and out-of-range slots,
    deterministic mode."""
    dev = torch.device("cuda")
    total, topk = 300, 256
    saved = ws.WS_BWD_RUN, smb.DQ_OVERLAP, smb.DET_REDUCE_OVERLAP, smb.DET_PIECES
    try:
        for heads in (64, 96, 128):
            q, kv, idx, length, out, lse, dout = small_bwd_case(total, topk, heads, dev)
            for run, overlap in ((3, None), (0, None), (3, "high"), (1, "partition")):
                ws.WS_BWD_RUN, smb.DQ_OVERLAP, smb.DET_REDUCE_OVERLAP = run, overlap, overlap is not None
                smb.DET_PIECES = "bf16" if overlap is not None else "fp32"
                for with_len in (True, False):
                    for det in (False, True):
                        dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length if with_len else None,
                                             deterministic=det)  # fmt: skip
                        torch.cuda.synchronize()
                        print("memcheck case", heads, run, overlap, with_len, det,
                              bool(dq.isfinite().all() and dkv.isfinite().all()), flush=True)  # fmt: skip
    finally:
        ws.WS_BWD_RUN, smb.DQ_OVERLAP, smb.DET_REDUCE_OVERLAP, smb.DET_PIECES = saved


def main(out_dir: Path, total: int, heads_list: tuple[int, ...]) -> None:
    rows: list[dict] = []
    for heads in heads_list:
        _case(rows, total, heads, False)
    _case(rows, 4096, 64, False)
    _case(rows, 4096, 128, False, topk=512)
    _case(rows, 4096, 64, True)
    write_report(
        "dsa_bwd_ws", rows, ["shape", "mode", "kernel", "ms", "p20", "p80", "tflops", "dq_rel", "dkv_rel", "finite",
                             "repeat_equal", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, 2048) random causal keys, FLOPs over valid "
        "slots: 2 * valid * H * (3 * 576 + 2 * 512)), the whole backward (preprocess, probabilities + dkv, dq), "
        "triton.testing.do_bench median with 20th/80th percentiles. dq_rel / dkv_rel: largest difference from the "
        "default's in the same mode, relative to its largest element. repeat_equal: a second run equal bit for bit. "
        "Reproduce: `python benchmarks/dsa_bwd_ws.py`.",
        out_dir=out_dir, title="Sparse MLA backward: the warp-specialized SM90 kernel",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", default="64,128")
    parser.add_argument("--pattern-probe", action="store_true")
    parser.add_argument("--fused", action="store_true", help="also time the two-warpgroup fused kernel")
    parser.add_argument("--runs", default="", help="comma-separated WS_BWD_RUN values to compare, e.g. 1,2,4,0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default="16384,64,2048;16384,128,2048;4096,64,2048;4096,128,512",
                        help="--runs' shapes: T,H,K separated by ';'")  # fmt: skip
    parser.add_argument("--memcheck", action="store_true", help="small backwards over item runs, no report")
    parser.add_argument("--dq-overlap", action="store_true", help="the dq kernel on a second stream against one")
    parser.add_argument("--partition", action="store_true", help="the SM partition (DQ_OVERLAP='partition')")
    parser.add_argument("--det-shapes", type=int, default=2, help="--dq-overlap: the deterministic mode's shapes")
    args = parser.parse_args()
    FUSED_TOO = args.fused
    shapes = tuple(tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split(";"))
    if args.memcheck:
        memcheck_runs()
    elif args.dq_overlap or args.partition:
        dq_overlap(args.out_dir, shapes, args.rounds, args.det_shapes, partition=args.partition)
    elif args.runs:
        item_runs(args.out_dir, tuple(int(r) for r in args.runs.split(",")), shapes, args.rounds)
    elif args.pattern_probe:
        pattern_probe(args.out_dir)
    else:
        main(args.out_dir, args.tokens, tuple(int(h) for h in args.heads.split(",")))
