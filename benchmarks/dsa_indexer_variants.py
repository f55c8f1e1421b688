"""Where the fused indexer's time goes, and candidate structures of its scoring kernel (CUDA; an experiment).

``python benchmarks/dsa_indexer_variants.py [--out-dir DIR] [--budget-s 380] [--atomics-probe | --defaults-sweep]``
writes ``dsa_indexer_variants_<date>.md``:

- the split of the default indexer (T = 16384 one document and documents U[K, 4K], T = 4096): scores kernel alone
  (every row chunk, the selection skipped) and the selection as the rest; the same scores on FP8 codes
  (``fp8=True``) and the codes' own launch time;
- at T = 16384, one document: the scoring kernel for tile shapes (block_m, block_n, warps, stages) x loop
  structures of its head loop (``mode``: 0 = the library's loop, 1 = two heads per step with both dots before
  their epilogues, 2 = software pipelined: the next head's dot before this head's epilogue, 3 = the head weights
  loaded once as a tile), each checked to give the default's selection (``same``), and the tile shapes on FP8
  codes (the library's loop);
- the selection kernel's settings (warps, block, sample, candidates) on the default scores;
- ``--defaults-sweep``: per case (T = 16384 one document and documents, 4096, 65536), the whole indexer for each
  (select_sample, select_cand) setting, checked against the whole-row select, and the scoring tiles on bf16 and FP8
  codes: ``dsa_indexer_defaults_sweep_<date>.md``;
- ``--sm90-sweep``: per case, the SM90 scoring kernel's tiles against the portable kernel (score scratch bit for
  bit, selection, times): ``dsa_indexer_sm90_<date>.md``;
- ``--atomics-probe``: fp32 scatter throughput into random rows, atomics against plain stores (what bounds the
  sparse MLA backward's dkv kernel), ``dsa_atomics_probe_<date>.md``.

Not shipped: a variant that wins moves into ``longtrain.dsa.triton.indexer_topk`` with its tests.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, write_report  # noqa: E402
from longtrain.bench_suites.dsa import TOPK, bench, causal_index_sets, doc_lengths, indexer_inputs  # noqa: E402
from longtrain.dsa.triton import indexer_topk as it  # noqa: E402
from longtrain.dsa.triton._common import IndexerConfig, next_pow2  # noqa: E402
from longtrain.dsa.triton.indexer_topk_sm90 import indexer_topk_fwd_sm90_scores  # noqa: E402


@triton.jit(do_not_specialize=["row_begin", "row_end", "T_k", "topk", "scratch_stride"])
def scores_v(
    q_ptr, k_ptr, w_ptr, starts_ptr, lens_ptr, scratch_ptr,
    row_begin, row_end, T_k, topk, scratch_stride,
    H_I: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    rows, row_ok, st, ln, need, offs_n, busy = it._score_tile(
        starts_ptr, lens_ptr, row_begin, row_end, T_k, topk, BLOCK_M, BLOCK_N
    )
    if busy:
        offs_d = tl.arange(0, BLOCK_D)
        k_mask = (offs_n < T_k)[:, None]
        q_mask = row_ok[:, None]
        keys = tl.load(k_ptr + offs_n.to(tl.int64)[:, None] * D_I + offs_d[None, :], mask=k_mask, other=0.0)
        keys_t = tl.trans(keys)
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * (H_I * D_I) + offs_d[None, :]
        w_rows = w_ptr + rows.to(tl.int64) * H_I
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if MODE == 1:  # two heads per step: two independent dots before their epilogues
            for h in range(0, H_I, 2):
                qa = tl.load(q_rows + h * D_I, mask=q_mask, other=0.0)
                qb_ = tl.load(q_rows + (h + 1) * D_I, mask=q_mask, other=0.0)
                wa = tl.load(w_rows + h, mask=row_ok, other=0.0)
                wb = tl.load(w_rows + h + 1, mask=row_ok, other=0.0)
                la = tl.dot(qa, keys_t, input_precision=DOT_PREC)
                lb = tl.dot(qb_, keys_t, input_precision=DOT_PREC)
                acc += tl.maximum(la, 0.0) * wa[:, None]
                acc += tl.maximum(lb, 0.0) * wb[:, None]
        elif MODE == 2:  # software pipelined: the next head's dot before this head's epilogue
            q0 = tl.load(q_rows, mask=q_mask, other=0.0)
            cur = tl.dot(q0, keys_t, input_precision=DOT_PREC)
            w_c = tl.load(w_rows, mask=row_ok, other=0.0)
            for h in range(1, H_I):
                qn = tl.load(q_rows + h * D_I, mask=q_mask, other=0.0)
                nxt = tl.dot(qn, keys_t, input_precision=DOT_PREC)
                acc += tl.maximum(cur, 0.0) * w_c[:, None]
                w_c = tl.load(w_rows + h, mask=row_ok, other=0.0)
                cur = nxt
            acc += tl.maximum(cur, 0.0) * w_c[:, None]
        elif MODE == 3:  # weights as one [BLOCK_M, H_I] tile loaded once
            offs_hh = tl.arange(0, H_I)
            w_all = tl.load(w_rows[:, None] + offs_hh[None, :], mask=row_ok[:, None], other=0.0)
            for h in tl.static_range(H_I):
                q_h = tl.load(q_rows + h * D_I, mask=q_mask, other=0.0)
                logits = tl.dot(q_h, keys_t, input_precision=DOT_PREC)
                w_h = tl.sum(tl.where(offs_hh[None, :] == h, w_all, 0.0), 1)
                acc += tl.maximum(logits, 0.0) * w_h[:, None]
        else:
            for h in range(H_I):
                q_h = tl.load(q_rows + h * D_I, mask=q_mask, other=0.0)
                w_h = tl.load(w_rows + h, mask=row_ok, other=0.0)
                logits = tl.dot(q_h, keys_t, input_precision=DOT_PREC)
                acc += tl.maximum(logits, 0.0) * w_h[:, None]
        it._store_score_keys(acc, scratch_ptr, rows, row_begin, offs_n, st, ln, need, scratch_stride)


def run(iq, ik, iw, starts, causal, cfg, mode=None, do_scores=True, do_select=True, out=None, k_scale=None):
    """indexer_topk_fwd with a scores variant (mode None = the library kernel; with ``k_scale``, on FP8 codes);
    returns the selection."""
    nq, nh, hd = iq.shape
    nk = ik.shape[0]
    if out is None:
        out = torch.empty((nq, TOPK), dtype=torch.int32, device=iq.device)
    chunk = it._chunk_rows(nq, nk, TOPK, cfg)
    key = (chunk, nk)
    if key not in run.cache:
        run.cache[key] = torch.empty((chunk, nk), dtype=torch.int32, device=iq.device)
    scratch = run.cache[key]
    sample, cand_n = cfg.resolved_select(nk)
    ck = (chunk, cand_n)
    if ck not in run.cache:
        run.cache[ck] = torch.empty((chunk, cand_n), dtype=torch.int32, device=iq.device)
    cand = run.cache[ck] if sample > 0 else scratch
    n_kb = triton.cdiv(nk, cfg.block_n)
    for row0 in range(0, nq, chunk):
        row1 = min(nq, row0 + chunk)
        grid = (triton.cdiv(row1 - row0, cfg.block_m) * n_kb,)
        if do_scores:
            args = (iq, ik, iw, starts, causal, scratch, row0, row1, nk, TOPK, scratch.stride(0))
            meta = dict(
                H_I=nh,
                D_I=hd,
                BLOCK_D=next_pow2(hd),
                DOT_PREC="tf32",
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
            if mode == "sm90_fp8":  # the SM90 kernel on FP8 codes (not routed by the library yet)
                indexer_topk_fwd_sm90_scores(iq, ik, iw, k_scale, starts, causal, scratch, row0, row1, TOPK, cfg)
            elif mode is None:  # the library's launch: the kernel cfg.scores_impl routes to
                it.indexer_topk_fwd_scores(iq, ik, iw, k_scale, starts, causal, scratch, row0, row1, TOPK, cfg)
            else:
                scores_v[grid](*args, **meta, MODE=mode)
        if do_select:
            it.indexer_topk_fwd_kernel_select[(row1 - row0,)](
                scratch,
                starts,
                causal,
                out,
                cand,
                row0,
                nk,
                TOPK,
                scratch.stride(0),
                BLOCK=cfg.select_block,
                SAMPLE=sample,
                CAND=cand_n,
                num_warps=cfg.select_warps,
            )
    return out


run.cache = {}


_SCORE_TILES = ((64, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 256, 8, 2), (128, 256, 8, 2),
                (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 2), (256, 128, 8, 2))  # fmt: skip
_SELECTS = ((8, 2048, None, None), (4, 2048, None, None), (16, 2048, None, None), (8, 1024, None, None),
            (8, 4096, None, None), (4, 1024, None, None), (8, 2048, 256, 2048), (8, 2048, 1024, 2048),
            (16, 4096, 1024, 2048))  # fmt: skip


def _case(total: int, layout: str, deadline: float, rows: list, sweep: bool, device: str = "cuda") -> None:
    """One input case: the default's split (scores, select, FP8), and with ``sweep`` every variant."""
    dev = torch.device(device)
    _, _, starts, causal = causal_index_sets(doc_lengths(total, layout, TOPK), TOPK, dev)
    iq, ik, iw = indexer_inputs(total, dev)
    flops = 2 * 32 * 128 * int(causal.to(torch.int64).sum())

    def call(cfg, mode=None, do_select=True):
        return run(iq, ik, iw, starts, causal, cfg, mode=mode, do_select=do_select)

    def add(**r):
        r.update(T=total, layout=layout)
        print(r, flush=True)
        rows.append(r)

    base = IndexerConfig()
    ref = call(base).clone()
    t_all = bench(lambda: call(base))[0]
    t_sc = bench(lambda: call(base, do_select=False))[0]
    add(what="default: scores + select", ms=t_all)
    add(what="default: scores only", ms=t_sc, tflops=flops / t_sc / 1e9)
    add(what="default: select (the difference)", ms=t_all - t_sc)
    q8, k8, w8, ks = it.indexer_fp8_operands_triton(iq, ik, iw)

    def call8(cfg, do_select=True):
        return run(q8, k8, w8, starts, causal, cfg, do_select=do_select, k_scale=ks)

    t8 = bench(lambda: call8(base, do_select=False))[0]
    add(what="default, FP8 codes: scores only", ms=t8, tflops=flops / t8 / 1e9)
    t8q = bench(lambda: it.indexer_fp8_operands_triton(iq, ik, iw))[0]
    add(what="FP8 codes of q and k (indexer_fp8_operands_triton)", ms=t8q)
    if not sweep:
        return

    def variant(what, name, mode, timed, check=None, note=None):
        """Time one variant (``check``: its selection against the default's); a failure is a row, not a crash."""
        try:
            same = None if check is None else bool(torch.equal(check(), ref))
            ms = bench(timed)[0]
            tflops = flops / ms / 1e9 if what.startswith("scores") else None
            add(what=what, cfg=name, mode=mode, ms=ms, tflops=tflops, same=same, note=note)
        except Exception as exc:  # a variant that does not compile is a row, not a crash
            add(what=what, cfg=name, mode=mode, note=f"{type(exc).__name__}: {str(exc)[:160]}")

    for bm, bn, w, st in _SCORE_TILES:
        if time.time() > deadline:
            return
        cfg = IndexerConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, scores_impl="triton")
        variant("scores variant, FP8 codes", f"{bm}x{bn} w{w} s{st}", 0, lambda cfg=cfg: call8(cfg, False))
    for bm, bn, w, st in _SCORE_TILES:
        for mode in (0, 1, 2, 3):
            if time.time() > deadline:
                return
            cfg = IndexerConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, scores_impl="triton")
            variant("scores variant", f"{bm}x{bn} w{w} s{st}", mode,
                    lambda cfg=cfg, mode=mode: call(cfg, mode, do_select=False),
                    check=lambda cfg=cfg, mode=mode: call(cfg, mode))  # fmt: skip
    for sw, sb, samp, cand in _SELECTS:
        if time.time() > deadline:
            return
        cfg = IndexerConfig(select_warps=sw, select_block=sb, select_sample=samp, select_cand=cand)
        variant("select variant (scores + select)", f"warps {sw} block {sb} sample {samp} cand {cand}", None,
                lambda cfg=cfg: call(cfg), check=lambda cfg=cfg: call(cfg),
                note=f"the default's scores alone: {t_sc:.3f} ms")  # fmt: skip


