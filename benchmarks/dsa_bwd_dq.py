"""The sparse MLA backward's SM90 dq kernel at 64 and 128 heads per program, the row chunk and the deterministic
chunk (CUDA; experiment).

``python benchmarks/dsa_bwd_dq.py [--out-dir DIR] [--quick] [--rings] [--staged-store]`` writes
``dsa_bwd_dq_<date>.md``, one document, K slots per query (random causal index sets as in ``dsa.py``), GLM-5.2 /
DeepSeek-V3.2 dims:

* ``dq kernel``: the dq kernel alone on one chunk of every row (``dS`` random, as the backward stores it), 64 heads
  per program (every column) against 128 heads per program (two programs, half of the columns each) at several
  rings, ``dS`` loaded into registers one step ahead or staged through the ring in shared memory, with the largest
  difference of each dq from the first variant's relative to its largest element;
* ``backward``: the whole backward at ``config=None`` with the dq kernel forced to each variant;
* ``chunk``: the whole backward at the defaults with ``sparse_mla_bwd.PDS_SCRATCH_BYTES`` at several budgets (the row
  chunk: rows per launch pair);
* ``deterministic``: the deterministic backward at T = 4096, H = 64 with several per-slot scratch sizes (rows per
  chunk) and whether two runs agree bit for bit.

``--rings`` times only the dq kernel alone and the whole backward with deeper rings (64 heads per program, dS in
registers: 64 x 2, 64 x 3, 32 x 4, 32 x 6), at four shapes. ``--staged-store`` times only dq stored through the ring
(``SM90_DQ_STAGED_STORE``) against straight from the accumulator alone, and the whole backward with each store path
of dq and of dS (``WS_BWD_STAGED_DS``), alternating, at four shapes. ``--memcheck`` runs small backwards through
every store path for ``compute-sanitizer`` (no report).

Correctness against float64 is the GPU test's (``tests/gpu/test_dsa_triton_gpu.py -k dq128``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, reproduce_args, write_report  # noqa: E402
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
from longtrain.dsa.triton import KernelConfig  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd as smb  # noqa: E402
from longtrain.dsa.triton import sparse_mla_bwd_plan as bwd_plan  # noqa: E402

# (block_k, num_buf, heads per program, dS through shared memory); the first is the kernel before dS went through the
# ring (the reference of dq_rel).
NARROW = (64, 2, 64, False)
VARIANTS_64 = (NARROW, (64, 2, 64, True), (32, 4, 64, True))
VARIANTS_128 = (*VARIANTS_64, (64, 2, 128, True), (64, 3, 128, True), (64, 4, 128, True), (64, 4, 128, False))
# --rings: deeper rings of 64 heads per program with dS in registers (64 x 3: 224 KiB).
RINGS = (NARROW, (64, 3, 64, False), (32, 4, 64, False), (32, 6, 64, False))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _dq_cfg(v: tuple) -> KernelConfig:
    return KernelConfig(impl="sm90", block_k=v[0], num_stages=v[1], block_h=v[2])


def _name(v: tuple) -> str:
    return f"{v[2]} heads/program, {v[0]} slots x {v[1]} tiles, dS {'in the ring' if v[3] else 'in registers'}"


def _dq_alone(rows: list[dict], shape: str, kv, idx, length, heads: int, flops_dq: float, variants) -> None:
    from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sparse_mla_bwd_sm90_kernel_dq

    total, k_slots = idx.shape
    gen = torch.Generator(device=kv.device).manual_seed(1)
    ds = (torch.randn((total, heads, k_slots), generator=gen, device=kv.device) * 0.05).to(kv.dtype)
    kv2d = kv.view(kv.shape[0], -1)
    ref = None
    for v in variants:
        dq = torch.full((total, heads, D_QK), float("nan"), dtype=kv.dtype, device=kv.device)
        programs = triton.cdiv(heads, v[2]) * (v[2] // 64)

        def launch(dq=dq, v=v, programs=programs):
            sparse_mla_bwd_sm90_kernel_dq[(total * programs,)](
                kv2d, idx, length, ds, dq, 0, kv.shape[0], k_slots, H=heads, D_V=D_V, D_R=D_QK - D_V, HAS_LEN=True,
                BLOCK_K=v[0], NUM_BUF=v[1], HEADS=v[2], DS_SMEM=v[3], num_warps=8,
            )  # fmt: skip

        launch()
        torch.cuda.synchronize()
        ref = dq.clone() if v == NARROW else ref
        ms = bench(launch)
        row = dict(part="dq kernel", shape=shape, variant=_name(v),
                   ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops_dq / ms[0] / 1e9, dq_rel=_rel(dq, ref),
                   finite=bool(torch.isfinite(dq).all()))  # fmt: skip
        print(row, flush=True)
        rows.append(row)


def _case(rows: list[dict], total: int, heads: int, topk: int, budgets: tuple[int, ...], rings: bool = False
          ) -> None:  # fmt: skip
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    valid = int(length.sum())
    flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
    shape = f"T={total} H={heads} K={topk} 1doc"
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    variants = RINGS if rings else VARIANTS_128 if heads % 128 == 0 else VARIANTS_64
    _dq_alone(rows, shape, kv, idx, length, heads, 2 * valid * heads * D_QK, variants)
    default_ring = bwd_plan.SM90_DQ_DS_SMEM
    bwd_plan.SM90_DQ_DS_SMEM = False
    ref = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=(None, _dq_cfg(NARROW), None))
    bwd_plan.SM90_DQ_DS_SMEM = default_ring
    for v in variants:
        cfgs = (None, _dq_cfg(v), None)
        row = dict(part="backward", shape=shape, variant="dq " + _name(v))
        bwd_plan.SM90_DQ_DS_SMEM = v[3]
        try:
            dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs)
            ms = bench(lambda cfgs=cfgs: run_bwd(q, kv, out, dout, lse, idx, length, cfgs=cfgs), rep_ms=300)
            row.update(ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, dq_rel=_rel(dq, ref[0]),
                       dkv_rel=_rel(dkv, ref[1]))  # fmt: skip
        except Exception as exc:  # a variant that fails is a row, not a stop
            row.update(note=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            bwd_plan.SM90_DQ_DS_SMEM = default_ring
        print(row, flush=True)
        rows.append(row)
    default_budget = smb.PDS_SCRATCH_BYTES
    for budget in budgets:
        smb.PDS_SCRATCH_BYTES = budget
        try:
            ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length), rep_ms=300)
        finally:
            smb.PDS_SCRATCH_BYTES = default_budget
        chunk = max(1, budget // (4 * heads * topk))
        row = dict(part="chunk", shape=shape, variant=f"defaults, PDS_SCRATCH_BYTES {budget >> 20} MiB (about {chunk} "
                   f"rows per chunk, {triton.cdiv(total, chunk)} chunks)", ms=ms[0], p20=ms[1], p80=ms[2],
                   tflops=flops / ms[0] / 1e9)  # fmt: skip
        print(row, flush=True)
        rows.append(row)


def _deterministic(rows: list[dict], chunk_rows: tuple[int, ...], total: int = 4096, heads: int = 64,
                   topk: int = 2048) -> None:  # fmt: skip
    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    flops = 2 * int(length.sum()) * heads * (3 * D_QK + 2 * D_V)
    q, kv = mla_inputs(total, heads, dev)
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length), rep_ms=200)
    rows.append(dict(part="deterministic", shape=f"T={total} H={heads} K={topk} 1doc", variant="atomic (default)",
                     ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9))  # fmt: skip
    print(rows[-1], flush=True)
    default = smb.DETERMINISTIC_SCRATCH_ELEMENTS
    for r in chunk_rows:
        smb.DETERMINISTIC_SCRATCH_ELEMENTS = r * topk * D_QK if r else default
        try:
            a = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=True)
            b = run_bwd(q, kv, out, dout, lse, idx, length, deterministic=True)
            ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length, deterministic=True), rep_ms=200)
        finally:
            smb.DETERMINISTIC_SCRATCH_ELEMENTS = default
        rows_now = (r * topk * D_QK if r else default) // (topk * D_QK)
        rows.append(dict(part="deterministic", shape=f"T={total} H={heads} K={topk} 1doc",
                         variant=f"deterministic, {rows_now}-row chunks ({rows_now * topk * D_QK * 4 >> 20} MiB)",
                         ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9,
                         repeat_equal=bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))))  # fmt: skip
        print(rows[-1], flush=True)


def _staged_case(rows: list[dict], total: int, heads: int, topk: int, rounds: int = 2) -> None:
    """dq stored through the ring (``SM90_DQ_STAGED_STORE``) against straight from the accumulator (the dq kernel
    alone, 64 x 2, dS in registers), and the whole backward at the defaults with each store path of dq and of dS
    (``sparse_mla_bwd_sm90_ws.WS_BWD_STAGED_DS``), alternating."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws
    from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sparse_mla_bwd_sm90_kernel_dq

    dev = torch.device("cuda")
    idx, length, _, _ = causal_index_sets([total], topk, dev)
    valid = int(length.sum())
    shape = f"T={total} H={heads} K={topk} 1doc"
    q, kv = mla_inputs(total, heads, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    ds = (torch.randn((total, heads, topk), generator=gen, device=dev) * 0.05).to(kv.dtype)
    grid = (total * triton.cdiv(heads, 64),)
    meta = dict(H=heads, D_V=D_V, D_R=D_QK - D_V, HAS_LEN=True, BLOCK_K=64, NUM_BUF=2, HEADS=64, DS_SMEM=False,
                num_warps=8)  # fmt: skip
    out, lse = run_fwd(q, kv, idx, length, None)
    dout = torch.randn_like(out)
    flops = 2 * valid * heads * (3 * D_QK + 2 * D_V)
    first = {}
    saved = (bwd_plan.SM90_DQ_STAGED_STORE, ws.WS_BWD_STAGED_DS)
    for rnd in range(rounds):
        for staged in (False, True):
            dq = torch.full((total, heads, D_QK), float("nan"), dtype=kv.dtype, device=dev)

            def launch(dq=dq, staged=staged):
                sparse_mla_bwd_sm90_kernel_dq[grid](kv.view(kv.shape[0], -1), idx, length, ds, dq, 0, kv.shape[0],
                                                    topk, **meta, STAGED_STORE=staged)  # fmt: skip

            launch()
            torch.cuda.synchronize()
            first.setdefault("dq", dq)
            ms = bench(launch)
            rows.append(dict(part="dq kernel", shape=shape, variant=f"staged store {staged}, round {rnd + 1}", ms=ms[0],
                             p20=ms[1], p80=ms[2], tflops=2 * valid * heads * D_QK / ms[0] / 1e9,
                             finite=bool(torch.isfinite(dq).all()), dq_rel=_rel(dq, first["dq"])))  # fmt: skip
            print(rows[-1], flush=True)
        for dq_staged, ds_staged in ((False, False), (True, False), (True, True)):
            bwd_plan.SM90_DQ_STAGED_STORE, ws.WS_BWD_STAGED_DS = dq_staged, ds_staged
            try:
                dqb, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length)
                first.setdefault("bwd", (dqb, dkv))
                ms = bench(lambda: run_bwd(q, kv, out, dout, lse, idx, length), rep_ms=300)
            finally:
                bwd_plan.SM90_DQ_STAGED_STORE, ws.WS_BWD_STAGED_DS = saved
            rows.append(dict(part="backward", shape=shape, ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9,
                             variant=f"defaults, dq staged {dq_staged}, dS staged {ds_staged}, round {rnd + 1}",
                             dq_rel=_rel(dqb, first["bwd"][0]), dkv_rel=_rel(dkv, first["bwd"][1])))  # fmt: skip
            print(rows[-1], flush=True)


