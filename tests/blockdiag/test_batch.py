"""``make_cp_blockdiag_batch_and_ctx`` in one process (the group's world size is stubbed): the worked example,
semantic fills, document-id sources, validation before mutation and the step context."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import (
    BlockdiagCpModelState,
    CPStep,
    ShardLayout,
    current_blockdiag_cp_state,
    make_cp_blockdiag_batch_and_ctx,
    state,
)
from longtrain.blockdiag_cp import batch as batch_mod
from tests.blockdiag._cp_model import FakeMesh


@pytest.fixture
def group_world(monkeypatch):
    """``group_world(n)`` makes ``torch.distributed.get_world_size`` answer ``n``."""

    def set_world(n: int) -> None:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: n)

    return set_world


def _shard(batch, world, rank, **kw):
    return make_cp_blockdiag_batch_and_ctx(FakeMesh(world, rank), None, batch, **kw)


def test_worked_example(group_world):
    group_world(2)
    emb = torch.randn(1, 5, 3)
    batch = {
        "inputs_embeds": emb,
        "labels": torch.arange(5)[None],
        "_packed_seq_ids": torch.tensor([[1, 1, 2, 0, 0]]),
        "attention_mask": torch.ones(1, 5),
    }
    factory, out, layout = _shard(batch, 2, 1)
    assert out is batch and layout == ShardLayout(original_seq_len=5, padded_seq_len=8)
    assert "attention_mask" not in batch
    assert batch["padding_mask"].tolist() == [[True, True, True, True]]
    assert batch["labels"].tolist() == [[4, -100, -100, -100]]
    assert batch["_packed_seq_ids"].tolist() == [[0, 0, 0, 0]]
    torch.testing.assert_close(batch["inputs_embeds"][:, :1], emb[:, 4:5], rtol=0, atol=0)
    assert torch.equal(batch["inputs_embeds"][:, 1:], torch.zeros(1, 3, 3))
    assert state._CP_BLOCKDIAG_STATE.get() is None
    with factory() as published:
        step = state._CP_BLOCKDIAG_STATE.get()
        assert isinstance(step, CPStep) and published is step and layout.step is step
        assert step.doc_ids.tolist() == [[1, 1, 2, 0, 0, 0, 0, 0]]
        assert step.packed_cu_seqlens.tolist() == [0, 2, 3, 8]
        assert step.varlen_meta.n_real == 0 and step.row_offset == 4 and step.local_len == 4
        assert (step.rank, step.world_size) == (1, 2)
        assert step.attn_backend == state.cp_varlen_runtime_config()["attn_backend"]
        ms = current_blockdiag_cp_state()
        assert isinstance(ms, BlockdiagCpModelState)
        assert ms.packed_cu_seqlens is step.packed_cu_seqlens
        assert ms.packed_cu_seqlens_cpu is step.packed_cu_seqlens_cpu and ms.group is step.group
        assert torch.utils.checkpoint._enable_checkpoint_early_stop is False
    assert state._CP_BLOCKDIAG_STATE.get() is None and current_blockdiag_cp_state() is None
    assert torch.utils.checkpoint._enable_checkpoint_early_stop is None
    # a fresh context manager per call
    assert factory() is not factory()


def test_shard_primary_false_keeps_primary_and_shards_mrope_positions(group_world):
    group_world(2)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pos = torch.arange(15).view(3, 1, 5)
    batch = {"input_ids": ids, "position_ids": pos}
    _, out, _ = _shard(batch, 2, 0, shard_primary=False)
    assert out["input_ids"] is ids
    assert out["position_ids"].tolist() == [[[0, 1, 2, 3]], [[5, 6, 7, 8]], [[10, 11, 12, 13]]]
    _, out, _ = _shard({"input_ids": ids, "position_ids": pos}, 2, 1, shard_primary=False)
    assert out["position_ids"].tolist() == [[[4, 0, 0, 0]], [[9, 0, 0, 0]], [[14, 0, 0, 0]]]
    # a model that shards its own hidden states takes one range per rank: a balanced plan of pieces is refused
    # before the batch is touched
    batch = {"input_ids": ids, "position_ids": pos}
    with pytest.raises(ValueError, match="shard_primary=False .* sharding is balanced"):
        _shard(batch, 2, 0, shard_primary=False, sharding="balanced", shard_chunk=1)
    assert batch["input_ids"] is ids and batch["position_ids"] is pos


def test_semantic_fills_and_loss_mask(group_world):
    group_world(3)
    s = 7  # S_full = 12, L = 4: rank 1 holds rows 4..7, the last one padding
    batch = {
        "input_ids": torch.arange(1, s + 1)[None],
        "labels": torch.arange(s)[None],
        "position_ids": torch.arange(s)[None],
        "visual_pos_masks": torch.ones(1, s, dtype=torch.bool),
        "pixel_values": torch.randn(2, 3),
    }
    loss_mask = torch.ones(1, s, dtype=torch.int64)
    pixels = batch["pixel_values"]
    _, out, layout = _shard(batch, 3, 1, loss_mask=loss_mask, padding_token_id=-7)
    assert layout.padded_seq_len == 12
    assert out["input_ids"].tolist() == [[5, 6, 7, -7]]
    assert out["labels"].tolist() == [[4, 5, 6, -100]]
    assert out["position_ids"].tolist() == [[4, 5, 6, 0]]
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0]]
    assert out["padding_mask"].tolist() == [[False, False, False, True]]
    assert out["visual_pos_masks"].tolist() == [[True, True, True, False]]
    assert out["pixel_values"] is pixels  # not sequence-aligned: untouched


@pytest.mark.parametrize("mesh", ["none", "one_rank"])
def test_world_one_is_the_same_path_without_padding(mesh):
    ids = torch.arange(1, 10)[None]
    batch = {"input_ids": ids, "attention_mask": torch.ones(1, 9), "_packed_seq_ids": torch.tensor([[1] * 4 + [2] * 5])}
    cp_mesh = None if mesh == "none" else FakeMesh(1, 0)
    factory, out, layout = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch)
    assert out is batch and layout == ShardLayout(9, 9) and "attention_mask" not in batch
    assert batch["input_ids"].tolist() == ids.tolist() and batch["padding_mask"].tolist() == [[False] * 9]
    with factory() as step:
        assert (step.world_size, step.rank, step.row_offset, step.local_len, step.kv_plan) == (1, 0, 0, 9, None)
        assert step.varlen_meta.seg_q == (4, 5) and current_blockdiag_cp_state() == step.model_state
    # B != 1 and a batch without a primary stream are the same clear errors as with more ranks
    with pytest.raises(ValueError, match="local_batch_size=1"):
        make_cp_blockdiag_batch_and_ctx(cp_mesh, None, {"input_ids": torch.ones(2, 9, dtype=torch.int64)})
    with pytest.raises(ValueError, match="exactly one of"):
        make_cp_blockdiag_batch_and_ctx(cp_mesh, None, {"labels": torch.ones(1, 3)})


def _snapshot(batch: dict) -> dict:
    return {k: (v, v.clone()) if isinstance(v, torch.Tensor) else (v, v) for k, v in batch.items()}


def _unchanged(batch: dict, snap: dict) -> bool:
    if batch.keys() != snap.keys():
        return False
    for k, (obj, copy) in snap.items():
        if batch[k] is not obj:
            return False
        if isinstance(copy, torch.Tensor) and not copy.is_meta and not torch.equal(obj, copy):  # meta: no data
            return False
    return True


def _valid():
    return {
        "input_ids": torch.arange(10)[None],
        "labels": torch.arange(10)[None],
        "_packed_seq_ids": torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0]]),
        "attention_mask": torch.ones(1, 10),
    }


@pytest.mark.parametrize(
    "mutate, world, exc, match",
    [
        (lambda b: b.update(input_ids=torch.zeros(2, 10, dtype=torch.int64)), 2, ValueError, "local_batch_size=1"),
        (lambda b: None, 3, RuntimeError, "cp_mesh.size"),
        (lambda b: b.update(inputs_embeds=torch.zeros(1, 10, 4)), 2, ValueError, "exactly one of"),
        (lambda b: b.pop("input_ids"), 2, ValueError, "exactly one of"),
        (lambda b: b.update(_packed_seq_ids=torch.ones(1, 9, dtype=torch.int64)), 2, ValueError, "shape"),
        (lambda b: b.update(_packed_seq_ids=torch.ones(1, 10)), 2, TypeError, "integer"),
        # a bool row has no document ids: [True] * n read as one document would merge every document of the row
        (lambda b: b.update(_packed_seq_ids=torch.ones(1, 10, dtype=torch.bool)), 2, TypeError, "integer"),
        (lambda b: b.update(_packed_seq_ids=torch.ones(1, 10, dtype=torch.long, device="meta")), 2, ValueError, "meta"),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 3, 5, 8], device="meta")), 2, ValueError, "meta"),
        (lambda b: b.update(_packed_seq_ids=torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])), 2, ValueError, "tail"),
        (lambda b: b.update(_packed_seq_ids=torch.tensor([[1, 1, 2, 2, 1, 1, 3, 3, 0, 0]])), 2, ValueError, "runs"),
        (lambda b: b.update(labels=torch.arange(9)[None]), 2, ValueError, "labels"),
        (lambda b: b.update(position_ids=torch.zeros(3, 2, 10, dtype=torch.int64)), 2, ValueError, "position_ids"),
        # an IndexError before
        (lambda b: b.clear() or b.update(input_ids=torch.zeros(1, 0, dtype=torch.int64)), 2, ValueError, "empty row"),
    ],
    ids=[
        "batch2",
        "group_world",
        "two_primaries",
        "no_primary",
        "ids_shape",
        "float_ids",
        "bool_ids",
        "meta_ids",
        "meta_offsets",
        "left_padding",
        "split_document",
        "labels_len",
        "mrope_batch",
        "empty_row",
    ],
)
def test_invalid_batches_raise_and_leave_the_batch_unchanged(group_world, mutate, world, exc, match):
    group_world(world)
    mesh_world = 2
    batch = _valid()
    mutate(batch)
    snap = _snapshot(batch)
    with pytest.raises(exc, match=match):
        _shard(batch, mesh_world, 1)
    assert _unchanged(batch, snap)


def test_loss_mask_shape_is_validated(group_world):
    group_world(2)
    batch = _valid()
    snap = _snapshot(batch)
    with pytest.raises(ValueError, match="loss_mask"):
        _shard(batch, 2, 0, loss_mask=torch.ones(1, 4))
    assert _unchanged(batch, snap)


def test_doc_ids_sources(monkeypatch):
    monkeypatch.setattr(batch_mod, "_MASK_ROWS", 4)  # a 4-D mask's rows checked a block at a time
    s = 6
    f = batch_mod._cp_blockdiag_doc_ids
    assert f({}, s, "cpu", 1).tolist() == [[1] * s]
    assert f({"attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}, s, "cpu", 1).tolist() == [[1, 1, 1, 1, 0, 0]]
    ids = torch.tensor([1, 1, 2, 2, 2, 0])
    pos = torch.arange(s)
    allow = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0) & (pos[:, None] >= pos[None, :])
    for mask in (allow, allow.float(), torch.where(allow, 0.0, float("-inf"))):
        got = f({"attention_mask": mask[None, None]}, s, "cpu", 1)
        assert got.tolist() == [ids.tolist()], mask.dtype
    explicit = torch.tensor([[3, 3, 4, 4, 4, 0]])
    assert f({"_packed_seq_ids": explicit, "attention_mask": allow[None, None]}, s, "cpu", 1).tolist() == [
        [3, 3, 4, 4, 4, 0]
    ]


@pytest.mark.parametrize("kind", ["sliding_window", "bidirectional", "extra_key", "one_head_differs"])
def test_a_4d_mask_other_than_per_document_causal_is_refused(kind, monkeypatch):
    """The CP step computes per-document causal attention: a 4-D mask that is anything else on a real row (a
    window, a bidirectional span, a key of another document, heads that differ) is a ValueError, never recomputed as
    the causal documents on its diagonal."""
    monkeypatch.setattr(batch_mod, "_MASK_ROWS", 3)  # the rows checked a block at a time, the last one shorter
    s = 8
    tril = torch.ones(s, s, dtype=torch.bool).tril()
    ids = torch.tensor([1, 1, 1, 2, 2, 2, 2, 2])
    causal = (ids[:, None] == ids[None, :]) & tril
    mask = {
        "sliding_window": tril & ~torch.ones(s, s, dtype=torch.bool).tril(-3),
        "bidirectional": ids[:, None] == ids[None, :],
        "extra_key": causal | (torch.arange(s)[:, None] == 6) & (torch.arange(s)[None, :] == 1),
    }.get(kind)
    mask = (
        mask[None, None]
        if mask is not None
        else torch.stack([causal, causal & ~torch.eye(s, dtype=torch.bool).roll(1, 0)])[None]
    )
    with pytest.raises(ValueError, match="is not per-document causal"):
        batch_mod._cp_blockdiag_doc_ids({"attention_mask": mask}, s, "cpu", 1)
    for style in (mask.float(), torch.where(mask, 0.0, float("-inf"))):
        with pytest.raises(ValueError, match="is not per-document causal"):
            batch_mod._cp_blockdiag_doc_ids({"attention_mask": style}, s, "cpu", 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(2, 5), st.integers(0, 8))
def test_shards_concatenate_to_the_padded_sequence(seq_len, world, n_pad):
    n_pad = min(n_pad, seq_len - 1)
    ids = torch.tensor([[1 + i // 3 for i in range(seq_len - n_pad)] + [0] * n_pad])
    emb = torch.randn(1, seq_len, 2)
    full_len = seq_len + (-seq_len) % (2 * world)
    pieces, masks = [], []
    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: world
    try:
        for rank in range(world):
            _, out, layout = _shard({"inputs_embeds": emb, "_packed_seq_ids": ids}, world, rank)
            assert layout == ShardLayout(seq_len, full_len)
            x = out["inputs_embeds"]
            assert x.shape == (1, full_len // world, 2)
            if (rank + 1) * (full_len // world) <= seq_len:
                assert x.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()  # a view, no copy
            pieces.append(x)
            masks.append(out["padding_mask"])
    finally:
        dist.get_world_size = orig
    want = torch.cat([emb, torch.zeros(1, full_len - seq_len, 2)], dim=1)
    assert torch.equal(torch.cat(pieces, dim=1), want)
    want_mask = torch.cat([ids == 0, torch.ones(1, full_len - seq_len, dtype=torch.bool)], dim=1)
    assert torch.equal(torch.cat(masks, dim=1), want_mask)


def test_inputs_embeds_shard_is_differentiable(group_world):
    group_world(2)
    emb = torch.randn(1, 5, 3, requires_grad=True)
    for rank in range(2):
        _, out, _ = _shard({"inputs_embeds": emb}, 2, rank)
        out["inputs_embeds"].sum().backward()
    assert torch.equal(emb.grad, torch.ones_like(emb))


def test_deepstack_visual_embeds_are_sliced(group_world):
    group_world(2)
    vmask = torch.tensor([[False, True, True, False, True, True, False]])  # S=7 -> S_full=8, L=4
    embeds = [torch.arange(4.0)[:, None].expand(4, 2), 10 + torch.arange(4.0)[:, None].expand(4, 2)]
    batch = {"input_ids": torch.ones(1, 7, dtype=torch.int64), "visual_pos_masks": vmask}
    batch["_deepstack_visual_embeds"] = list(embeds)
    _, out, _ = _shard(batch, 2, 1)
    assert [e[:, 0].tolist() for e in out["_deepstack_visual_embeds"]] == [[2.0, 3.0], [12.0, 13.0]]
    assert out["visual_pos_masks"].tolist() == [[True, True, False, False]]


def test_nested_contexts_restore_the_outer_state(group_world):
    group_world(2)
    f1, _, _ = _shard(_valid(), 2, 0)
    f2, _, _ = _shard(_valid(), 2, 1)
    with f1():
        outer = state._CP_BLOCKDIAG_STATE.get()
        with f2():
            assert state._CP_BLOCKDIAG_STATE.get().row_offset == 6
        assert state._CP_BLOCKDIAG_STATE.get() is outer
    assert state._CP_BLOCKDIAG_STATE.get() is None


@pytest.mark.parametrize("sharding", ["contiguous", "balanced"])
def test_unshard_refuses_parts_that_are_not_the_ranks_rows(group_world, sharding):
    """``layout.unshard`` on tensors whose ``dim`` is not the rank's ``L`` rows (a hidden state ``[L, H]`` with the
    default ``dim=1``, a full-row tensor) is a ``ValueError`` on both plans, not rows of the wrong axis."""
    group_world(2)
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0]])  # S = 10 -> padded 12, L = 6
    layouts = [
        _shard({"input_ids": torch.arange(10)[None], "_packed_seq_ids": ids.clone()}, 2, r, sharding=sharding)[2]
        for r in range(2)
    ]
    hidden = torch.arange(12.0)[:, None] * 10 + torch.arange(8.0)  # [S_full, H]: row p holds 10 p + h
    parts = [layouts[0].step.shard_plan.gather(hidden, r, dim=0) for r in range(2)]  # [L, H] per rank
    assert torch.equal(layouts[0].unshard(parts, dim=0), hidden[:10])
    assert torch.equal(layouts[0].unshard([p[None] for p in parts]), hidden[None, :10])
    with pytest.raises(ValueError, match="local rows of rank 0 along dim"):
        layouts[0].unshard(parts)  # dim=1 is H here
    with pytest.raises(ValueError, match="local rows of rank 0 along dim"):
        layouts[0].unshard([hidden, hidden], dim=0)
