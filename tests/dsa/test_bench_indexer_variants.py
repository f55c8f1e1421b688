"""``benchmarks/dsa_indexer_variants.py``: every scoring-kernel variant it times gives the library's selection
(under the interpreter, on CPU: its timing needs CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from longtrain.dsa.triton import IndexerConfig

pytestmark = pytest.mark.interpret

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CFG = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)


def _harness(monkeypatch, seed):
    """The harness module (K = 16 here) and one causal document of 100 rows: ``(module, q, k, w, starts, causal)``."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("dsa_indexer_variants", None)
    import dsa_indexer_variants as variants

    monkeypatch.setattr(variants, "TOPK", 16)
    variants.run.cache.clear()
    g = torch.Generator().manual_seed(seed)
    T = 100
    q, k, w = torch.randn(T, 4, 32, generator=g), torch.randn(T, 32, generator=g), torch.randn(T, 4, generator=g)
    return variants, q, k, w, torch.zeros(T, dtype=torch.int32), torch.arange(1, T + 1, dtype=torch.int32)


def test_every_scores_variant_selects_what_the_library_kernel_selects(triton_interpret, monkeypatch):
    variants, q, k, w, starts, causal = _harness(monkeypatch, 0)
    ref = variants.run(q, k, w, starts, causal, CFG).clone()  # the library's scoring kernel
    for mode in (0, 1, 2, 3):
        variants.run.cache.clear()
        assert torch.equal(variants.run(q, k, w, starts, causal, CFG, mode=mode), ref), mode


def test_the_fp8_path_of_the_harness_is_the_librarys(triton_interpret, monkeypatch):
    from longtrain.dsa.triton import indexer_topk_triton
    from longtrain.dsa.triton.indexer_topk import indexer_fp8_operands_triton

    variants, q, k, w, starts, causal = _harness(monkeypatch, 1)
    q8, k8, w8, ks = indexer_fp8_operands_triton(q, k, w)
    got = variants.run(q8, k8, w8, starts, causal, CFG, k_scale=ks)
    assert torch.equal(got, indexer_topk_triton(q, k, w, starts, causal, 16, config=CFG, fp8=True))


def test_a_case_runs_every_row_kind(triton_interpret, monkeypatch):
    """The harness's case logic end to end on a small CPU case (its timing stubbed): every row kind appears, every
    scores variant selects what the default selects, nothing fails."""
    variants, *_ = _harness(monkeypatch, 2)
    monkeypatch.setattr(variants, "bench", lambda fn, rep_ms=100: (fn(), (1.0, 1.0, 1.0))[1])
    monkeypatch.setattr(variants, "_SCORE_TILES", ((16, 16, 4, 1),))
    monkeypatch.setattr(variants, "_SELECTS", ((4, 256, None, None),))
    monkeypatch.setattr(variants, "IndexerConfig", lambda **kw: IndexerConfig(**{**CFG.__dict__, **kw}))
    rows = []
    variants._case(64, "1doc", float("inf"), rows, sweep=True, device="cpu")
    kinds = {r["what"] for r in rows}
    assert {"default: scores only", "default, FP8 codes: scores only", "scores variant", "scores variant, FP8 codes",
            "select variant (scores + select)"} <= kinds  # fmt: skip
    assert not [r for r in rows if "Error" in str(r.get("note", ""))], rows
    assert all(r["same"] for r in rows if r["what"] in ("scores variant", "select variant (scores + select)"))


def test_the_defaults_sweep_runs_every_setting(triton_interpret, monkeypatch):
    """``--defaults-sweep``'s case logic on a small CPU case (timing stubbed): every selection setting gives the
    whole-row select's selection, every tile is timed on bf16 and FP8 codes, nothing fails."""
    variants, *_ = _harness(monkeypatch, 3)
    monkeypatch.setattr(variants, "bench", lambda fn, rep_ms=100: (fn(), (1.0, 1.0, 1.0))[1])
    monkeypatch.setattr(variants, "_SWEEP_SELECTS", ((64, 256, 4, 256),))
    monkeypatch.setattr(variants, "_SWEEP_TILES", ((64, 64, 4, 1, 0), (64, 64, 4, 1, 1)))
    big_tiles = {**CFG.__dict__, "block_m": 64, "block_n": 64}  # fewer programs: the interpreter's time
    monkeypatch.setattr(variants, "IndexerConfig", lambda **kw: IndexerConfig(**{**big_tiles, **kw}))
    g = torch.Generator().manual_seed(4)
    small = lambda t, dev: (torch.randn(t, 4, 32, generator=g), torch.randn(t, 32, generator=g),  # noqa: E731
                            torch.randn(t, 4, generator=g))  # fmt: skip
    monkeypatch.setattr(variants, "indexer_inputs", small)
    rows = []
    variants._sweep_case(270, "1doc", rows, device="cpu")  # rows of 257..270 keys take the sampled union
    assert [r["what"] for r in rows] == ["scores + whole-row select", "scores + select", "scores only",
                                         "scores only, FP8 codes", "scores only"]  # fmt: skip
    assert all(r["same"] for r in rows if "same" in r), rows
