"""Packed THD metadata: worked examples, validation order and exception types, random layouts, no hidden syncs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from longtrain.dsa import cudnn_dsa
from longtrain.dsa.metadata import CudnnDsaPackedMetadata, check_dsa_metadata, prepare_dsa_metadata


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def example_a() -> CudnnDsaPackedMetadata:
    return prepare_dsa_metadata(
        i32([0, 3, 7, 9]), 12, query_indices=torch.arange(2, 10), cu_seqlens_padded=i32([0, 4, 9, 12])
    )


def test_example_a_cp_local_queries_over_padded_documents():
    m = example_a()
    assert m.segment_cu_q.tolist() == [0, 2, 7, 8]
    assert m.segment_cu_k.tolist() == [0, 4, 9, 10]
    assert m.q_causal_offsets.tolist() == [2, 0, 0]
    assert m.key_source_indices.tolist() == list(range(10))
    assert m.starts.tolist() == [0, 0, 4, 4, 4, 4, 4, 9]
    assert m.causal_lengths.tolist() == [3, 0, 1, 2, 3, 4, 0, 1]
    assert m.query_valid.tolist() == [True, False, True, True, True, True, False, True]
    assert m.valid_row_indices.tolist() == [0, 2, 3, 4, 5, 7]
    assert m.all_rows_nonempty is False
    assert (m.max_seqlen_q, m.max_seqlen_k, m.total_key_tokens) == (5, 5, 12)
    for name in ("starts", "causal_lengths", "segment_cu_q", "segment_cu_k", "q_causal_offsets"):
        tensor = getattr(m, name)
        assert tensor.dtype == torch.int32 and tensor.is_contiguous(), name
    assert m.valid_row_indices.dtype == torch.int64 and m.key_source_indices.dtype == torch.int64
    assert m.query_valid.dtype == torch.bool


def test_example_b_absorbed_trailing_padding_uses_the_mask():
    mask = torch.tensor([False] * 5 + [True] * 3)
    m = prepare_dsa_metadata(i32([0, 3, 8]), 8, padding_mask=mask)
    assert m.causal_lengths.tolist() == [1, 2, 3, 1, 2, 0, 0, 0]
    assert m.query_valid.tolist() == [True] * 5 + [False] * 3
    assert m.valid_row_indices.tolist() == [0, 1, 2, 3, 4]
    assert m.all_rows_nonempty is False
    # The model-level topk_length shortcut of the reference note: min(causal_lengths, K).
    assert m.causal_lengths.clamp(max=2048).tolist() == [1, 2, 3, 1, 2, 0, 0, 0]


def test_example_f_padding_rows_are_empty_where_windowed_kernels_give_the_document():
    # A windowed (TileLang-style) layout gives starts [0,0,0,0,4,4,4,4], ends [1,2,2,2,5,6,7,7]. We keep its
    # starts and ends for real rows; padding rows (2, 3, 7) deliberately get no key at all.
    m = prepare_dsa_metadata(i32([0, 2, 5]), 8, cu_seqlens_padded=i32([0, 4, 8]))
    ends = (m.starts + m.causal_lengths).tolist()
    assert m.starts.tolist() == [0, 0, 0, 0, 4, 4, 4, 4]
    windowed_ends = [1, 2, 2, 2, 5, 6, 7, 7]
    for row in (0, 1, 4, 5, 6):
        assert ends[row] == windowed_ends[row]
    assert [m.causal_lengths[r].item() for r in (2, 3, 7)] == [0, 0, 0]
    local = prepare_dsa_metadata(
        i32([0, 2, 5]), 8, query_indices=torch.tensor([4, 5, 6]), cu_seqlens_padded=i32([0, 4, 8])
    )
    assert local.starts.tolist() == [4, 4, 4] and (local.starts + local.causal_lengths).tolist() == [5, 6, 7]


def test_cp1_identity_layout():
    m = prepare_dsa_metadata(i32([0, 2, 5, 6]), 6)
    assert m.segment_cu_q.tolist() == m.segment_cu_k.tolist() == [0, 2, 5, 6]
    assert m.q_causal_offsets.tolist() == [0, 0, 0]
    assert m.key_source_indices is None and m.valid_row_indices is None
    assert m.all_rows_nonempty is True
    assert m.causal_lengths.tolist() == [1, 2, 1, 2, 3, 1]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (3, 3)


def test_max_seqlen_is_checked_against_the_real_maximum():
    cu, padded = i32([0, 3, 7, 9]), i32([0, 4, 9, 12])
    prepare_dsa_metadata(cu, 12, 4, cu_seqlens_padded=padded)
    prepare_dsa_metadata(cu, 12, torch.tensor(4), cu_seqlens_padded=padded)
    with pytest.raises(ValueError, match="max_seqlen=5"):
        prepare_dsa_metadata(cu, 12, 5, cu_seqlens_padded=padded)  # 5 is the padded maximum, not the real one


_CU = i32([0, 3, 7])
_BAD_INPUTS = [
    ("total_bool", dict(total_key_tokens=True), ValueError, "total_key_tokens"),
    ("total_float", dict(total_key_tokens=7.0), ValueError, "total_key_tokens"),
    ("total_zero", dict(total_key_tokens=0), ValueError, "total_key_tokens"),
    ("total_int32_limit", dict(total_key_tokens=2**31 - 1), ValueError, "int32"),
    ("cu_2d", dict(cu_seqlens=_CU[None]), ValueError, "1-D"),
    ("cu_short", dict(cu_seqlens=i32([0])), ValueError, "at least 2"),
    ("cu_int64", dict(cu_seqlens=_CU.long()), TypeError, "int32"),
    ("cu_noncontig", dict(cu_seqlens=i32([0, 9, 3, 9, 7, 9])[::2]), ValueError, "contiguous"),
    ("layout_shape", dict(cu_seqlens_padded=i32([0, 7])), ValueError, "shaped like cu_seqlens"),
    ("layout_int64", dict(cu_seqlens_padded=_CU.long()), TypeError, "int32"),
    ("layout_noncontig", dict(cu_seqlens_padded=i32([0, 9, 3, 9, 7, 9])[::2]), ValueError, "contiguous"),
    ("query_2d", dict(query_indices=torch.arange(3)[None]), ValueError, "query_indices"),
    ("query_empty", dict(query_indices=torch.arange(0)), ValueError, "non-empty"),
    ("query_float", dict(query_indices=torch.arange(3.0)), TypeError, "int32 or int64"),
    ("query_noncontig", dict(query_indices=torch.arange(6)[::2]), ValueError, "contiguous"),
    ("mask_shape", dict(padding_mask=torch.zeros(6, dtype=torch.bool)), ValueError, r"shape \(7,\)"),
    ("mask_dtype", dict(padding_mask=torch.zeros(7, dtype=torch.int32)), ValueError, "bool"),
    ("mask_noncontig", dict(padding_mask=torch.zeros(14, dtype=torch.bool)[::2]), ValueError, "contiguous"),
    ("max_tensor_2", dict(max_seqlen=torch.tensor([4, 4])), ValueError, "scalar"),
    ("max_tensor_float", dict(max_seqlen=torch.tensor(4.0)), ValueError, "scalar"),
    ("max_bool", dict(max_seqlen=True), TypeError, "max_seqlen"),
    ("max_float", dict(max_seqlen=4.0), TypeError, "max_seqlen"),
    ("cu_not_zero", dict(cu_seqlens=i32([1, 3, 7])), ValueError, "start at zero"),
    ("cu_empty_doc", dict(cu_seqlens=i32([0, 3, 3]), total_key_tokens=3), ValueError, "strictly increasing"),
    ("layout_total", dict(total_key_tokens=8), ValueError, "total_key_tokens=8"),
    ("layout_not_increasing", dict(cu_seqlens_padded=i32([0, 7, 7])), ValueError, "cu_seqlens_padded"),
    ("padded_shorter", dict(cu_seqlens_padded=i32([0, 2, 7])), ValueError, "at least as long"),
    ("query_gap", dict(query_indices=torch.tensor([0, 2])), ValueError, "one contiguous increasing interval"),
    ("query_negative", dict(query_indices=torch.tensor([-1, 0])), ValueError, "one contiguous increasing interval"),
    ("query_past_end", dict(query_indices=torch.tensor([6, 7])), ValueError, "one contiguous increasing interval"),
    ("query_decreasing", dict(query_indices=torch.tensor([3, 2])), ValueError, "one contiguous increasing interval"),
    ("max_mismatch", dict(max_seqlen=3), ValueError, "does not match"),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_INPUTS, ids=[b[0] for b in _BAD_INPUTS])
def test_invalid_inputs_raise_the_documented_exception(name, changes, exc, match):
    kwargs = dict(cu_seqlens=_CU, total_key_tokens=7)
    kwargs.update(changes)
    with pytest.raises(exc, match=match):
        prepare_dsa_metadata(**kwargs)


def test_validation_order_total_key_tokens_before_cu_seqlens():
    with pytest.raises(ValueError, match="total_key_tokens"):
        prepare_dsa_metadata(_CU.long(), 0)  # both wrong: the total is reported first
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        prepare_dsa_metadata(_CU.long(), 7, max_seqlen=True)  # cu dtype (4) before max_seqlen type (15)


def _naive(real_lens, pad_lens, first, count, mask):
    """Per-row and per-segment metadata straight from the definitions, in Python."""
    bounds = [0]
    for p in pad_lens:
        bounds.append(bounds[-1] + p)
    rows, segments = [], []
    for t in range(count):
        g = first + t
        doc = max(d for d in range(len(pad_lens)) if bounds[d] <= g)
        start = bounds[doc]
        real_end = start + real_lens[doc]
        valid = g < real_end and not mask[t]
        rows.append((start, min(g + 1, real_end) - start if valid else 0, valid))
        if segments and segments[-1][0] == doc:
            segments[-1][1] += 1
        else:
            segments.append([doc, 1, g])
    seg = [(c, g0 - bounds[d], g0 + c - bounds[d], bounds[d]) for d, c, g0 in segments]
    return bounds, rows, seg


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=5),
    window=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    mask_bits=st.integers(0, 2**40),
    use_mask=st.booleans(),
    tails=st.booleans(),
)
def test_random_layouts_match_the_definitions(docs, window, mask_bits, use_mask, tails):
    real_lens = [r for r, _ in docs]
    pad_lens = [r + p for r, p in docs]
    total = sum(pad_lens)
    first = min(int(window[0] * total), total - 1)
    count = max(1, min(total - first, int(window[1] * total) + 1))
    mask = [bool(mask_bits >> i & 1) and use_mask for i in range(count)]
    cu = i32([0, *torch.tensor(real_lens).cumsum(0).tolist()])
    padded = i32([0, *torch.tensor(pad_lens).cumsum(0).tolist()])
    bounds = [0, *torch.tensor(pad_lens).cumsum(0).tolist()]
    doc_of = [max(d for d in range(len(pad_lens)) if bounds[d] <= first + t) for t in range(count)]
    if tails:  # every marked row's document marked from there on: padding as a tail, always accepted
        mask = [any(mask[u] and doc_of[u] == doc_of[t] for u in range(t + 1)) for t in range(count)]
    bounds, rows, seg = _naive(real_lens, pad_lens, first, count, mask)
    kwargs = dict(
        query_indices=torch.arange(first, first + count, dtype=torch.int32),
        cu_seqlens_padded=padded,
        padding_mask=torch.tensor(mask) if use_mask else None,
    )
    # A marked row followed by a real row of its document would stay that row's key: refused, never built.
    holes = [t for t in range(count - 1) if mask[t] and rows[t + 1][2] and doc_of[t] == doc_of[t + 1]]
    assert not (tails and holes)
    if holes:
        with pytest.raises(ValueError, match=f"marks local row {holes[0]} as padding but row {holes[0] + 1}"):
            prepare_dsa_metadata(cu, total, **kwargs)
        return
    m = prepare_dsa_metadata(cu, total, **kwargs)
    assert m.starts.tolist() == [r[0] for r in rows]
    assert m.causal_lengths.tolist() == [r[1] for r in rows]
    assert m.query_valid.tolist() == [r[2] for r in rows]
    valid_rows = [t for t, r in enumerate(rows) if r[2]]
    assert m.all_rows_nonempty is (len(valid_rows) == count)
    assert (m.valid_row_indices is None) if m.all_rows_nonempty else m.valid_row_indices.tolist() == valid_rows
    assert all(length >= 1 for _, length, valid in rows if valid)
    counts = [c for c, _, _, _ in seg]
    keys = [k for _, _, k, _ in seg]
    assert m.segment_cu_q.tolist() == [0, *torch.tensor(counts).cumsum(0).tolist()]
    assert m.segment_cu_k.tolist() == [0, *torch.tensor(keys).cumsum(0).tolist()]
    assert m.q_causal_offsets.tolist() == [o for _, o, _, _ in seg]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (max(counts), max(keys))
    sources = [s + j for _, _, k, s in seg for j in range(k)]
    if first == 0 and count == total:
        assert m.key_source_indices is None
    else:
        assert m.key_source_indices.tolist() == sources
    check_dsa_metadata(m, count, total, torch.device("cpu"))


_DATA_DEPENDENT = ("nonzero", "unique", "masked_select", "_local_scalar_dense", "item")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_prepare_has_no_data_dependent_op_besides_the_batched_copy():
    with _RecordOps() as rec:
        example_a()
    names = [name for name, _, _ in rec.calls]
    assert not [n for n in names if any(bad in n for bad in _DATA_DEPENDENT)], names
    # repeat_interleave is given its output size (known from the batched copy), so it does not synchronize.
    for name, args, kwargs in rec.calls:
        if "repeat_interleave" in name:
            assert kwargs.get("output_size") is not None or len(args) >= 4, (name, args, kwargs)


def test_check_dispatches_no_tensor_op():
    m = example_a()
    with _RecordOps() as rec:
        assert check_dsa_metadata(m, 8, 12, torch.device("cpu")) is m
        assert cudnn_dsa._unpack_packed_metadata(m, 8, 12, torch.device("cpu")) is m
    assert rec.calls == []


_BAD_METADATA = [
    ("starts_dtype", dict(starts=torch.zeros(8, dtype=torch.int64)), ValueError, "packed starts must be"),
    ("starts_shape", dict(starts=torch.zeros(7, dtype=torch.int32)), ValueError, "packed starts must be"),
    ("lengths_noncontig", dict(causal_lengths=torch.zeros(16, dtype=torch.int32)[::2]), ValueError, "non-contiguous"),
    ("valid_dtype", dict(query_valid=torch.zeros(8, dtype=torch.int32)), ValueError, "query_valid"),
    ("nonempty_type", dict(all_rows_nonempty=1), TypeError, "Python bool"),
    ("nonempty_with_rows", dict(all_rows_nonempty=True), ValueError, "must be None"),
    ("rows_missing", dict(valid_row_indices=None), ValueError, "required"),
    ("rows_dtype", dict(valid_row_indices=torch.zeros(6, dtype=torch.int32)), ValueError, "valid_row_indices"),
    ("seg_q_dtype", dict(segment_cu_q=torch.zeros(4, dtype=torch.int64)), ValueError, "segment_cu_q"),
    ("seg_k_short", dict(segment_cu_k=torch.zeros(1, dtype=torch.int32)), ValueError, "segment_cu_k"),
    ("seg_k_noncontig", dict(segment_cu_k=torch.zeros(8, dtype=torch.int32)[::2]), ValueError, "contiguous"),
    ("seg_shapes_differ", dict(segment_cu_k=torch.zeros(5, dtype=torch.int32)), ValueError, "same shape"),
    ("offsets_shape", dict(q_causal_offsets=torch.zeros(2, dtype=torch.int32)), ValueError, "contiguous int32"),
    ("total_mismatch", dict(total_key_tokens=13), ValueError, "total_key_tokens=13"),
    ("max_q_zero", dict(max_seqlen_q=0), ValueError, "positive"),
    ("sources_dtype", dict(key_source_indices=torch.zeros(10, dtype=torch.int32)), ValueError, "key_source_indices"),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_METADATA, ids=[b[0] for b in _BAD_METADATA])
def test_malformed_metadata_is_rejected_without_sync(name, changes, exc, match):
    bad = dataclasses.replace(example_a(), **changes)
    with pytest.raises(exc, match=match):
        check_dsa_metadata(bad, 8, 12, torch.device("cpu"))


def test_metadata_rejects_wrong_object_and_wrong_device():
    with pytest.raises(TypeError, match="CudnnDsaPackedMetadata"):
        check_dsa_metadata(object(), 8, 12, torch.device("cpu"))
    with pytest.raises(ValueError, match="on meta"):
        check_dsa_metadata(example_a(), 8, 12, torch.device("meta"))


def test_metadata_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        example_a().max_seqlen_q = 3
    fields = [f.name for f in dataclasses.fields(CudnnDsaPackedMetadata)]
    assert fields == [
        "starts",
        "causal_lengths",
        "query_valid",
        "valid_row_indices",
        "segment_cu_q",
        "segment_cu_k",
        "q_causal_offsets",
        "key_source_indices",
        "max_seqlen_q",
        "max_seqlen_k",
        "total_key_tokens",
        "all_rows_nonempty",
    ]


def test_padding_mask_inside_a_document_is_refused():
    """A padding row with a real row of its document after it would stay that row's key (a row's keys are a prefix
    of its document): a ValueError naming the rows, where a tail of padding rows is accepted."""
    cu = i32([0, 6])
    hole = torch.tensor([False, False, True, False, False, False])
    with pytest.raises(ValueError, match="marks local row 2 as padding but row 3 of the same document is real"):
        prepare_dsa_metadata(cu, 6, padding_mask=hole)
    tail = torch.tensor([False, False, False, False, True, True])
    m = prepare_dsa_metadata(cu, 6, padding_mask=tail)
    assert m.causal_lengths.tolist() == [1, 2, 3, 4, 0, 0]
    # A marked row ending one document before a real row of the next is a tail too.
    m = prepare_dsa_metadata(i32([0, 3, 6]), 6, padding_mask=torch.tensor([False, False, True, False, False, False]))
    assert m.causal_lengths.tolist() == [1, 2, 0, 1, 2, 3]


def test_mask_ineligible_keeps_exactly_the_eligible_keys():
    """Indices outside ``[starts[t], starts[t] + causal_lengths[t])`` become -1; the rest, -1 included, stay."""
    from longtrain.dsa.metadata import mask_ineligible

    m = prepare_dsa_metadata(i32([0, 3, 6]), 6, padding_mask=torch.tensor([False] * 5 + [True]))
    topk = torch.tensor([[0, 1, -1], [1, 0, 2], [3, 2, 0], [3, 4, 2], [5, 3, 4], [3, 4, 5]], dtype=torch.int32)
    want = [[0, -1, -1], [1, 0, -1], [-1, 2, 0], [3, -1, -1], [-1, 3, 4], [-1, -1, -1]]
    got = mask_ineligible(topk, m)
    assert got.dtype == torch.int32 and got.tolist() == want
    assert torch.equal(mask_ineligible(torch.tensor(want, dtype=torch.int32), m), got)
