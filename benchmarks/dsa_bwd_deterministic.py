"""The sparse MLA backward's deterministic mode against the default (CUDA).

``python benchmarks/dsa_bwd_deterministic.py [--out-dir DIR] [--case T,H,K ...]`` writes
``dsa_bwd_deterministic_<date>.md``: per shape (one document, random causal index sets as in ``dsa.py``, GLM-5.2
dims) the backward at the defaults (fp32 atomics) and the deterministic mode (at its defaults: pieces in dkv's
precision, bf16 here, in 2 GiB of scratch; and with fp32 pieces in 512 MiB, its defaults before the thirty-fourth
session, and in 2 GiB), each with its time relative to the default's, whether two runs agree bit for bit, and the
largest difference of its dq and dkv from the default's relative to their largest element. Correctness against
float64 is the GPU tests' (``tests/gpu/test_dsa_triton_gpu.py -k deterministic``).

``--bf16-pieces`` adds the bf16 pieces' variants, ``--fp16-pieces`` the scaled fp16 pieces' (``DET_PIECES = "fp16"``)
beside bf16's at 2 GiB, ``--reduce-sweep`` the reduction's slots at a time and warps, ``--runs-in-line`` 2 GiB
variants with each chunk's sort and search formed in line on the caller's stream (``DET_RUNS_AHEAD = False``).
``--accuracy`` writes ``dsa_bwd_deterministic_accuracy_<date>.md`` instead: dkv's error against the float64
reference for the default backward and each pieces format (T = 2048, H = 64 and 128, K = 512). ``--memcheck`` runs
small deterministic backwards with scaled fp16 pieces through every producer of pieces for ``compute-sanitizer`` (no
report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, reproduce_args, write_report  # noqa: E402
from dsa_pieces_model import dkv_errors  # noqa: E402
from longtrain.bench_suites.dsa import (  # noqa: E402
    D_QK,
    D_V,
    bench,
    causal_index_sets,
    mla_inputs,
    run_bwd,
    run_fwd,
    small_bwd_case,
)
from longtrain.dsa.triton import sparse_mla_bwd as smb  # noqa: E402

CASES = ((16384, 64, 2048), (4096, 128, 512), (4096, 64, 2048), (16384, 128, 2048))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _mean_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean().clamp_min(1e-30)).item()


BF16_PIECES = False  # --bf16-pieces: also the bf16 pieces' variants
FP16_PIECES = False  # --fp16-pieces: also the scaled fp16 pieces' variants, beside bf16's at 2 GiB
REDUCE_SWEEP = False  # --reduce-sweep: the reduction's slots at a time and warps, with bf16 pieces and 2 GiB
# The deterministic defaults until the thirty-fourth session.
FP32_512 = {"DET_PIECES": "fp32", "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 27}
RUNS_IN_LINE = False  # --runs-in-line: also the variants with each chunk's sort formed in line (DET_RUNS_AHEAD off)


def _variants() -> dict[str, tuple[bool, dict]]:
    """name: (deterministic, module settings of ``sparse_mla_bwd`` for the run)."""
    variants = {
        "default (fp32 atomics)": (False, {}),
        "deterministic, the defaults (bf16 pieces, 2 GiB)": (True, {}),
        "deterministic, fp32 pieces 512 MiB (the previous defaults)": (True, FP32_512),
        "deterministic, fp32 pieces 2 GiB": (True, {**FP32_512, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 29}),
    }
    if REDUCE_SWEEP:
        bf16 = {"DET_PIECES": "bf16", "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30}
        variants["deterministic, bf16 pieces 2 GiB (the reduction's measured choice)"] = (True, bf16)
        for batch, warps in ((8, 4), (16, 4), (32, 4), (8, 8), (16, 8), (8, 2)):
            name = f"deterministic, bf16 pieces 2 GiB, reduction {batch} slots at a time, {warps} warps"
            variants[name] = (True, {**bf16, "DKV_REDUCE_BATCH": batch, "DKV_REDUCE_NUM_WARPS": warps})
    if FP16_PIECES:
        fp16, bf16 = {"DET_PIECES": "fp16"}, {"DET_PIECES": "bf16"}
        variants.update({
            "deterministic, scaled fp16 pieces 512 MiB": (True, {**fp16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 28}),
            "deterministic, scaled fp16 pieces 2 GiB": (True, {**fp16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30}),
            "deterministic, scaled fp16 pieces 4 GiB": (True, {**fp16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 31}),
        })  # fmt: skip
    if RUNS_IN_LINE:
        in_line = {"DET_RUNS_AHEAD": False}
        big = {"DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30}
        variants.update({
            "deterministic, fp32 pieces 2 GiB, runs in line": (
                True, {**in_line, "DET_PIECES": "fp32", "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 29}),
            "deterministic, bf16 pieces 2 GiB, runs in line": (True, {**big, **in_line, "DET_PIECES": "bf16"}),
            "deterministic, scaled fp16 pieces 2 GiB, runs in line": (True, {**big, **in_line, "DET_PIECES": "fp16"}),
        })  # fmt: skip
    if BF16_PIECES:
        bf16 = {"DET_PIECES": "bf16"}
        side = {"DQ_OVERLAP": "high", "DET_REDUCE_OVERLAP": True}
        variants.update({
            "deterministic, bf16 pieces 256 MiB": (True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 27}),
            "deterministic, bf16 pieces, 512 MiB": (True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 28}),
            "deterministic, bf16 pieces 2 GiB": (True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30}),
            "deterministic, bf16 pieces 2 GiB, reduction one slot at a time": (
                True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30, "DKV_REDUCE_BATCH": 1}),
            "deterministic, bf16 pieces 4 GiB": (True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 31}),
            "deterministic, bf16 pieces 2 GiB, SM partition 32": (
                True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30, "DQ_OVERLAP": "partition",
                       "DQ_PARTITION_SMS": 32}),
            "deterministic, bf16 pieces 2 GiB, reduction on the second stream": (
                True, {**bf16, "DETERMINISTIC_SCRATCH_ELEMENTS": 1 << 30, **side}),
        })  # fmt: skip
    return variants


def _case(rows: list[dict], total: int, heads: int, topk: int) -> None:
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    flops = 2 * int(length.sum()) * heads * (3 * D_QK + 2 * D_V)
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    shape = f"T={total} H={heads} K={topk} 1doc"
    base = None
    for name, (det, settings) in _variants().items():
        saved = {k: getattr(smb, k) for k in settings}
        row = dict(shape=shape, variant=name)
        try:
            for k, v in settings.items():
                setattr(smb, k, v)
            a = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det)
            b = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det)
            ms = bench(lambda det=det: run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det), rep_ms=300)
            base = (a, ms[0]) if base is None else base
            row.update(ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, of_default=base[1] / ms[0],
                       repeat_equal=bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
                       dq_rel=_rel(a[0], base[0][0]), dkv_rel=_rel(a[1], base[0][1]),
                       dkv_mean_rel=_mean_rel(a[1], base[0][1]),
                       finite=bool(torch.isfinite(a[1]).all()))  # fmt: skip
        except Exception as exc:  # a variant that fails is a row, not a stop
            row.update(note=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            for k, v in saved.items():
                setattr(smb, k, v)
        print(row, flush=True)
        rows.append(row)


def memcheck() -> None:
    """Small deterministic backwards with scaled fp16 pieces for compute-sanitizer: the warp-specialized and the
    two-warpgroup fused kernels and the portable dkv kernel (two value-column groups), H = 64, 96 and 128, with and
    without lengths, invalid and out-of-range slots."""
    from longtrain.dsa.triton import KernelConfig

    dev = torch.device("cuda")
    fused = (KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1), None, None)
    portable = KernelConfig(block_k=32, num_warps=8, num_stages=1)
    routes = {
        "default": (None, None, None),
        "fused": fused,
        "portable": (portable, portable, KernelConfig(block_k=32, num_warps=8, num_stages=1, col_groups=2)),
    }
    smb.DET_PIECES = "fp16"
    for heads in (64, 96, 128):
        q, kv, idx, length, out, lse, dout = small_bwd_case(300, 256, heads, dev)
        for name, cfgs in routes.items():
            for with_len in (True, False):
                dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length if with_len else None, cfgs=cfgs,
                                     deterministic=True)  # fmt: skip
                torch.cuda.synchronize()
                print("memcheck case", heads, name, with_len, bool(dq.isfinite().all() and dkv.isfinite().all()),
                      flush=True)  # fmt: skip


ACCURACY_CASES = ((2048, 64, 512), (2048, 128, 512))
ACCURACY_VARIANTS = {
    "default (fp32 atomics)": (False, {}),
    "deterministic, the defaults (bf16 pieces)": (True, {}),
    "deterministic, fp32 pieces": (True, {"DET_PIECES": "fp32"}),
    "deterministic, scaled fp16 pieces": (True, {"DET_PIECES": "fp16"}),
}


def accuracy(out_dir: Path, cases) -> None:
    """dkv's error against the float64 reference (``longtrain.dsa.reference``) per pieces format, beside the default
    backward's and the float64 dkv's own rounding to bf16: what each format costs in accuracy."""
    from longtrain.dsa.reference import sparse_mla_reference

    dev = torch.device("cuda")
    rows: list[dict] = []
    for total, heads, topk in cases:
        idx, length, _, _ = causal_index_sets([total], topk, dev)
        q, kv = mla_inputs(total, heads, dev)
        out, lse = run_fwd(q, kv, idx, length, None)
        dout = torch.randn_like(out)
        leaves = [q.double().requires_grad_(True), kv.double().requires_grad_(True)]
        ref, _ = sparse_mla_reference(leaves[0], leaves[1], idx, D_QK**-0.5, d_v=D_V, topk_length=length)
        want = torch.autograd.grad(ref, leaves[1], dout.double())[0].view(total, -1)
        del ref, leaves
        shape = f"T={total} H={heads} K={topk} 1doc"
        floor = dkv_errors(want.to(torch.bfloat16), want)
        rows.append(dict(shape=shape, variant="float64 dkv rounded to bf16 (the floor)", **floor))
        base = None
        for name, (det, settings) in ACCURACY_VARIANTS.items():
            saved = {k: getattr(smb, k) for k in settings}
            try:
                for k, v in settings.items():
                    setattr(smb, k, v)
                dkv = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=det)[1].view(total, -1)
            finally:
                for k, v in saved.items():
                    setattr(smb, k, v)
            row = dict(shape=shape, variant=name, **dkv_errors(dkv, want))
            base = row["mean_err"] if base is None else base
            row["of_default"] = row["mean_err"] / base
            print(row, flush=True)
            rows.append(row)
    write_report(
        "dsa_bwd_deterministic_accuracy", rows, ["shape", "variant", "mean_err", "max_err", "of_default"],
        "dkv of the sparse MLA backward (bf16 inputs, one document, random causal index sets) against the float64 "
        "reference's: mean_err = mean |dkv - ref| / mean |ref|, max_err = max |dkv - ref| / max |ref|, of_default = "
        "mean_err over the default backward's. Reproduce: "
        f"`python benchmarks/dsa_bwd_deterministic.py {reproduce_args()}`.",
        out_dir=out_dir, title="Sparse MLA backward: dkv's accuracy per pieces format",
    )  # fmt: skip


def main(out_dir: Path, cases: list[tuple[int, int, int]]) -> None:
    rows: list[dict] = []
    for total, heads, topk in cases:
        _case(rows, total, heads, topk)
    write_report(
        "dsa_bwd_deterministic", rows,
        ["shape", "variant", "ms", "p20", "p80", "tflops", "of_default", "repeat_equal", "dq_rel", "dkv_rel",
         "dkv_mean_rel", "finite", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, K) random causal keys), FLOPs "
        "2 * valid * H * (3 * 576 + 2 * 512), the whole backward at the defaults. triton.testing.do_bench median with "
        "20th/80th percentiles. of_default: the default's median over this one's. repeat_equal: a second run equal "
        "bit for bit. dq_rel / dkv_rel: largest difference from the default's, relative to its largest element; "
        "dkv_mean_rel: mean absolute difference from the default's dkv over its mean magnitude. "
        f"Reproduce: `python benchmarks/dsa_bwd_deterministic.py {reproduce_args()}`.",
        out_dir=out_dir, title="Sparse MLA backward: deterministic mode against the default",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--case", action="append", default=None, help="T,H,K (repeatable); default: four shapes")
    parser.add_argument("--bf16-pieces", action="store_true", help="also the bf16 pieces (DET_PIECES) variants")
    parser.add_argument("--fp16-pieces", action="store_true", help="also the scaled fp16 pieces' variants")
    parser.add_argument("--memcheck", action="store_true", help="small scaled fp16 backwards for compute-sanitizer")
    parser.add_argument("--accuracy", action="store_true", help="dkv against float64 per pieces format (no timing)")
    parser.add_argument(
        "--runs-in-line",
        action="store_true",
        help="also 2 GiB variants with each chunk's sort formed in line (DET_RUNS_AHEAD off)",
    )
    parser.add_argument("--reduce-sweep", action="store_true",
                        help="also the reduction's slots at a time and warps (DKV_REDUCE_BATCH, DKV_REDUCE_NUM_WARPS), "
                             "bf16 pieces, 2 GiB")  # fmt: skip
    args = parser.parse_args()
    BF16_PIECES = args.bf16_pieces
    FP16_PIECES = args.fp16_pieces
    REDUCE_SWEEP = args.reduce_sweep
    RUNS_IN_LINE = args.runs_in_line
    if args.memcheck:
        memcheck()
        sys.exit(0)
    chosen = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else None
    if args.accuracy:
        accuracy(args.out_dir, chosen or ACCURACY_CASES)
    else:
        main(args.out_dir, chosen or list(CASES))
