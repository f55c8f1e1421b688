"""plan_cp_shards: every position of the padded row exactly once, equal tokens per rank, causal work equal to a
brute-force count, deterministic, contiguous mode = the seed's split, balanced within 1.02 of the mean at W = 8 on
the benchmark layouts; unshard round-trips; clear errors."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import CPShardPlan, plan_cp_shards
from longtrain.blockdiag_cp.sharding import causal_work_of


def _brute_work(doc_lens, index):
    ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(doc_lens)] + [torch.zeros(0, dtype=torch.long)])
    pos_in_doc = torch.cat([torch.arange(n) for n in doc_lens] + [torch.zeros(0, dtype=torch.long)])
    total = 0
    for p in index.tolist():
        if p < ids.numel():  # a real token attends every earlier key of its document and itself
            total += int(pos_in_doc[p]) + 1
    return total


def _pad(doc_lens, world, extra_pad):
    """At least ``extra_pad`` padding positions, making the row a non-empty multiple of ``world``."""
    pad = extra_pad + (-(sum(doc_lens) + extra_pad)) % world
    return world if sum(doc_lens) + pad == 0 else pad


def _check_plan(plan: CPShardPlan, doc_lens, pad, world):
    seq = sum(doc_lens) + pad
    assert plan.seq_len == seq and plan.local_len * world == seq
    assert all(t.dtype == torch.int64 and t.numel() == plan.local_len for t in plan.token_index)
    assert torch.equal(torch.sort(plan.permutation).values, torch.arange(seq))  # a permutation of the row
    for r in range(world):
        idx = plan.token_index[r]
        assert bool((idx[1:] > idx[:-1]).all())  # ascending local order
        assert plan.causal_work[r] == _brute_work(doc_lens, idx)
        assert plan.causal_work[r] == causal_work_of(doc_lens, plan.pieces[r])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=0, max_size=9),
    st.integers(1, 8),
    st.integers(0, 40),
    st.sampled_from(["balanced", "contiguous"]),
    st.sampled_from([1, 4, 16, 128]),
)
def test_invariants(doc_lens, world, extra_pad, sharding, chunk):
    pad = _pad(doc_lens, world, extra_pad)
    plan = plan_cp_shards(doc_lens, world, sharding=sharding, chunk=chunk, pad=pad)
    _check_plan(plan, doc_lens, pad, world)
    again = plan_cp_shards(list(doc_lens), world, sharding=sharding, chunk=chunk, pad=pad)
    assert again.pieces == plan.pieces  # deterministic


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=9),
    st.integers(2, 8),
    st.integers(0, 40),
    st.sampled_from([1, 4, 16]),
)
def test_rank_pieces_need_exactly_their_passes_keys(doc_lens, world, extra_pad, chunk):
    """Every rank's needed key positions (what the all-to-all-v delivers) are the sorted, duplicate-free union of the
    keys its passes read: a document's keys from its start to the end of the rank's last piece of it."""
    from longtrain.blockdiag_cp.sharding import rank_pieces

    pad = _pad(doc_lens, world, extra_pad)
    plan = plan_cp_shards(doc_lens, world, sharding="balanced", chunk=chunk, pad=pad)
    if plan.is_contiguous:
        return
    for rank in range(world):
        pieces = rank_pieces(plan, rank, "cpu")
        for r in range(world):
            keys = [p.key_pos for p in rank_pieces(plan, r, "cpu").passes]
            want = torch.unique(torch.cat(keys)) if keys else torch.zeros(0, dtype=torch.int64)
            assert torch.equal(pieces.needed[r], want), (rank, r)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=6),
    st.integers(2, 8),
    st.integers(0, 20),
    st.sampled_from([1, 8, 32]),
)
def test_a_balanced_ranks_one_call_equals_attention_over_the_row(doc_lens, world, extra_pad, chunk):
    """A rank's one varlen call (its rows, its passes' compacted keys concatenated, ``RankPieces.meta``) on the
    reference provider equals block-diagonal causal attention over the whole row at the rank's positions (float64),
    forward and the gradients of q and of the whole row's k and v."""
    from longtrain.blockdiag_cp import runtime
    from longtrain.blockdiag_cp.sharding import rank_pieces

    pad = _pad(doc_lens, world, extra_pad)
    plan = plan_cp_shards(doc_lens, world, sharding="balanced", chunk=chunk, pad=pad)
    if plan.is_contiguous:
        return
    seq = plan.seq_len
    ids = torch.cat(
        [torch.full((n,), d + 1) for d, n in enumerate(doc_lens)] + [torch.zeros(plan.pad, dtype=torch.long)]
    )
    gen = torch.Generator().manual_seed(len(doc_lens) * 31 + world)
    q_row = torch.randn(seq, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k_row = torch.randn(seq, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v_row = torch.randn(seq, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    pos = torch.arange(seq)
    allow = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qhd,khd->hqk", q_row, k_row.repeat_interleave(2, dim=1)) * 8**-0.5
    probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), -1).nan_to_num(0.0)
    want_row = torch.einsum("hqk,khd->qhd", probs, v_row.repeat_interleave(2, dim=1))
    for rank in range(world):
        pieces = rank_pieces(plan, rank, "cpu")
        index = plan.token_index[rank]
        q = q_row[index]
        kv = torch.stack([k_row, v_row])[:, plan.permutation]  # the all-gathered buffer: rows in plan order
        key_index = pieces.key_index("allgather", plan.permutation, "cpu")
        out = torch.zeros(index.numel(), 4, 8, dtype=torch.float64)
        if pieces.passes:
            kvp = torch.cat([kv.index_select(1, kidx) for kidx in key_index], dim=1)
            got = runtime.attend(q.index_select(0, pieces.q_rows), kvp[0], kvp[1], pieces.meta, "reference")
            out = out.index_copy(0, pieces.q_rows, got)
        want = want_row[index]
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        if not pieces.passes:  # a padding-only rank: nothing to differentiate
            continue
        dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        got_g = torch.autograd.grad(out, (q_row, k_row, v_row), dout, allow_unused=True, materialize_grads=True)
        want_g = torch.autograd.grad(want, (q_row, k_row, v_row), dout, retain_graph=True, materialize_grads=True)
        for name, a, b in zip(("dq", "dk", "dv"), got_g, want_g):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def test_contiguous_is_the_seed_split():
    plan = plan_cp_shards([300, 500, 150], 4, sharding="contiguous", pad=74)
    assert plan.pieces == tuple(((r * 256, (r + 1) * 256),) for r in range(4)) and plan.is_contiguous
    assert plan_cp_shards([300, 500, 150], 1, pad=2).is_contiguous  # one rank: the whole row


@pytest.mark.parametrize("layout", ["long", "short", "one"])
@pytest.mark.parametrize("tokens", [32768, 131072])
def test_balanced_within_two_percent_at_w8(layout, tokens):
    gen = random.Random(1 if layout == "long" else 2)
    lo, hi = (512, 8192) if layout == "long" else (64, 2048)
    lens: list[int] = []
    while layout != "one" and sum(lens) < tokens:
        lens.append(gen.randint(lo, hi))
    if layout == "one":
        lens = [tokens]
    lens[-1] -= sum(lens) - tokens
    for world in (2, 4, 8):
        balanced = plan_cp_shards(lens, world)
        contiguous = plan_cp_shards(lens, world, sharding="contiguous")
        assert balanced.imbalance <= 1.02, (world, balanced.imbalance)
        assert balanced.imbalance <= contiguous.imbalance + 1e-12
        sizes = [b - a for ranges in balanced.pieces for a, b in ranges]
        doc_pieces = [b - a for ranges in balanced.pieces for a, b in ranges if b <= sum(lens)]
        assert sum(sizes) == tokens and min(doc_pieces) >= 1


def test_pieces_respect_the_chunk():
    """With room on the ranks, a document is cut (head-tail) only into pieces of at least `chunk` tokens: 4096
    tokens over all 4 ranks, 700 over 2 (k = 700 // 256), 300 and 100 whole."""
    lens = [4096, 700, 300, 100]
    plan = plan_cp_shards(lens, 4, chunk=128, pad=404)
    bounds = torch.tensor([0, *lens]).cumsum(0).tolist()
    per_doc: dict[int, list[tuple[int, int]]] = {}
    for r, ranges in enumerate(plan.pieces):
        for a, b in ranges:
            for d in range(len(lens)):
                lo, hi = max(a, bounds[d]), min(b, bounds[d + 1])
                if lo < hi:
                    per_doc.setdefault(d, []).append((r, hi - lo))
    assert len({r for r, _ in per_doc[0]}) == 4 and len({r for r, _ in per_doc[1]}) == 2
    assert all(size >= 128 for d in (0, 1) for _, size in per_doc[d])
    assert [size for _, size in per_doc[2]] == [300] and [size for _, size in per_doc[3]] == [100]


def test_tiny_empty_and_padding_only():
    plan = plan_cp_shards([0, 1, 0, 2], 3)
    _check_plan(plan, [0, 1, 0, 2], 0, 3)
    only_pad = plan_cp_shards([], 4, pad=8)
    _check_plan(only_pad, [], 8, 4)
    assert only_pad.causal_work == (0, 0, 0, 0) and only_pad.imbalance == 1.0


def test_unshard_round_trips():
    plan = plan_cp_shards([900, 1500, 300, 77], 4, chunk=64, pad=3)
    row = torch.randn(2, plan.seq_len, 5)
    parts = [plan.gather(row, r, dim=1) for r in range(4)]
    assert all(p.shape[1] == plan.local_len for p in parts)
    assert torch.equal(plan.unshard(parts, dim=1), row)
    with pytest.raises(ValueError, match="one tensor per rank"):
        plan.unshard(parts[:3])


def test_errors_and_padding():
    grown = plan_cp_shards([5, 4], 4)  # the row is padded to a multiple of W
    assert (grown.pad, grown.seq_len, grown.local_len) == (3, 12, 3)
    assert sorted(grown.permutation.tolist()) == list(range(12))
    with pytest.raises(ValueError, match="sharding must be one of"):
        plan_cp_shards([8], 2, sharding="zigzag")
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        plan_cp_shards([8], 2, chunk=0)
    with pytest.raises(ValueError, match="non-negative"):
        plan_cp_shards([8, -1], 1)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_cp_shards([8], 0)


@pytest.mark.parametrize(
    "doc_lens",
    [[1.5, 2], torch.tensor([3.7, 1.2]), "123", [True, 3], [[1, 2]], torch.tensor([[2, 2]]), None],
    ids=["float", "float-tensor", "str", "bool", "nested", "2d-tensor", "none"],
)
def test_non_integer_doc_lens_are_refused(doc_lens):
    """A length int() would truncate (1.5 -> 1) planned a row of a different length; now a ValueError naming it."""
    with pytest.raises(ValueError, match="doc_lens must be document lengths"):
        plan_cp_shards(doc_lens, 2)


def test_integer_doc_lens_of_any_container():
    for doc_lens in ([3, 4], (3, 4), torch.tensor([3, 4], dtype=torch.int32)):
        assert plan_cp_shards(doc_lens, 2).doc_lens == (3, 4)
    assert plan_cp_shards(torch.tensor([]), 2, pad=2).seq_len == 2


def test_gather_and_unshard_refuse_wrong_lengths():
    """Parts of the wrong length that still sum to the row, and a row of the wrong length, are errors, not rows
    silently assigned to the wrong positions."""
    plan = plan_cp_shards([5, 300, 7], 2, chunk=2)
    row = torch.arange(float(plan.seq_len))
    parts = [plan.gather(row, r, dim=0) for r in range(2)]
    with pytest.raises(ValueError, match="local rows along dim 0, got 157 for rank 0"):
        plan.unshard([torch.cat([parts[0], parts[1][:1]]), parts[1][1:]], dim=0)
    for wrong in (row[:-1], torch.cat([row, row[:1]])):
        with pytest.raises(ValueError, match="whole padded row"):
            plan.gather(wrong, 1, dim=0)
