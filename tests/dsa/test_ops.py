"""The public DSA ops: boundary validation, the torch backend against brute force, backend dispatch."""

from __future__ import annotations

import math
import sys
import types
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.dsa import cudnn_dsa, ops, routes
from longtrain.dsa import reference as ref
from longtrain.dsa.metadata import prepare_dsa_metadata


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# --------------------------------------------------------------------------------------------- layouts


@st.composite
def packed_layouts(draw):
    """Random packed layouts: documents of length >= 1, optional storage padding, a CP query window,
    optional padding mask."""
    docs = draw(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 3)), min_size=1, max_size=4))
    real = [r for r, _ in docs]
    padded = [r + p for r, p in docs]
    total = sum(padded)
    world = draw(st.integers(1, 3))
    rank = draw(st.integers(0, world - 1))
    per_rank = -(-total // world)
    first = min(rank * per_rank, total - 1)
    count = max(1, min(per_rank, total - first))
    mask = draw(st.lists(st.booleans(), min_size=count, max_size=count)) if draw(st.booleans()) else None
    if mask is not None:  # padding rows as a tail of their document (prepare_dsa_metadata refuses a hole)
        bounds = [0, *torch.tensor(padded).cumsum(0).tolist()]
        doc = [max(d for d in range(len(padded)) if bounds[d] <= first + t) for t in range(count)]
        mask = [any(mask[u] and doc[u] == doc[t] for u in range(t + 1)) for t in range(count)]
    return dict(
        cu_seqlens=i32([0, *torch.tensor(real).cumsum(0).tolist()]),
        cu_seqlens_padded=i32([0, *torch.tensor(padded).cumsum(0).tolist()]),
        total=total,
        query_indices=torch.arange(first, first + count),
        padding_mask=None if mask is None else torch.tensor(mask),
    )


def _metadata(layout):
    return prepare_dsa_metadata(
        layout["cu_seqlens"],
        layout["total"],
        query_indices=layout["query_indices"],
        cu_seqlens_padded=layout["cu_seqlens_padded"],
        padding_mask=layout["padding_mask"],
    )


def _check_canonical_topk(out, scores, meta, k):
    """Count exactly min(K, L); ascending; -1 suffix; inside the window; the chosen set has maximal score."""
    assert out.dtype == torch.int32 and out.shape == (scores.shape[0], k)
    for t in range(out.shape[0]):
        start, length = int(meta.starts[t]), int(meta.causal_lengths[t])
        n = min(k, length)
        row = out[t].tolist()
        chosen, rest = row[:n], row[n:]
        assert all(v == -1 for v in rest), (t, row)
        assert all(start <= v < start + length for v in chosen), (t, row)
        assert all(a < b for a, b in zip(chosen, chosen[1:])), (t, row)
        unchosen = sorted(set(range(start, start + length)) - set(chosen))
        if chosen and unchosen:
            assert min(scores[t, v] for v in chosen) >= max(scores[t, v] for v in unchosen), t


# --------------------------------------------------------------------------------------------- indexer


@settings(max_examples=40, deadline=None)
@given(layout=packed_layouts(), k=st.integers(1, 10), heads=st.integers(1, 3), dim=st.integers(1, 5))
def test_indexer_topk_torch_selects_a_maximal_canonical_set(layout, k, heads, dim):
    gen = torch.Generator().manual_seed(k * 131 + heads * 7 + dim)
    rows, total = layout["query_indices"].numel(), layout["total"]
    q = torch.randn(rows, heads, dim, dtype=torch.float64, generator=gen)
    keys = torch.randn(total, dim, dtype=torch.float64, generator=gen)
    w = torch.randn(rows, heads, dtype=torch.float64, generator=gen)
    meta = _metadata(layout)
    out = ops.indexer_topk(q, keys, w, layout["cu_seqlens"], k, packed_metadata=meta, backend="torch")
    scores = ref.indexer_scores(q, keys, w, ref.eligible_key_mask(meta, total))
    _check_canonical_topk(out, scores, meta, k)
    if layout["padding_mask"] is None:
        rebuilt = ops.indexer_topk(
            q,
            keys,
            w,
            layout["cu_seqlens"],
            k,
            query_indices=layout["query_indices"],
            cu_seqlens_padded=layout["cu_seqlens_padded"],
            backend="auto",  # CPU: resolves to torch
        )
        assert torch.equal(rebuilt, out)


def test_indexer_topk_torch_ties_go_to_the_smaller_key_and_chunking_is_invisible():
    # Integer data: exact scores with many ties; the documented rule decides every boundary.
    gen = torch.Generator().manual_seed(3)
    cu = i32([0, 1, 13, 20, 40])
    total = 40
    q = torch.randint(-2, 3, (total, 2, 3), generator=gen).double()
    keys = torch.randint(-2, 3, (total, 3), generator=gen).double()
    w = torch.randint(0, 3, (total, 2), generator=gen).double()
    meta = prepare_dsa_metadata(cu, total)
    scores = ref.indexer_scores(q, keys, w, ref.eligible_key_mask(meta, total))
    out = ops.indexer_topk(q, keys, w, cu, 5, backend="torch")
    for t in range(total):
        start, length = int(meta.starts[t]), int(meta.causal_lengths[t])
        best = sorted(range(start, start + length), key=lambda s: (-float(scores[t, s]), s))[: min(5, length)]
        assert out[t].tolist() == sorted(best) + [-1] * (5 - len(best)), t
    with mock.patch.object(ops, "_TORCH_CHUNK_ELEMENTS", 16):  # one-to-few rows per chunk
        assert torch.equal(ops.indexer_topk(q, keys, w, cu, 5, backend="torch"), out)


def test_indexer_topk_accepts_low_precision_inputs():
    q = torch.randn(6, 2, 4).bfloat16()
    keys = torch.randn(6, 4).bfloat16()
    w = torch.rand(6, 2)
    out = ops.indexer_topk(q, keys, w, i32([0, 6]), 4, backend="torch")
    meta = prepare_dsa_metadata(i32([0, 6]), 6)
    _check_canonical_topk(out, ref.indexer_scores(q, keys, w, ref.eligible_key_mask(meta, 6)), meta, 4)


def _indexer_args(**changes):
    args = dict(
        index_q=torch.randn(4, 2, 8),
        index_k=torch.randn(4, 8),
        head_weights=torch.randn(4, 2),
        cu_seqlens=i32([0, 4]),
        index_topk=2,
    )
    args.update(changes)
    return args


_BAD_INDEXER = [
    ("backend", dict(backend="tilelang"), ValueError, "backend must be one of"),
    ("topk_bool", dict(index_topk=True), TypeError, "index_topk must be an int"),
    ("topk_tensor", dict(index_topk=torch.tensor(2)), TypeError, "index_topk must be an int"),
    ("topk_zero", dict(index_topk=0), ValueError, r"\[1, 2048\]"),
    ("topk_big", dict(index_topk=2049), ValueError, r"\[1, 2048\]"),
    ("q_int", dict(index_q=torch.zeros(4, 2, 8, dtype=torch.int32)), TypeError, "index_q must be a float"),
    ("q_2d", dict(index_q=torch.randn(4, 16)), ValueError, "index_q must be"),
    ("k_dim", dict(index_k=torch.randn(4, 7)), ValueError, "index_k must be"),
    ("w_shape", dict(head_weights=torch.randn(4, 3)), ValueError, "head_weights must be"),
    ("w_int", dict(head_weights=torch.zeros(4, 2, dtype=torch.int64)), TypeError, "head_weights"),
    ("k_empty", dict(index_k=torch.randn(0, 8), cu_seqlens=i32([0, 4])), ValueError, "index_k must have"),
    ("rows_mismatch", dict(index_q=torch.randn(3, 2, 8), head_weights=torch.randn(3, 2)), ValueError, "query rows"),
    ("cu_int64", dict(cu_seqlens=torch.tensor([0, 4])), TypeError, "int32"),
    ("device", dict(index_k=torch.randn(4, 8, device="meta")), ValueError, "one device"),
    ("cu_device", dict(cu_seqlens=i32([0, 4]).to("meta")), ValueError, "cu_seqlens is on meta but index_q is on cpu"),
    ("no_heads", dict(index_q=torch.randn(4, 0, 8), head_weights=torch.randn(4, 0)), ValueError, "at least one head"),
    ("no_dims", dict(index_q=torch.randn(4, 2, 0), index_k=torch.randn(4, 0)), ValueError, "one dimension"),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_INDEXER, ids=[b[0] for b in _BAD_INDEXER])
def test_indexer_topk_validation(name, changes, exc, match):
    with pytest.raises(exc, match=match):
        ops.indexer_topk(**_indexer_args(**changes))


def test_indexer_topk_rejects_metadata_built_for_another_layout():
    meta = prepare_dsa_metadata(i32([0, 5]), 5)
    with pytest.raises(ValueError, match="packed starts"):
        ops.indexer_topk(**_indexer_args(), packed_metadata=meta)


# --------------------------------------------------------------------------------------------- sparse MLA


def _dense_oracle(q, kv, idx, scale, d_v, lengths, sink):
    """Dense masked softmax over all keys with per-key multiplicities (log counts as a bias)."""
    num_q, _, _ = q.shape
    total = kv.shape[0]
    slots = torch.arange(idx.shape[1])
    valid = (idx >= 0) & (idx < total)
    if lengths is not None:
        valid &= slots[None, :] < lengths[:, None]
    counts = torch.zeros(num_q, total, dtype=torch.float64)
    counts.scatter_add_(1, idx.clamp(0, total - 1).long(), valid.double())
    logits = scale * torch.einsum("thd,sd->ths", q, kv[:, 0]) + counts.log()[:, None, :]
    if sink is not None:
        logits = torch.cat([logits, sink[None, :, None].expand(num_q, -1, 1)], dim=-1)
    nonempty = (counts > 0).any(dim=1)[:, None, None]
    probs = torch.softmax(torch.where(nonempty, logits, 0.0), dim=-1)
    out = torch.einsum("ths,sd->thd", probs[..., :total], kv[:, 0, :d_v])
    return torch.where(nonempty, out, 0.0)


@st.composite
def sparse_cases(draw):
    num_q = draw(st.integers(1, 6))
    total = draw(st.integers(1, 7))
    k = draw(st.integers(1, 6))
    heads = draw(st.integers(1, 3))
    idx = draw(st.lists(st.lists(st.integers(-2, total + 1), min_size=k, max_size=k), min_size=num_q, max_size=num_q))
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, k), min_size=num_q, max_size=num_q)))
    sink = draw(
        st.one_of(
            st.none(),
            st.lists(st.one_of(st.just(-math.inf), st.floats(-3, 3)), min_size=heads, max_size=heads),
        )
    )
    return num_q, total, heads, torch.tensor(idx), lengths, sink, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(case=sparse_cases(), chunked=st.booleans())
