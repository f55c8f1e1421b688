"""The shipped corpus: chapters (the tiny demo's documents, unchanged) or whole books, and the row packer."""

from __future__ import annotations

import pytest
import torch

from longtrain.corpus import DOCUMENTS, IGNORE_INDEX, PackedStream, load_documents


def test_chapters_are_unchanged():
    chapters = load_documents()
    assert chapters == load_documents("chapters")
    assert len(chapters) == 135 and chapters[0].startswith(b"Genesis 1\nIn the beginning")
    assert min(map(len, chapters)) == 503 and max(map(len, chapters)) == 9190


def test_books_join_their_chapters_in_order():
    chapters, books = load_documents("chapters"), load_documents("books")
    assert len(books) == 8
    assert [b.split(b"\n", 1)[0] for b in books] == [
        b"Genesis 1", b"Ruth 1", b"Esther 1", b"Proverbs 1", b"Ecclesiastes 1", b"Song of Solomon 1", b"Jonah 1",
        b"Mark 1",
    ]  # fmt: skip
    assert b"\n\n".join(books) == b"\n\n".join(chapters)
    assert min(map(len, books)) == 6663 and max(map(len, books)) == 197407  # Jonah, Genesis


def test_unknown_documents_kind():
    assert DOCUMENTS == ("chapters", "books")
    with pytest.raises(ValueError, match="chapters"):
        load_documents("verses")


def test_book_rows_span_hundreds_to_thousands_of_tokens():
    """The h200-32k rows: documents from a few hundred tokens to more than any chapter, padding at most 256."""
    stream = PackedStream(32768, seed=0, min_doc=256, max_doc=32768 // 3, documents="books", max_pad=256)
    lengths, pads = [], []
    for _ in range(12):
        row = stream.next_row()
        counts = torch.bincount(row.doc_ids, minlength=1)
        lengths += counts[1:].tolist()
        pads.append(int(counts[0]))
        assert int((row.labels != IGNORE_INDEX).sum()) == sum(counts[1:].tolist()) - row.num_documents
    assert min(lengths) < 1000 and max(lengths) > 9190
    assert max(pads) <= 256


def test_default_padding_rule_is_unchanged():
    """Without max_pad a gap under a quarter of the row stays padding (the tiny demo's rows are as before)."""
    stream = PackedStream(2048, seed=0, max_doc=2048 // 3)
    assert stream.fill_from == 512
    pads = [int((stream.next_row().doc_ids == 0).sum()) for _ in range(20)]
    assert max(pads) < 512 and sum(pads) > 0
    with pytest.raises(ValueError, match="max_pad"):
        PackedStream(64, max_pad=-1)


@pytest.mark.parametrize(
    "seq_len, kwargs",
    [(256, {"max_doc": 5000, "max_pad": 1000}), (256, {"min_doc": 300, "max_doc": 400})],
    ids=["max-pad-over-row", "min-doc-over-row"],
)
def test_a_row_is_never_all_padding(seq_len, kwargs):
    """A first span longer than the row is truncated to the row even when the gap rule would drop it: an all-padding
    row has no label, and its loss is 0 / 0 = NaN."""
    stream = PackedStream(seq_len, seed=0, **kwargs)
    for _ in range(20):
        row = stream.next_row()
        assert row.num_documents >= 1
        assert int((row.labels != IGNORE_INDEX).sum()) >= 1


@pytest.mark.parametrize("documents, shortest", [("chapters", 503), ("books", 6663)], ids=["chapters", "books"])
def test_min_doc_longer_than_a_document_is_refused_up_front(documents, shortest):
    """A span never exceeds its document: min_doc above the shortest document is a clear ValueError at construction,
    not 'empty range for randrange()' at whichever row first draws that document."""
    assert min(len(d) for d in load_documents(documents)) == shortest
    PackedStream(32768, min_doc=shortest, max_doc=32768, documents=documents)
    with pytest.raises(ValueError, match=f"min_doc={shortest + 1} is longer than the shortest {documents} document"):
        PackedStream(32768, min_doc=shortest + 1, max_doc=32768, documents=documents)