def main(out_dir: Path, budget_s: float) -> None:
    deadline = time.time() + budget_s
    rows: list = []
    for total, layout in ((16384, "1doc"), (16384, "docs"), (4096, "1doc")):
        _case(total, layout, deadline, rows, sweep=(total, layout) == (16384, "1doc"))
    write_report("dsa_indexer_variants", rows, ["T", "layout", "what", "cfg", "mode", "ms", "tflops", "same", "note"],
                 "Timing: triton.testing.do_bench median, L2 flushed. tflops = 2 H_I D_I per causal pair over the "
                 "scores time. Reproduce: `python benchmarks/dsa_indexer_variants.py`.", out_dir=out_dir,
                 title="Fused indexer: scores / select split and scoring-kernel variants")  # fmt: skip


# (select_sample, select_cand, select_warps, select_block) and (block_m, block_n, num_warps, num_stages, mode).
_SWEEP_SELECTS = ((512, 4096, 8, 2048), (512, 4096, 4, 2048), (512, 4096, 16, 2048), (512, 4096, 8, 4096),
                  (512, 4096, 8, 1024), (1024, 4096, 8, 2048), (1024, 4096, 4, 2048), (256, 4096, 8, 2048))  # fmt: skip
_SWEEP_TILES = ((64, 128, 8, 3, 0), (64, 128, 4, 3, 0), (64, 128, 4, 3, 1), (64, 128, 4, 3, 2), (64, 128, 4, 4, 0),
                (64, 128, 4, 2, 0), (128, 128, 8, 3, 1), (64, 64, 4, 4, 0))  # fmt: skip
