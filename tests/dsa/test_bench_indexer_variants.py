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


def test_every_scores_variant_selects_what_the_library_kernel_selects(triton_interpret, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("dsa_indexer_variants", None)
    import dsa_indexer_variants as variants

    monkeypatch.setattr(variants, "TOPK", 16)
    g = torch.Generator().manual_seed(0)
    T = 100
    q, k, w = torch.randn(T, 4, 32, generator=g), torch.randn(T, 32, generator=g), torch.randn(T, 4, generator=g)
    starts = torch.zeros(T, dtype=torch.int32)
    causal = torch.arange(1, T + 1, dtype=torch.int32)
    cfg = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)
    variants.run.cache.clear()
    ref = variants.run(q, k, w, starts, causal, cfg).clone()  # the library's scoring kernel
    for mode in (0, 1, 2, 3):
        variants.run.cache.clear()
        assert torch.equal(variants.run(q, k, w, starts, causal, cfg, mode=mode), ref), mode
