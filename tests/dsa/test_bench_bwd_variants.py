"""``benchmarks/dsa_bwd_variants.py``: its wider config lists are valid launch configs (the dkv kernel's with value
column groups, the probabilities kernel's with 32 heads per program) that include every candidate of the backward's
autotuner (its timing needs CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_wider_lists_cover_the_autotuner_candidates(monkeypatch):
    from longtrain.dsa.triton import sparse_mla_bwd as mb

    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("dsa_bwd_variants", None)
    import dsa_bwd_variants as variants

    candidates = {"ds": mb._DS_CANDIDATES, "dq": mb._DQ_CANDIDATES, "dkv": mb._DKV_CANDIDATES}
    assert set(variants.WIDER) == set(candidates) == set(variants.KERNELS)
    for name, configs in variants.WIDER.items():
        assert set(candidates[name]) <= set(configs), name
        assert len(set(configs)) == len(configs), name
        for c in configs:
            cfg = variants._cfg(c)
            want = (*c[:3], c[3] if len(c) > 3 else 1, c[4] if len(c) > 4 else 64)
            assert (cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.col_groups, cfg.block_h) == want