_SWEEP_CASES = ((16384, "1doc"), (16384, "docs"), (4096, "1doc"), (65536, "1doc"))


def _sweep_case(total: int, layout: str, rows: list, device: str = "cuda") -> None:
    """The settings the defaults are picked from, on one case: the whole indexer per (select_sample, select_cand),
    each checked against the whole-row radix select, and the scoring kernel's tiles on bf16 and FP8 codes."""
    dev = torch.device(device)
    _, _, starts, causal = causal_index_sets(doc_lengths(total, layout, TOPK), TOPK, dev)
    iq, ik, iw = indexer_inputs(total, dev)
    flops = 2 * 32 * 128 * int(causal.to(torch.int64).sum())
    q8, k8, w8, ks = it.indexer_fp8_operands_triton(iq, ik, iw)

    def add(**r):
        r.update(T=total, layout=layout)
        print(r, flush=True)
        rows.append(r)

    whole_cfg = IndexerConfig(select_sample=0)
    whole = run(iq, ik, iw, starts, causal, whole_cfg).clone()
    add(what="scores + whole-row select", cfg="select_sample 0", ms=bench(lambda: run(iq, ik, iw, starts, causal,
                                                                                  whole_cfg))[0])  # fmt: skip
    for sample, cand, warps, block in _SWEEP_SELECTS:
        cfg = IndexerConfig(select_sample=sample, select_cand=cand, select_warps=warps, select_block=block)
        name = f"sample {sample} cand {cand} warps {warps} block {block}"
        try:
            same = bool(torch.equal(run(iq, ik, iw, starts, causal, cfg), whole))
            ms = bench(lambda cfg=cfg: run(iq, ik, iw, starts, causal, cfg))[0]
            add(what="scores + select", cfg=name, ms=ms, same=same)
        except Exception as exc:  # a setting that does not compile is a row, not a crash
            add(what="scores + select", cfg=name, note=f"{type(exc).__name__}: {exc}"[:160])
    for bm, bn, w, st, mode in _SWEEP_TILES:
        cfg = IndexerConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, scores_impl="triton")
        name = f"{bm}x{bn} w{w} s{st}"
        lib = None if mode == 0 else mode  # mode 0: the library kernel itself
        same = bool(torch.equal(run(iq, ik, iw, starts, causal, cfg, mode=lib), whole))
        ms = bench(lambda cfg=cfg, lib=lib: run(iq, ik, iw, starts, causal, cfg, mode=lib, do_select=False))[0]
        add(what="scores only", cfg=name, mode=mode, ms=ms, tflops=flops / ms / 1e9, same=same)
        if mode == 0:
            ms = bench(lambda cfg=cfg: run(q8, k8, w8, starts, causal, cfg, do_select=False, k_scale=ks))[0]
            add(what="scores only, FP8 codes", cfg=name, mode=mode, ms=ms, tflops=flops / ms / 1e9)


