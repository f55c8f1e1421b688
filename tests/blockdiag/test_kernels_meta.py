"""Segmentation, the per-step precompute, packed-layout validation and the metadata guard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import kernels
from tests.blockdiag._kernels_util import brute_segments, ids_from_lengths


def _cu(lengths):
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def test_worked_case_straddle():
    ids = torch.tensor([1] * 6 + [2] * 5 + [0])
    seg = kernels._varlen_seg_for_rank(ids, 4, 4, "cpu")
    assert seg["n_real"] == 4 and seg["s_first"] == 0 and seg["real_end"] == 8
    assert seg["cu_q"].tolist() == [0, 2, 4] and seg["cu_k"].tolist() == [0, 6, 8]
    assert seg["first_q"] == 2 and seg["first_k"] == 6
    assert seg["max_q"] == 2 and seg["max_k"] == 6 and seg["max_tail"] == 2
    assert seg["cu_q"].dtype == torch.int32 and seg["cu_k"].dtype == torch.int32


def test_worked_case_all_padding_sentinels():
    ids = torch.tensor([1] * 6 + [2] * 5 + [0])
    assert kernels._varlen_seg_for_rank(ids, 11, 1, "cpu") is None
    assert kernels.precompute_blockdiag_varlen_meta(ids, 11, 1, "cpu") == {"n_real": 0}


def test_precompute_uses_row_zero_and_moves_offsets_to_device():
    ids = torch.stack([ids_from_lengths([3, 5], 0), ids_from_lengths([8], 0)])
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 4, 4, torch.device("cpu"))
    assert meta["cu_q"].tolist() == [0, 4] and meta["cu_k"].tolist() == [0, 5]
    assert meta["cu_q"].device.type == "cpu"


def test_single_document_straddles_every_rank():
    ids = ids_from_lengths([16], 0)
    for rank in range(4):
        meta = kernels.precompute_blockdiag_varlen_meta(ids, 4 * rank, 4, "cpu")
        assert meta["s_first"] == 0 and meta["first_k"] == 4 * rank + 4 and meta["max_tail"] == 0


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    pad=st.integers(0, 12),
    world=st.sampled_from([1, 2, 3, 4]),
)
def test_meta_invariants_property(lengths, pad, world):
    ids = ids_from_lengths(lengths, pad)
    total = ids.numel() - ids.numel() % world
    ids = ids[:total]
    if total == 0:
        return
    local = total // world
    id_list = ids.tolist()
    for rank in range(world):
        off = rank * local
        meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cpu")
        n_real, s_first, seg_q, seg_k = brute_segments(id_list, off, local)
        assert meta["n_real"] == n_real
        if n_real == 0:
            assert meta == {"n_real": 0}
            continue
        assert meta["s_first"] == s_first and meta["real_end"] == off + n_real
        assert meta["cu_q"].tolist() == _cu(seg_q) and meta["cu_k"].tolist() == _cu(seg_k)
        assert meta["max_q"] == max(seg_q) and meta["max_k"] == max(seg_k)
        assert meta["first_q"] == seg_q[0] and meta["first_k"] == seg_k[0]
        assert meta["max_tail"] == max(seg_q[1:], default=0)
        assert kernels._varlen_metadata_unavailable_reason(meta, query_len=local, key_len=total, device="cpu") is None


@pytest.mark.parametrize(
    "ids,match",
    [
        ([0, 0, 1, 1, 2, 2], "padding .* contiguous tail"),  # left padding (P1)
        ([1, 1, 0, 2, 2, 0], "padding .* contiguous tail"),  # padding in the middle (P1)
        ([1, 1, 2, 2, 1, 0], "document id 1 appears in 2 separate runs"),  # id reused (P2)
        ([1, 2, 1, 2, 3, 3], "separate runs"),  # interleaved documents (P2/P3)
        ([1, 1, -1, 0, 0, 0], ">= 0"),
    ],
    ids=["left_pad", "middle_pad", "reused_id", "interleaved", "negative"],
)
def test_precompute_rejects_packed_layout_violations(ids, match):
    with pytest.raises(ValueError, match=match):
        kernels.precompute_blockdiag_varlen_meta(torch.tensor(ids), 0, 3, "cpu")


def test_precompute_rejects_bad_arguments():
    ids = ids_from_lengths([4], 0)
    with pytest.raises(ValueError, match="outside the doc_ids row"):
        kernels.precompute_blockdiag_varlen_meta(ids, 2, 4, "cpu")
    with pytest.raises(TypeError, match="integer"):
        kernels.precompute_blockdiag_varlen_meta(ids.float(), 0, 4, "cpu")
    with pytest.raises(ValueError, match=r"\[B, S\] or \[S\]"):
        kernels.precompute_blockdiag_varlen_meta(ids.view(1, 1, 4), 0, 4, "cpu")


# ---- metadata guard: one case per documented check -------------------------------------------------------


def _valid_meta():
    ids = ids_from_lengths([6, 5], 1)
    return kernels.precompute_blockdiag_varlen_meta(ids, 4, 4, "cpu")  # cu_q [0,2,4], cu_k [0,6,8]


def _reason(meta, query_len=4, key_len=12, device="cpu"):
    return kernels._varlen_metadata_unavailable_reason(meta, query_len=query_len, key_len=key_len, device=device)


def test_guard_accepts_valid_meta_and_caches():
    meta = _valid_meta()
    assert _reason(meta) is None
    assert meta["_validation_cache"], "a validated meta must leave its cache behind"
    assert meta["_validation_snapshot"]["cu_k"] == [0, 6, 8]
    assert _reason(meta) is None  # cache hit
    assert kernels._varlen_metadata_unavailable_reason(meta, 4, 12, "cpu") is None  # positional form


def test_guard_cache_never_reuses_a_verdict_for_another_tensor():
    meta = _valid_meta()
    assert _reason(meta) is None
    for _ in range(50):  # shallow copies share the cache; a freed cu_q's id is often reused by the next tensor
        good = dict(meta, cu_q=torch.tensor([0, 2, 4], dtype=torch.int32))
        assert _reason(good) is None
        del good
        bad = dict(meta, cu_q=torch.tensor([0, 1, 4], dtype=torch.int32))
        assert _reason(bad) is not None
        del bad
    meta["cu_q"][1] = 1  # an in-place change is judged again
    assert _reason(meta) is not None


def test_guard_all_padding_returns_none_without_cache():
    meta = {"n_real": 0}
    assert _reason(meta) is None and "_validation_cache" not in meta


def _mutated(**changes):
    meta = _valid_meta()
    for key, value in changes.items():
        if value is _DROP:
            del meta[key]
        else:
            meta[key] = value
    return meta


_DROP = object()
_I32 = torch.int32


@pytest.mark.parametrize(
    "meta,match",
    [
        (None, "missing varlen metadata"),
        ({"n_real": "x"}, "invalid n_real"),
        ({}, "invalid n_real"),
        ({"n_real": 5}, "n_real=5 is outside query length 4"),
        (_mutated(cu_k=_DROP), "missing varlen metadata fields"),
        (_mutated(max_q="big"), "non-integral"),
        (_mutated(real_end=13), "outside key length"),
        (_mutated(s_first=9), "outside key length"),
        (_mutated(cu_q=[0, 2, 4]), "cu_q is not a tensor"),
        (_mutated(cu_k=torch.tensor([0, 6, 8])), "cu_k must be int32"),
        (_mutated(cu_q=torch.tensor([[0, 2, 4]], dtype=_I32)), "1D tensor"),
        (_mutated(cu_q=torch.tensor([0, 0, 2, 2, 4, 4], dtype=_I32)[::2]), "contiguous"),
        (_mutated(cu_q=torch.tensor([0, 4], dtype=_I32)), "segment counts differ"),
        (_mutated(cu_q=torch.tensor([1, 2, 4], dtype=_I32)), "start at zero"),
        (_mutated(cu_q=torch.tensor([0, 4, 4], dtype=_I32)), "strictly increasing"),
        (_mutated(cu_q=torch.tensor([0, 2, 3], dtype=_I32)), "n_real"),
        (_mutated(cu_k=torch.tensor([0, 6, 7], dtype=_I32)), "slice length"),
        (_mutated(cu_k=torch.tensor([0, 1, 8], dtype=_I32)), "only the first local document"),
        (_mutated(max_q=3), "max_seqlen mismatch"),
        (_mutated(max_k=7), "max_seqlen mismatch"),
        (_mutated(first_k=5), "first segment metadata mismatch"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_guard_rejects_each_malformed_field(meta, match):
    reason = _reason(meta)
    assert reason is not None and __import__("re").search(match, reason), reason
    if isinstance(meta, dict) and "_validation_cache" in meta:
        assert meta["_validation_cache"], "the rejection is cached too"


def test_guard_device_checks_resolve_the_index():
    meta = _valid_meta()
    assert _reason(meta, device="cpu:0") is None
    assert _reason(meta, device=torch.device("cpu")) is None
    reason = _reason(_valid_meta(), device="meta")
    assert reason is not None and "expected meta" in reason


def test_guard_shallow_copy_with_replaced_offsets_is_rechecked():
    meta = _valid_meta()
    assert _reason(meta) is None
    bad = dict(meta)  # shares the validation cache
    bad["cu_q"] = torch.tensor([0, 1, 4], dtype=torch.int32)
    assert "only the first local document" in _reason(bad)
    assert _reason(meta) is None


def test_inline_segmenter_flags_padding_inside_chunk():
    with pytest.raises(ValueError, match="contiguous tail"):
        kernels._varlen_seg_for_rank(torch.tensor([1, 0, 1, 1]), 0, 4, "cpu")