def memcheck() -> None:
    """Small backwards for compute-sanitizer: the defaults (dq and dS stored through shared memory) and both stores
    straight from the accumulators, forced dq rings (128 heads per program, 32 x 4), H = 64, 96, 128, with and
    without lengths, invalid and out-of-range slots, deterministic mode."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

    dev = torch.device("cuda")
    total, topk = 300, 256
    for heads in (64, 96, 128):
        q, kv, idx, length, out, lse, dout = small_bwd_case(total, topk, heads, dev)
        rings = [(None, None, None), (None, KernelConfig(impl="sm90", block_k=32, num_stages=4), None)]
        if heads % 128 == 0:
            rings.append((None, KernelConfig(impl="sm90", block_k=64, num_stages=2, block_h=128), None))
        for staged in (True, False):
            bwd_plan.SM90_DQ_STAGED_STORE = ws.WS_BWD_STAGED_DS = staged
            try:
                for with_len in (True, False):
                    for cfgs in rings:
                        for det in (False, True):
                            dq, dkv, _ = run_bwd(q, kv, out, dout, lse, idx, length if with_len else None, cfgs=cfgs,
                                                 deterministic=det)  # fmt: skip
                            torch.cuda.synchronize()
                            print("memcheck case", heads, staged, with_len, cfgs[1] is not None, det,
                                  bool(dq.isfinite().all() and dkv.isfinite().all()), flush=True)  # fmt: skip
            finally:
                bwd_plan.SM90_DQ_STAGED_STORE = ws.WS_BWD_STAGED_DS = True


def main(out_dir: Path, quick: bool, rings: bool, staged: bool = False) -> None:
    rows: list[dict] = []
    budgets = (1 << 29, 1 << 30, 1 << 31)
    if staged:
        for total, heads, topk in ((4096, 128, 512), (16384, 64, 2048), (4096, 64, 2048), (16384, 128, 2048)):
            _staged_case(rows, total, heads, topk)
        _write(rows, out_dir)
        return
    if rings:
        for total, heads, topk in ((4096, 128, 512), (16384, 64, 2048), (4096, 64, 2048), (16384, 128, 2048)):
            _case(rows, total, heads, topk, (), rings=True)
        _write(rows, out_dir)
        return
    _case(rows, 4096, 128, 512, budgets)
    _case(rows, 16384, 128, 2048, budgets if not quick else (1 << 29,))
    _case(rows, 4096, 64, 2048, budgets)
    _case(rows, 16384, 64, 2048, budgets if not quick else (1 << 29,))
    _deterministic(rows, (0, 132, 264, 396))
    _write(rows, out_dir)


def _write(rows: list[dict], out_dir: Path) -> None:
    write_report(
        "dsa_bwd_dq", rows, ["part", "shape", "variant", "ms", "p20", "p80", "tflops", "dq_rel", "dkv_rel", "finite",
                             "repeat_equal", "note"],
        "Sparse MLA backward (bf16, one document, query t selects min(t+1, K) random causal keys). dq kernel: FLOPs "
        "2 * valid * H * 576; backward: 2 * valid * H * (3 * 576 + 2 * 512), the whole backward (preprocess, "
        "probabilities + dkv, dq). triton.testing.do_bench median with 20th/80th percentiles. dq_rel / dkv_rel: "
        "largest difference from the 64-heads-per-program dq kernel's run, relative to its largest element. chunk: "
        "PDS_SCRATCH_BYTES sets rows per chunk as budget / (4 H K). repeat_equal: a second run equal bit for bit. "
        f"Reproduce: `python benchmarks/dsa_bwd_dq.py {reproduce_args()}`.",
        out_dir=out_dir, title="Sparse MLA backward: the SM90 dq kernel's heads per program, row chunks",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help="one chunk budget at T = 16384")
    parser.add_argument("--rings", action="store_true", help="only deeper rings of the dq kernel, four shapes")
    parser.add_argument("--staged-store", action="store_true", help="only dq stored through the ring, four shapes")
    parser.add_argument("--memcheck", action="store_true", help="small backwards for compute-sanitizer, no report")
    args = parser.parse_args()
    if args.memcheck:
        memcheck()
    else:
        main(args.out_dir, args.quick, args.rings, args.staged_store)