def defaults_sweep(out_dir: Path) -> None:
    rows: list = []
    for total, layout in _SWEEP_CASES:
        _sweep_case(total, layout, rows)
    write_report("dsa_indexer_defaults_sweep", rows, ["T", "layout", "what", "cfg", "mode", "ms", "tflops", "same",
                                                      "note"],
                 "Timing: triton.testing.do_bench median, L2 flushed. same = the selection equals the whole-row radix "
                 "select's (select_sample 0). mode: the scoring kernel's head loop (0 = the library's, 1 = two heads "
                 "per step, 2 = software pipelined, as in the variants report). tflops = 2 H_I D_I per causal pair "
                 "over the scores time. Reproduce: `python benchmarks/dsa_indexer_variants.py --defaults-sweep`.",
                 out_dir=out_dir,
                 title="Fused indexer: selection settings and scoring tiles per case")  # fmt: skip


# (sm90_block_n, sm90_num_buf, sm90_group, sm90_loader) of the SM90 scoring kernel, the default first.
_SM90_TILES = ((256, 5, 8, "auto"), (256, 5, 8, "tma"), (256, 5, 8, "cp_async"), (256, 5, 16, "cp_async"),
               (256, 5, 16, "tma"), (256, 4, 16, "tma"), (256, 6, 16, "tma"), (128, 6, 16, "tma"))  # fmt: skip


