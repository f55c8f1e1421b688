"""The plain-torch oracle against loops written straight from the definitions (float64, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from longtrain.dsa import reference as ref
from longtrain.dsa.metadata import prepare_dsa_metadata


def _example_a():
    return prepare_dsa_metadata(
        torch.tensor([0, 3, 7, 9], dtype=torch.int32),
        12,
        query_indices=torch.arange(2, 10),
        cu_seqlens_padded=torch.tensor([0, 4, 9, 12], dtype=torch.int32),
    )


def test_eligible_key_mask_is_same_document_causal_no_padding():
    mask = ref.eligible_key_mask(_example_a(), 12)
    expected = {0: [0, 1, 2], 1: [], 2: [4], 3: [4, 5], 4: [4, 5, 6], 5: [4, 5, 6, 7], 6: [], 7: [9]}
    assert mask.shape == (8, 12) and mask.dtype == torch.bool
    for row, keys in expected.items():
        assert mask[row].nonzero().flatten().tolist() == keys


def test_indexer_scores_match_the_formula():
    q = torch.randn(5, 3, 4, dtype=torch.float64)
    k = torch.randn(6, 4, dtype=torch.float64)
    w = torch.randn(5, 3, dtype=torch.float64)
    eligible = torch.rand(5, 6) > 0.3
    scores = ref.indexer_scores(q, k, w, eligible)
    assert scores.dtype == torch.float64
    for t in range(5):
        for s in range(6):
            want = sum(float(w[t, h]) * max(0.0, float(q[t, h] @ k[s])) for h in range(3))
            want = want if eligible[t, s] else -math.inf
            assert scores[t, s].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert ref.indexer_scores(q.float(), k.bfloat16(), w.float(), eligible).dtype == torch.float32


def test_indexer_topk_reference_picks_largest_then_sorts_and_breaks_ties_low():
    # One head, unit weight, D=1: score(t, s) = relu(q[t] * k[s]) = k[s] for q = 1.
    k = torch.tensor([[3.0], [1.0], [3.0], [2.0], [3.0], [5.0]], dtype=torch.float64)
    q = torch.ones(3, 1, 1, dtype=torch.float64)
    w = torch.ones(3, 1, dtype=torch.float64)
    starts = torch.tensor([0, 0, 2], dtype=torch.int32)
    lengths = torch.tensor([5, 2, 0], dtype=torch.int32)
    out = ref.indexer_topk_reference(q, k, w, starts, lengths, 3)
    assert out.dtype == torch.int32
    # Row 0: keys 0..4 scores [3,1,3,2,3] -> three 3s (0, 2, 4); row 1: keys 0..1 -> both; row 2: empty.
    assert out.tolist() == [[0, 2, 4], [0, 1, -1], [-1, -1, -1]]
    # Ties at the boundary go to the smaller key index.
    assert ref.indexer_topk_reference(q, k, w, starts, lengths, 2).tolist() == [[0, 2], [0, 1], [-1, -1]]
    # K wider than the key tensor keeps the fixed width.
    wide = ref.indexer_topk_reference(q[:1], k[:2], w[:1], starts[:1], torch.tensor([2]), 4)
    assert wide.tolist() == [[0, 1, -1, -1]]


@pytest.mark.parametrize(
    "starts,lengths,want",
    [([4], [5], [[4, 5, -1]]), ([5], [3], [[5, -1, -1]]), ([7], [3], [[-1, -1, -1]])],
    ids=["window_past_the_last_key", "one_key_left", "window_wholly_past_the_keys"],
)
def test_indexer_topk_reference_clips_a_window_to_the_keys_that_exist(starts, lengths, want):
    """A window reaching past the key rows selects only its keys that exist, as the Triton kernels clip it: the
    reference used to fill the rest of ``min(K, causal_length)`` with ineligible (-inf scored) keys outside it."""
    k = torch.tensor([[3.0], [1.0], [3.0], [2.0], [3.0], [5.0]], dtype=torch.float64)
    q, w = torch.ones(1, 1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    got = ref.indexer_topk_reference(q, k, w, torch.tensor(starts), torch.tensor(lengths), 3)
    assert got.tolist() == want


def _loop_sparse_mla(q, kv, idx, scale, d_v, lengths, sink):
    """Per (row, head) softmax over the slot list, with the sink as a zero-value logit."""
    num_q, num_h, _ = q.shape
    out = torch.zeros(num_q, num_h, d_v, dtype=torch.float64)
    lse = torch.full((num_q, num_h), -math.inf, dtype=torch.float64)
    for t in range(num_q):
        limit = idx.shape[1] if lengths is None else int(lengths[t])
        slots = [int(j) for j in idx[t, :limit] if 0 <= int(j) < kv.shape[0]]
        for h in range(num_h):
            if not slots:
                continue
            z = [scale * float(q[t, h] @ kv[j, 0]) for j in slots]
            lse[t, h] = math.log(sum(math.exp(v) for v in z))
            denom = sum(math.exp(v) for v in z) + (0.0 if sink is None else math.exp(float(sink[h])))
            for v, j in zip(z, slots):
                out[t, h] += math.exp(v) / denom * kv[j, 0, :d_v]
    return out, lse


@pytest.mark.parametrize("with_sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("with_lengths", [False, True], ids=["all_slots", "topk_length"])
def test_sparse_mla_reference_matches_loops(with_sink, with_lengths):
    q = torch.randn(5, 3, 10, dtype=torch.float64)
    kv = torch.randn(7, 1, 10, dtype=torch.float64)
    # Duplicates (row 0), out-of-range and negative slots (row 1), an empty row (row 3).
    idx = torch.tensor([[2, 2, 5, -1], [7, -1, 0, 9], [6, 5, 4, 3], [-1, -1, -1, -1], [0, 1, 2, 3]])
    lengths = torch.tensor([3, 4, 2, 0, 1]) if with_lengths else None
    sink = torch.tensor([0.3, -math.inf, 2.0], dtype=torch.float64) if with_sink else None
    out, lse = ref.sparse_mla_reference(q, kv, idx, 0.7, d_v=6, topk_length=lengths, attn_sink=sink)
    want_out, want_lse = _loop_sparse_mla(q, kv, idx, 0.7, 6, lengths, sink)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)  # float64 vs float64 loops
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()
    # The [T, 1, K] layout is accepted too.
    out3, _ = ref.sparse_mla_reference(q, kv, idx[:, None], 0.7, d_v=6, topk_length=lengths, attn_sink=sink)
    assert torch.equal(out3, out)


def test_sparse_mla_reference_gradients_are_finite_and_zero_for_empty_rows():
    q = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(5, 1, 6, dtype=torch.float64, requires_grad=True)
    sink = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 1, -1], [-1, -1, -1], [4, 4, 2], [3, -1, -1]])
    assert torch.autograd.gradcheck(
        lambda a, b, c: ref.sparse_mla_reference(a, b, idx, 0.4, d_v=4, attn_sink=c)[0], (q, kv, sink)
    )
    out, lse = ref.sparse_mla_reference(q, kv, idx, 0.4, d_v=4, attn_sink=sink)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all() and torch.isfinite(sink.grad).all()
    assert (q.grad[1] == 0).all()  # the empty row
    assert (kv.grad[[1, 2, 3, 4]] != 0).any() and (kv.grad[0] != 0).any()
    # Only the sink-less head has no sink gradient.
    assert sink.grad[0] == 0 and sink.grad[1] != 0


def test_sparse_mla_reference_nan_sink_makes_its_heads_rows_nan():
    """A NaN sink is visible, as in sparse_mla_attention: its head's rows are NaN (empty rows too), not the
    unnormalized weighted sum; the other heads are unaffected."""
    q, kv = torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(3, 1, 4, dtype=torch.float64)
    idx = torch.tensor([[0, -1], [0, 1], [-1, -1]])
    sink = torch.tensor([0.5, math.nan], dtype=torch.float64)
    out, _ = ref.sparse_mla_reference(q, kv, idx, 0.3, d_v=4, attn_sink=sink)
    want, _ = ref.sparse_mla_reference(q[:, :1], kv, idx, 0.3, d_v=4, attn_sink=sink[:1])
    assert torch.isnan(out[:, 1]).all()
    assert torch.equal(out[:, :1], want)


def test_sparse_mla_reference_all_rows_empty_is_zero_not_nan():
    q = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(2, 1, 4, dtype=torch.float64, requires_grad=True)
    out, lse = ref.sparse_mla_reference(q, kv, torch.full((3, 2), -1), 1.0, d_v=4)
    out.sum().backward()
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert (q.grad == 0).all() and (kv.grad == 0).all()


def test_sparse_mla_reference_large_logits_do_not_overflow():
    q = torch.full((1, 1, 4), 100.0, dtype=torch.float64)
    kv = torch.full((2, 1, 4), 100.0, dtype=torch.float64)
    out, lse = ref.sparse_mla_reference(q, kv, torch.tensor([[0, 1]]), 1.0, d_v=4)
    assert torch.allclose(out, torch.full_like(out, 100.0)) and lse.item() == pytest.approx(40000 + math.log(2))
