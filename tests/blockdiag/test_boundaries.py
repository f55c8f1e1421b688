"""Document boundaries the ecosystem's way: ``_packed_seq_ids``, then ``cu_seq_lens_q``/``cu_seqlens``, then restarting
``position_ids`` (mRoPE: the first plane), then ``attention_mask``, then one document; disagreeing sources are a
``ValueError`` before the batch is touched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import batch as batch_mod
from longtrain.blockdiag_cp import make_cp_blockdiag_batch_and_ctx

IDS = [1, 1, 1, 2, 2, 3, 3, 3, 0, 0]
POS = [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
CU = [0, 3, 5, 8]


# Three documents; the second opens with a 2x2-patch image (temporal 0 four times), then one text token.
MROPE_TEXT = [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
MROPE_THW = [
    [0, 1, 2, 0, 0, 0, 0, 2, 0, 1],  # temporal
    [0, 1, 2, 0, 0, 1, 1, 2, 0, 1],  # height
    [0, 1, 2, 0, 1, 0, 1, 2, 0, 1],  # width
]


def _ids(batch: dict) -> list[int]:
    return batch_mod._cp_blockdiag_doc_ids(batch, len(IDS), torch.device("cpu"), 1)[0].tolist()


def _mask(ids=IDS):
    return torch.tensor([[int(i > 0) for i in ids]])


@pytest.mark.parametrize(
    "batch, want",
    [
        ({"_packed_seq_ids": torch.tensor([IDS])}, IDS),
        ({"cu_seq_lens_q": torch.tensor(CU, dtype=torch.int32)}, IDS),
        ({"cu_seqlens": torch.tensor(CU)}, IDS),
        ({"position_ids": torch.tensor([POS]), "attention_mask": _mask()}, IDS),
        # float position ids restart documents as integer ones do (the rule every reader shares)
        ({"position_ids": torch.tensor([POS], dtype=torch.float32), "attention_mask": _mask()}, IDS),
        ({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 0, 1]])}, [1, 1, 1, 2, 2, 3, 3, 3, 4, 4]),
        ({"position_ids": torch.stack([torch.tensor([POS])] * 3), "attention_mask": _mask()}, IDS),  # mRoPE
        # transformers' packed mRoPE layout: text positions first, then temporal/height/width (an image of 2x2
        # patches opens the second document: temporal 0 four times)
        (
            {"position_ids": torch.tensor([[MROPE_TEXT], *([p] for p in MROPE_THW)])},
            [1, 1, 1, 2, 2, 2, 2, 2, 3, 3],
        ),
        # a jump starts a document as a restart does (Hugging Face's rule: the position does not grow by 1)
        ({"position_ids": torch.tensor([[0, 1, 2, 7, 8, 9, 0, 1, 5, 6]])}, [1, 1, 1, 2, 2, 2, 3, 3, 4, 4]),
        ({"position_ids": torch.tensor([[1, 2, 3, 1, 2, 1, 2, 3, 4, 5]])}, [1, 1, 1, 2, 2, 3, 3, 3, 3, 3]),
        ({"position_ids": torch.arange(10)[None], "attention_mask": _mask()}, [1] * 8 + [0, 0]),  # no restart
        ({"attention_mask": _mask()}, [1] * 8 + [0, 0]),
        ({"attention_mask": torch.tensor([IDS])}, IDS),  # an id-valued 2-D mask
        ({}, [1] * 10),
        # sources that agree: the first one wins, the others are checked
        (
            {
                "_packed_seq_ids": torch.tensor([IDS]),
                "cu_seq_lens_q": torch.tensor(CU),
                "position_ids": torch.tensor([POS]),
                "attention_mask": _mask(),
            },
            IDS,
        ),  # fmt: skip
        (
            {"_packed_seq_ids": torch.tensor([[5, 5, 5, 7, 7, 9, 9, 9, 0, 0]]), "position_ids": torch.tensor([POS])},
            [5, 5, 5, 7, 7, 9, 9, 9, 0, 0],
        ),  # fmt: skip
        # ids may mark more padding than an all-ones mask (the mask knows nothing of the packer's tail)
        ({"_packed_seq_ids": torch.tensor([IDS]), "attention_mask": torch.ones(1, 10)}, IDS),
    ],
    ids=[
        "ids",
        "cu_seq_lens_q",
        "cu_seqlens",
        "position_ids+mask",
        "float_position_ids+mask",
        "position_ids_only",
        "mrope",
        "mrope_text_plane_first",
        "positions_jump",
        "positions_from_one",
        "positions_no_restart",
        "mask_01",
        "mask_ids",
        "nothing",
        "all_agree",
        "ids_values_kept",
        "ids_pad_over_ones_mask",
    ],  # fmt: skip
)
def test_sources_and_precedence(batch, want):
    assert _ids(batch) == want


@pytest.mark.parametrize(
    "batch, match",
    [
        (
            {"_packed_seq_ids": torch.tensor([IDS]), "position_ids": torch.tensor([[0, 1, 0, 1, 2, 0, 1, 2, 3, 4]])},
            r"position 2 .*'_packed_seq_ids'\] continues the document, batch\['position_ids'\] does not",
        ),
        (
            {"_packed_seq_ids": torch.tensor([IDS]), "cu_seq_lens_q": torch.tensor([0, 3, 8])},
            r"position 5 .*'_packed_seq_ids'\] starts a new document, batch\['cu_seq_lens_q'\] does not",
        ),
        (
            {"cu_seqlens": torch.tensor(CU), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4]])},
            r"position 3 .*'cu_seqlens'\] starts",
        ),
        (
            {"_packed_seq_ids": torch.tensor([IDS]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])},
            r"attention_mask'\] marks position 7 .* as padding",
        ),
        (
            {"cu_seq_lens_q": torch.tensor([0, 3, 8]), "cu_seqlens": torch.tensor([0, 5, 8])},
            r"position 3 .*'cu_seq_lens_q'",
        ),
        ({"cu_seq_lens_q": torch.tensor(CU), "cu_seq_lens_k": torch.tensor([0, 3, 8])}, r"'cu_seq_lens_k'\] does not"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 5, 10])}, None),  # no padding marked: ok
        ({"cu_seq_lens_q": torch.tensor([0, 3, 5, 10]), "attention_mask": _mask()}, r"marks position 8"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 2, 8])}, r"non-decreasing"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 11])}, r"at most the row length 10"),
        ({"cu_seq_lens_q": torch.tensor([[0, 3, 8]])}, r"1-D integer offsets"),
    ],  # fmt: skip
    ids=[
        "ids_vs_positions",
        "ids_vs_cu",
        "cu_vs_positions",
        "mask_pads_a_real_token",
        "cu_q_vs_cu_seqlens",
        "cu_q_vs_cu_k",
        "cu_ok",
        "cu_vs_mask",
        "cu_decreasing",
        "cu_too_long",
        "cu_2d",
    ],  # fmt: skip
)
def test_disagreeing_sources_raise_before_the_batch_is_touched(monkeypatch, batch, match):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    from tests.blockdiag._cp_model import FakeMesh

    full = {"input_ids": torch.arange(10)[None], "labels": torch.arange(10)[None], **batch}
    snapshot = {k: (v, v.clone()) for k, v in full.items()}
    if match is None:
        make_cp_blockdiag_batch_and_ctx(FakeMesh(2, 0), None, full)
        assert "cu_seq_lens_q" not in full  # the step carries the boundaries; the row's offsets are dropped
        return
    with pytest.raises(ValueError, match=match):
        make_cp_blockdiag_batch_and_ctx(FakeMesh(2, 0), None, full)
    assert full.keys() == snapshot.keys()
    assert all(full[k] is obj and torch.equal(obj, copy) for k, (obj, copy) in snapshot.items())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(0, 4))
def test_every_source_gives_the_same_documents(lengths, pad):
    ids = [d + 1 for d, n in enumerate(lengths) for _ in range(n)] + [0] * pad
    pos = [p for n in lengths for p in range(n)] + list(range(pad))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    s = len(ids)
    f = batch_mod._cp_blockdiag_doc_ids
    mask = torch.tensor([[int(i > 0) for i in ids]])
    want = [ids]
    assert f({"_packed_seq_ids": torch.tensor([ids])}, s, "cpu", 1).tolist() == want
    assert f({"cu_seq_lens_q": torch.tensor(cu)}, s, "cpu", 1).tolist() == want
    got = f({"position_ids": torch.tensor([pos]), "attention_mask": mask}, s, "cpu", 1)
    assert got.tolist() == want
    both = {"_packed_seq_ids": torch.tensor([ids]), "cu_seq_lens_q": torch.tensor(cu), "position_ids":
            torch.tensor([pos]), "attention_mask": mask}  # fmt: skip
    assert f(both, s, "cpu", 1).tolist() == want


def test_three_plane_mrope_with_vision_at_a_document_start_is_refused():
    """Without the text plane, a document that opens with vision tokens repeats temporal position 0 while the spatial
    planes move: a restart of the first plane would make every patch a document, so it is a clear error."""
    with pytest.raises(ValueError, match=r"temporal plane is 0 again.*\[4, B, S\]"):
        _ids({"position_ids": torch.tensor([[p] for p in MROPE_THW])})
    # the same planes with a one-token text document before each restart are fine: equal planes never move
    assert _ids({"position_ids": torch.tensor([[[0, 0, 1, 0, 1, 2, 0, 1, 2, 3]]] * 3)}) == [
        1,
        2,
        2,
        3,
        3,
        3,
        4,
        4,
        4,
        4,
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=1, max_size=24), st.integers(1, 3))
def test_every_reader_of_position_ids_finds_the_same_documents(positions, batch_size):
    """The batch builder, the Hugging Face attention's ``packed_doc_ids`` and torchtitan's ``varlen_masks`` read
    position ids with one rule (``longtrain.packing.doc_starts_from_positions``): the same documents, any ids."""
    from longtrain.integrations.hf_blockdiag import packed_doc_ids
    from longtrain.integrations.torchtitan import varlen_masks

    pos = torch.tensor([positions] * batch_size)
    seq = pos.shape[1]
    builder = batch_mod._ids_from_positions(pos, seq, batch_size)
    hf_ids = packed_doc_ids(batch_size, seq, position_ids=pos)
    cu = varlen_masks(pos).cu_seq_q.tolist()
    titan = torch.zeros(batch_size * seq, dtype=torch.int64)
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        titan[a:b] = d
    for r in range(batch_size):
        starts = [bool(i == 0 or builder[r, i] != builder[r, i - 1]) for i in range(seq)]
        assert starts == [bool(i == 0 or hf_ids[r, i] != hf_ids[r, i - 1]) for i in range(seq)]
        assert starts == [bool(i == 0 or titan[r * seq + i] != titan[r * seq + i - 1]) for i in range(seq)]