def _sm90_case(total: int, layout: str, rows: list, device: str = "cuda") -> None:
    """The SM90 scoring kernel's tiles on one case against the portable kernel: the score scratch of every row chunk
    bit for bit (``same``: both written into a sentinel-filled scratch), the selection, scores-only and whole times."""
    dev = torch.device(device)
    _, _, starts, causal = causal_index_sets(doc_lengths(total, layout, TOPK), TOPK, dev)
    iq, ik, iw = indexer_inputs(total, dev)
    flops = 2 * 32 * 128 * int(causal.to(torch.int64).sum())
    nq, nk = iq.shape[0], ik.shape[0]

    def add(**r):
        r.update(T=total, layout=layout)
        print(r, flush=True)
        rows.append(r)

    def scratch_of(cfg):
        """Every chunk's scratch, sentinel-filled before scoring, concatenated on the host side of the GPU."""
        chunk = it._chunk_rows(nq, nk, TOPK, cfg)
        out = []
        for row0 in range(0, nq, chunk):
            row1 = min(nq, row0 + chunk)
            s = torch.full((chunk, nk), 0x5A5A5A5A, dtype=torch.int32, device=dev)
            it.indexer_topk_fwd_scores(iq, ik, iw, None, starts, causal, s, row0, row1, TOPK, cfg)
            out.append(s[: row1 - row0])
        return torch.cat(out)

    base = IndexerConfig(scores_impl="triton")
    ref_sel = run(iq, ik, iw, starts, causal, base).clone()
    ref_scr = scratch_of(base)
    ms_all = bench(lambda: run(iq, ik, iw, starts, causal, base))[0]
    ms_sc = bench(lambda: run(iq, ik, iw, starts, causal, base, do_select=False))[0]
    add(what="portable scores + select", cfg="64x128 w4 s3", ms=ms_all)
    add(what="portable scores only", cfg="64x128 w4 s3", ms=ms_sc, tflops=flops / ms_sc / 1e9)
    for bn, nb, grp, ld in _SM90_TILES:
        cfg = IndexerConfig(scores_impl="sm90", sm90_block_n=bn, sm90_num_buf=nb, sm90_group=grp, sm90_loader=ld)
        name = f"64x{bn} ring {nb} group {grp} {ld}"
        try:
            same = bool(torch.equal(scratch_of(cfg), ref_scr))
            same_sel = bool(torch.equal(run(iq, ik, iw, starts, causal, cfg), ref_sel))
            ms_all = bench(lambda cfg=cfg: run(iq, ik, iw, starts, causal, cfg))[0]
            ms_sc = bench(lambda cfg=cfg: run(iq, ik, iw, starts, causal, cfg, do_select=False))[0]
            add(what="SM90 scores + select", cfg=name, ms=ms_all, same=same_sel)
            add(what="SM90 scores only", cfg=name, ms=ms_sc, tflops=flops / ms_sc / 1e9, same=same)
        except Exception as exc:  # a tile that does not compile is a row, not a crash
            add(what="SM90 scores", cfg=name, note=f"{type(exc).__name__}: {exc}"[:160])
    # FP8 codes: the portable kernel (the library's FP8 route today) against the SM90 kernel on the same codes.
    q8, k8, w8, ks = it.indexer_fp8_operands_triton(iq, ik, iw)

    def scratch8(cfg, mode):
        chunk = it._chunk_rows(nq, nk, TOPK, cfg)
        parts = []
        for row0 in range(0, nq, chunk):
            row1 = min(nq, row0 + chunk)
            s = torch.full((chunk, nk), 0x5A5A5A5A, dtype=torch.int32, device=dev)
            if mode == "sm90_fp8":
                indexer_topk_fwd_sm90_scores(q8, k8, w8, ks, starts, causal, s, row0, row1, TOPK, cfg)
            else:
                it.indexer_topk_fwd_scores(q8, k8, w8, ks, starts, causal, s, row0, row1, TOPK, cfg)
            parts.append(s[: row1 - row0])
        return torch.cat(parts)

    ref8_scr = scratch8(base, None)
    ref8_sel = run(q8, k8, w8, starts, causal, base, k_scale=ks).clone()
    ms_all = bench(lambda: run(q8, k8, w8, starts, causal, base, k_scale=ks))[0]
    ms_sc = bench(lambda: run(q8, k8, w8, starts, causal, base, k_scale=ks, do_select=False))[0]
    add(what="FP8 codes, portable scores + select", cfg="64x128 w4 s3", ms=ms_all)
    add(what="FP8 codes, portable scores only", cfg="64x128 w4 s3", ms=ms_sc, tflops=flops / ms_sc / 1e9)
    for bn, nb, grp in ((256, 5, 8), (256, 8, 8), (256, 5, 16)):
        cfg = IndexerConfig(sm90_block_n=bn, sm90_num_buf=nb, sm90_group=grp)
        name = f"64x{bn} ring {nb} group {grp} tma"
        try:
            same = bool(torch.equal(scratch8(cfg, "sm90_fp8"), ref8_scr))
            sel = run(q8, k8, w8, starts, causal, cfg, mode="sm90_fp8", k_scale=ks)
            same_sel = bool(torch.equal(sel, ref8_sel))
            ms_all = bench(lambda cfg=cfg: run(q8, k8, w8, starts, causal, cfg, mode="sm90_fp8", k_scale=ks))[0]
            ms_sc = bench(lambda cfg=cfg: run(q8, k8, w8, starts, causal, cfg, mode="sm90_fp8", k_scale=ks,
                                              do_select=False))[0]  # fmt: skip
            add(what="FP8 codes, SM90 scores + select", cfg=name, ms=ms_all, same=same_sel)
            add(what="FP8 codes, SM90 scores only", cfg=name, ms=ms_sc, tflops=flops / ms_sc / 1e9, same=same)
        except Exception as exc:  # a tile that does not compile is a row, not a crash
            add(what="FP8 codes, SM90 scores", cfg=name, note=f"{type(exc).__name__}: {exc}"[:160])
    del ref_scr, ref8_scr
    torch.cuda.empty_cache()