def test_sparse_mla_torch_matches_the_dense_oracle_with_gradients(case, chunked):
    num_q, total, heads, idx, lengths, sink, int64 = case
    gen = torch.Generator().manual_seed(num_q * 100 + total)
    q = torch.randn(num_q, heads, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    kv = torch.randn(total, 1, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    sink_t = None if sink is None else torch.tensor(sink, dtype=torch.float64, requires_grad=True)
    lengths_t = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    indices = idx if int64 else idx.to(torch.int32)
    with mock.patch.object(ops, "_TORCH_CHUNK_ELEMENTS", 1 if chunked else ops._TORCH_CHUNK_ELEMENTS):
        out = ops.sparse_mla_attention(
            q, kv, indices, 0.5, d_v=4, topk_length=lengths_t, attn_sink=sink_t, backend="torch"
        )
        grad = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        inputs = (q, kv) if sink_t is None else (q, kv, sink_t)
        got = torch.autograd.grad(out, inputs, grad)
    want_out = _dense_oracle(q, kv, idx, 0.5, 4, lengths_t, sink_t)
    want = torch.autograd.grad(want_out, inputs, grad)
    # float64 against float64: only summation order differs.
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sparse_mla_torch_empty_rows_are_exact_zeros_with_zero_gradients(poison):
    q = torch.randn(3, 2, 8, requires_grad=True)
    kv = torch.randn(4, 1, 8, requires_grad=True)
    idx = torch.tensor([[1, -1], [-1, -1], [5, 9]], dtype=torch.int32)  # rows 1 and 2 have no valid key
    out = ops.sparse_mla_attention(q, kv, idx, 0.3, d_v=8, backend="torch")
    out.backward(torch.ones_like(out))
    assert not torch.isnan(out).any() and (out[1:] == 0).all()
    assert (q.grad[1:] == 0).all() and (kv.grad[[0, 2, 3]] == 0).all() and (kv.grad[1] != 0).any()
    # topk_length = 0 everywhere: the whole batch is empty.
    q.grad = None
    out = ops.sparse_mla_attention(q, kv, idx, 0.3, d_v=8, topk_length=torch.zeros(3, dtype=torch.int32))
    out.sum().backward()
    assert (out == 0).all() and (q.grad == 0).all()


def test_sparse_mla_torch_fp32_against_float64_reference():
    q = torch.randn(8, 4, 16, dtype=torch.float64)
    kv = torch.randn(10, 1, 16, dtype=torch.float64)
    idx = torch.randint(-1, 10, (8, 5))
    out32 = ops.sparse_mla_attention(q.float(), kv.float(), idx, 0.25, d_v=12, backend="torch")
    out64, _ = ref.sparse_mla_reference(q, kv, idx, 0.25, d_v=12)
    assert out32.dtype == torch.float32
    # fp32 against the float64 oracle: a few fp32 roundings of O(1) values.
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)


def _sparse_args(**changes):
    args = dict(q=torch.randn(3, 2, 8), kv=torch.randn(5, 1, 8), topk_indices=torch.zeros(3, 2, dtype=torch.int32))
    args["softmax_scale"] = changes.pop("softmax_scale", 0.5)
    args.update(changes)
    return args


_BAD_SPARSE = [
    ("backend", dict(backend="flash"), ValueError, "backend must be one of"),
    ("q_int", dict(q=torch.zeros(3, 2, 8, dtype=torch.int32)), TypeError, "q must be a float"),
    ("q_2d", dict(q=torch.randn(3, 16)), ValueError, "q must be"),
    ("kv_heads", dict(kv=torch.randn(5, 2, 8)), ValueError, "kv must be"),
    ("kv_width", dict(kv=torch.randn(5, 1, 9)), ValueError, "kv must be"),
    ("kv_dtype", dict(kv=torch.randn(5, 1, 8, dtype=torch.float64)), TypeError, "share a dtype"),
    ("kv_empty", dict(kv=torch.randn(0, 1, 8)), ValueError, "kv must have"),
    ("idx_float", dict(topk_indices=torch.zeros(3, 2)), TypeError, "int32 or int64"),
    ("idx_int16", dict(topk_indices=torch.zeros(3, 2, dtype=torch.int16)), TypeError, "int32 or int64"),
    ("idx_rows", dict(topk_indices=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "topk_indices must be"),
    ("idx_width0", dict(topk_indices=torch.zeros(3, 0, dtype=torch.int32)), ValueError, "K >= 1"),
    ("idx_3d", dict(topk_indices=torch.zeros(3, 2, 2, dtype=torch.int32)), ValueError, "topk_indices must be"),
    ("scale_str", dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
    ("scale_bool", dict(softmax_scale=True), TypeError, "softmax_scale"),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, "finite positive"),
    ("scale_inf", dict(softmax_scale=math.inf), ValueError, "finite positive"),
    ("scale_zero", dict(softmax_scale=0.0), ValueError, "finite positive"),
    ("dv_big", dict(d_v=9), ValueError, "d_v must be in"),
    ("dv_zero", dict(d_v=0), ValueError, "d_v must be in"),
    ("dv_float", dict(d_v=4.0), TypeError, "d_v must be an int"),
    ("len_float", dict(topk_length=torch.zeros(3)), TypeError, "topk_length"),
    ("len_shape", dict(topk_length=torch.zeros(2, dtype=torch.int32)), ValueError, "topk_length must be"),
    ("sink_shape", dict(attn_sink=torch.zeros(3)), ValueError, "attn_sink must be"),
    ("sink_int", dict(attn_sink=torch.zeros(2, dtype=torch.int32)), TypeError, "attn_sink"),
    ("device", dict(topk_indices=torch.zeros(3, 2, dtype=torch.int32, device="meta")), ValueError, "one device"),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_SPARSE, ids=[b[0] for b in _BAD_SPARSE])
def test_sparse_mla_validation(name, changes, exc, match):
    kwargs = _sparse_args(**changes)
    kwargs.setdefault("d_v", 8)
    with pytest.raises(exc, match=match):
        ops.sparse_mla_attention(**kwargs)


# --------------------------------------------------------------------------------------------- dispatch


def _fake_triton(calls):
    module = types.ModuleType("longtrain.dsa.triton")

    def availability(device):
        calls.append(("availability", str(device)))
        return True, ""

    def indexer_topk_triton_unchecked(
        index_q, index_k, head_weights, starts, causal_lengths, index_topk, config=None, *, fp8=False
    ):
        calls.append(("indexer", starts.tolist(), causal_lengths.tolist(), index_topk))
        return ref.indexer_topk_reference(index_q, index_k, head_weights, starts, causal_lengths, index_topk)

    def sparse_mla_triton_unchecked(
        q, kv, topk_indices, softmax_scale, d_v, topk_length=None, attn_sink=None, deterministic=False
    ):
        calls.append(("sparse", topk_indices.dtype, tuple(topk_indices.shape), softmax_scale, d_v))
        return ref.sparse_mla_reference(
            q, kv, topk_indices, softmax_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink
        )[0]

    module.availability = availability
    module.indexer_topk_triton_unchecked = indexer_topk_triton_unchecked
    module.sparse_mla_triton_unchecked = sparse_mla_triton_unchecked
    return module


def test_triton_backend_dispatches_with_metadata_windows(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "longtrain.dsa.triton", _fake_triton(calls))
    monkeypatch.setattr(routes, "_TRITON_REASONS", {})
    cu, padded = i32([0, 3, 7, 9]), i32([0, 4, 9, 12])
    q, keys, w = torch.randn(8, 2, 16), torch.randn(12, 16), torch.rand(8, 2)
    out = ops.indexer_topk(
        q, keys, w, cu, 2, query_indices=torch.arange(2, 10), cu_seqlens_padded=padded, backend="triton"
    )
    assert calls[-1] == ("indexer", [0, 0, 4, 4, 4, 4, 4, 9], [3, 0, 1, 2, 3, 4, 0, 1], 2)
    assert out.shape == (8, 2)
    sparse_q, kv = torch.randn(8, 2, 32, requires_grad=True), torch.randn(12, 1, 32)
    ops.sparse_mla_attention(sparse_q, kv, out.long()[:, None, :], 0.125, d_v=16, backend="triton").sum().backward()
    # The op hands the validated [T, K] indices over as they came; the unchecked body narrows them.
    assert calls[-1] == ("sparse", torch.int64, (8, 2), 0.125, 16)
    assert sparse_q.grad is not None


def test_explicit_triton_refuses_what_its_kernels_do_not_take(monkeypatch):
    monkeypatch.setitem(sys.modules, "longtrain.dsa.triton", _fake_triton([]))
    monkeypatch.setattr(routes, "_TRITON_REASONS", {})
    q64, kv64 = torch.randn(3, 2, 16, dtype=torch.float64), torch.randn(5, 1, 16, dtype=torch.float64)
    idx = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        ops.sparse_mla_attention(q64, kv64, idx, 0.5, d_v=16, backend="triton")
    with pytest.raises(ValueError, match="d_v must be a multiple of 16"):
        ops.sparse_mla_attention(q64.float(), kv64.float(), idx, 0.5, d_v=8, backend="triton")
    with pytest.raises(TypeError, match="share a dtype"):
        ops.indexer_topk(**_indexer_args(index_k=torch.randn(4, 8).double()), backend="triton")
    # "auto" on the same calls is never refused: on CPU it is torch
    ops.sparse_mla_attention(q64, kv64, idx, 0.5, d_v=8)


def test_auto_on_cpu_is_torch_even_under_the_interpreter(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "longtrain.dsa.triton", _fake_triton(calls))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    call = routes.CallShape("sparse_mla", torch.device("cpu"), torch.float32, 2, 8, 2, 8)
    assert routes.auto_plan(call)[:2] == ("torch", "torch")
    ops.indexer_topk(**_indexer_args())
    ops.sparse_mla_attention(**_sparse_args(), d_v=8)
    assert calls == []


def test_explicit_triton_without_kernels_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(routes, "triton_reason", lambda device: "needs CUDA SM80+")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on cpu: needs CUDA SM80"):
        ops.sparse_mla_attention(**_sparse_args(), d_v=8, backend="triton")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run on cpu: needs CUDA SM80"):
        ops.indexer_topk(**_indexer_args(), backend="triton")


def test_explicit_cudnn_on_cpu_raises_runtime_error(monkeypatch):
    # The indexer needs only the frontend (no FlashMLA kernel): its error names only that.
    monkeypatch.setattr(cudnn_dsa, "_HAS_CUDNN_DSA", False)
    with pytest.raises(RuntimeError, match=r"indexer_topk requires nvidia-cudnn-frontend\[cutedsl\] \("):
        ops.indexer_topk(**_indexer_args(), backend="cudnn")
    with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
        ops.sparse_mla_attention(**_sparse_args(), d_v=8, backend="cudnn")


def test_cudnn_backend_masks_slots_beyond_topk_length(monkeypatch):
    from longtrain.dsa import cudnn_dsa

    seen = {}

    def fake(q, kv, indices, scale, padded_heads, topk_length=None, all_rows_nonempty=False, valid_row_indices=None,
             forward_fn=None):  # fmt: skip
        seen.update(indices=indices, topk_length=topk_length, padded_heads=padded_heads)
        return q.new_zeros((q.shape[0], q.shape[1], 512))

    def checked_twice(*args, **kwargs):
        raise AssertionError("the op validates once: cudnn_sparse_attention's own checks must not run")

    monkeypatch.setattr(cudnn_dsa, "_cudnn_sparse_attention_unchecked", fake)
    monkeypatch.setattr(cudnn_dsa, "_validate_sparse_attention", checked_twice)
    monkeypatch.setattr(cudnn_dsa, "_require_cuda_tensors", lambda operation, *tensors: (9, 0))
    monkeypatch.setattr(cudnn_dsa, "_HAS_CUDNN_DSA", True)
    monkeypatch.setattr(cudnn_dsa, "_HAS_FLASH_MLA", True)
    idx = torch.tensor([[3, 1, 2], [0, 4, 4 + 2**32]])  # int64: 2**32 + 4 must not wrap into row 4
    ops.sparse_mla_attention(
        torch.randn(2, 4, 576).bfloat16(),
        torch.randn(5, 1, 576).bfloat16(),
        idx,
        0.1,
        topk_length=torch.tensor([1, 3], dtype=torch.int32),
        backend="cudnn",
    )
    assert seen["indices"].dtype == torch.int32 and seen["indices"].tolist() == [[[3, -1, -1]], [[0, 4, -1]]]
    assert seen["topk_length"] is None and seen["padded_heads"] == 64
    with pytest.raises(ValueError, match="d_v=512 without attn_sink"):
        ops.sparse_mla_attention(
            torch.randn(2, 4, 576).bfloat16(), torch.randn(5, 1, 576).bfloat16(), idx, 0.1, d_v=256, backend="cudnn"
        )
    with pytest.raises(TypeError, match="needs bf16"):
        ops.sparse_mla_attention(torch.randn(2, 4, 576), torch.randn(5, 1, 576), idx, 0.1, backend="cudnn")
    with pytest.raises(ValueError, match="divide 64, got H=48"):
        ops.sparse_mla_attention(
            torch.randn(2, 48, 576).bfloat16(), torch.randn(5, 1, 576).bfloat16(), idx, 0.1, backend="cudnn"
        )


def test_backend_status_rows():
    rows = ops.backend_status()
    names = [name for name, _ in rows]
    assert names[:3] == ["triton", "cudnn", "torch"] and all(n.startswith("auto ") for n in names[3:])
    assert dict(rows)["torch"] is None
    for _, reason in rows:
        assert reason is None or (isinstance(reason, str) and reason)
    if not torch.cuda.is_available():
        assert [n.split(":")[0] for n in names[3:]] == [
            "auto sparse_mla fwd -> torch",
            "auto sparse_mla bwd -> torch",
            "auto indexer_topk -> torch",
            "auto indexer_topk fp8=True -> torch",
        ]
        assert "CUDA" in dict(rows)["triton"]


@pytest.fixture
def triton_on_cpu(triton_interpret):
    """Our Triton kernels on CPU tensors under the interpreter, or a skip saying why they cannot run."""
    triton_ops = pytest.importorskip("longtrain.dsa.triton")
    ok, why = triton_ops.availability(torch.device("cpu"))
    if not ok:
        pytest.skip(why)


@pytest.mark.interpret
def test_triton_backend_through_ops_matches_torch(triton_on_cpu):
    """The real kernel module, under the interpreter, behind the same op contract (small fp32 shapes)."""
    cu = i32([0, 20, 21, 32])
    q, keys, w = torch.randn(32, 2, 32), torch.randn(32, 32), torch.rand(32, 2)
    topk = ops.indexer_topk(q, keys, w, cu, 8, backend="triton")
    assert torch.equal(topk, ops.indexer_topk(q, keys, w, cu, 8, backend="torch"))
    query = torch.randn(32, 16, 48, requires_grad=True)
    kv = torch.randn(32, 1, 48, requires_grad=True)
    got = ops.sparse_mla_attention(query, kv, topk, 0.2, d_v=32, backend="triton")
    want = ops.sparse_mla_attention(query, kv, topk, 0.2, d_v=32, backend="torch")
    # fp32 kernel vs fp32 torch: blockwise online softmax reorders fp32 sums.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _second_order(backend):
    q = torch.randn(4, 2, 16, requires_grad=True)
    kv = torch.randn(6, 1, 16, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4]], dtype=torch.int32)
    for loss in (torch.Tensor.sum, lambda out: out.square().sum()):  # dO constant, then dO depending on q
        out = ops.sparse_mla_attention(q, kv, idx, 0.25, d_v=16, backend=backend)
        (grad_q,) = torch.autograd.grad(loss(out), q, create_graph=True)
        with pytest.raises(RuntimeError, match="sparse_mla_attention .* is differentiable once"):
            torch.autograd.grad(grad_q.square().sum() + q.square().sum(), q)
    # First-order gradients under create_graph=True still equal the plain ones.
    out = ops.sparse_mla_attention(q, kv, idx, 0.25, d_v=16, backend=backend)
    graph = torch.autograd.grad(out.square().sum(), (q, kv), create_graph=True)
    out = ops.sparse_mla_attention(q, kv, idx, 0.25, d_v=16, backend=backend)
    plain = torch.autograd.grad(out.square().sum(), (q, kv))
    assert all(torch.equal(a, b) for a, b in zip(graph, plain))


def test_sparse_mla_second_order_gradients_raise_instead_of_dropping_the_term():
    """The backward is a kernel, not a graph: a second-order gradient (a gradient penalty) raises at once rather
    than silently leaving the attention's term out."""
    _second_order("torch")


@pytest.mark.interpret
def test_triton_second_order_gradients_raise(triton_on_cpu):
    _second_order("triton")