def sm90_sweep(out_dir: Path) -> None:
    rows: list = []
    for total, layout in _SWEEP_CASES:
        _sm90_case(total, layout, rows)
    note = (
        "Timing: triton.testing.do_bench median, L2 flushed. same: for scores, every row chunk's score scratch equals "
        "the portable kernel's bit for bit (sentinel-filled, so the written set is equal too); for scores + select, "
        "the selection equals the portable kernel's. tflops = 2 H_I D_I per causal pair over the scores time. "
        "Reproduce: `python benchmarks/dsa_indexer_variants.py --sm90-sweep`."
    )
    title = "Fused indexer: the SM90 scoring kernel against the portable one"
    write_report(
        "dsa_indexer_sm90", rows, ["T", "layout", "what", "cfg", "ms", "tflops", "same", "note"], note, out_dir=out_dir,
        title=title,
    )  # fmt: skip


@triton.jit
def scatter_k(
    src_ptr, rows_ptr, dst_ptr, D: tl.constexpr, BLOCK_K: tl.constexpr, VC: tl.constexpr, ATOMIC: tl.constexpr
):
    pid = tl.program_id(0)
    offs_k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    r = tl.load(rows_ptr + offs_k).to(tl.int64)
    for c in tl.static_range(D // VC):
        offs = c * VC + tl.arange(0, VC)
        v = tl.load(src_ptr + offs_k.to(tl.int64)[:, None] * D + offs[None, :])
        ptrs = dst_ptr + r[:, None] * D + offs[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, v, sem="relaxed")
        else:
            tl.store(ptrs, v)


def _probe(n_items: int, rows: list) -> None:
    dev = torch.device("cuda")
    n_keys, d = 16384, 576
    src = torch.randn(n_items, d, device=dev)
    dst_rows = torch.randint(0, n_keys, (n_items,), device=dev, dtype=torch.int32)
    dst = torch.zeros(n_keys, d, device=dev)
    for atomic in (1, 0):
        for bk, vc, w in ((64, 64, 4), (64, 64, 8), (64, 32, 4), (32, 64, 4), (128, 64, 8)):

            def fn(bk=bk, vc=vc, w=w, atomic=atomic):
                scatter_k[(n_items // bk,)](src, dst_rows, dst, D=d, BLOCK_K=bk, VC=vc, ATOMIC=atomic, num_warps=w)

            ms = bench(fn)[0]
            r = dict(items=n_items, atomic=atomic, block_k=bk, vc=vc, warps=w, ms=ms, GBps=n_items * d * 4 / ms / 1e6)
            print(r, flush=True)
            rows.append(r)


def atomics_probe(out_dir: Path) -> None:
    """fp32 scatter throughput into random rows: atomics vs plain stores (what bounds the dkv kernel)."""
    rows: list = []
    for n_items in (1 << 20, 1 << 22):
        _probe(n_items, rows)
    write_report("dsa_atomics_probe", rows, ["items", "atomic", "block_k", "vc", "warps", "ms", "GBps"],
                 "Rows of 576 fp32 scattered into 16384 random key rows (1 = tl.atomic_add relaxed, 0 = tl.store). "
                 "Reproduce: `python benchmarks/dsa_indexer_variants.py --atomics-probe`.", out_dir=out_dir,
                 title="fp32 scatter into random rows: atomics vs stores")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--budget-s", type=float, default=380.0, help="stop adding variants after this long")
    parser.add_argument("--atomics-probe", action="store_true")
    parser.add_argument("--defaults-sweep", action="store_true", help="the settings the defaults are picked from")
    parser.add_argument("--sm90-sweep", action="store_true", help="the SM90 scoring kernel against the portable one")
    args = parser.parse_args()
    if args.sm90_sweep:
        sm90_sweep(args.out_dir)
    elif args.atomics_probe:
        atomics_probe(args.out_dir)
    elif args.defaults_sweep:
        defaults_sweep(args.out_dir)
    else:
        main(args.out_dir, args.budget_s)
