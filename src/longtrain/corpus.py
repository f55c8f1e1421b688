"""The demo's data: a small public-domain corpus shipped in the package, byte-level tokens, packed rows.

Token ids are ``byte + 1`` (vocabulary 257); id 0 is padding and never occurs in text. A packed row holds
several document spans back to back, then a padding tail:

- ``input_ids``        ``[S]`` int64, the tokens (0 in the padding tail);
- ``labels``           ``[S]`` int64, pre-shifted next tokens inside a document, -100 on each document's last
  token and on padding (no label crosses a document boundary);
- ``position_ids``     ``[S]`` int64, positions restarting at 0 in every document;
- ``_packed_seq_ids``  ``[S]`` int64, document ids 1, 2, ... in order, 0 on padding.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from importlib import resources

import torch

VOCAB_SIZE = 257
PAD_ID = 0
IGNORE_INDEX = -100
_CORPUS = "kjv_selection.txt"
#: What one document of :func:`load_documents` is: a chapter (135 documents of 0.5K to 9.2K bytes, median 3K), or a
#: book, its chapters joined in order (8 documents of 6.7K to 197K bytes).
DOCUMENTS = ("chapters", "books")


def load_documents(documents: str = "chapters") -> list[bytes]:
    """The shipped corpus as a list of documents (UTF-8 bytes), one per chapter or one per book (see
    :data:`DOCUMENTS`). Every chapter starts with its title line (``Genesis 1``); a book joins its chapters with a
    blank line."""
    if documents not in DOCUMENTS:
        raise ValueError(f"documents must be one of {list(DOCUMENTS)}, got {documents!r}")
    text = resources.files("longtrain.data").joinpath(_CORPUS).read_bytes()
    chapters = [d.strip() for d in text.split(b"\n\f\n") if d.strip()]
    if documents == "chapters":
        return chapters
    books: dict[bytes, list[bytes]] = {}
    for chapter in chapters:
        title = chapter.split(b"\n", 1)[0]
        books.setdefault(title.rsplit(b" ", 1)[0], []).append(chapter)
    return [b"\n\n".join(parts) for parts in books.values()]


@functools.cache
def shortest_document(documents: str = "chapters") -> int:
    """Tokens in the shortest document of :func:`load_documents` (``documents``); a span never exceeds its document,
    so ``min_doc`` may not either."""
    return min(len(d) for d in load_documents(documents))


@dataclass(frozen=True)
class PackedRow:
    """One packed training row; every tensor is ``[S]`` int64 (see the module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor

    @property
    def num_documents(self) -> int:
        return int(self.doc_ids.max().item())

    def as_batch(self) -> dict[str, torch.Tensor]:
        """A ``[1, S]`` batch dict in the layout ``make_cp_blockdiag_batch_and_ctx`` expects."""
        return {
            "input_ids": self.input_ids[None].clone(),
            "labels": self.labels[None].clone(),
            "position_ids": self.position_ids[None].clone(),
            "_packed_seq_ids": self.doc_ids[None].clone(),
        }


def pack_row(spans: list[bytes], seq_len: int) -> PackedRow:
    """Pack document spans (each at least 2 bytes) back to back into one row of ``seq_len`` tokens."""
    if sum(len(s) for s in spans) > seq_len:
        raise ValueError(f"spans hold {sum(len(s) for s in spans)} tokens, more than seq_len={seq_len}")
    input_ids = torch.full((seq_len,), PAD_ID, dtype=torch.long)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    doc_ids = torch.zeros(seq_len, dtype=torch.long)
    pos = 0
    for i, span in enumerate(spans, start=1):
        n = len(span)
        if n < 2:
            raise ValueError(f"document span {i} has {n} token(s); spans need at least 2 (one input, one label)")
        toks = torch.tensor(list(span), dtype=torch.long) + 1
        input_ids[pos : pos + n] = toks
        labels[pos : pos + n - 1] = toks[1:]
        position_ids[pos : pos + n] = torch.arange(n)
        doc_ids[pos : pos + n] = i
        pos += n
    return PackedRow(input_ids, labels, position_ids, doc_ids)


class PackedStream:
    """An endless, seeded stream of packed rows cut from the corpus.

    Each row takes document spans of random length in ``[min_doc, max_doc]`` (a random window of a random
    document: a chapter, or a book with ``documents="books"``) until the next span would not fit, then pads the
    tail, so every row has several documents of varied length and (almost always) some padding. A span never
    exceeds its document, so chapters give spans of at most 9.2K tokens and books reach ``max_doc``. A gap longer
    than ``max_pad`` tokens at the end of a row takes a truncated span (None: gaps of ``max(min_doc, seq_len // 4)``
    or more do, so up to a quarter of a row may be padding). A row is never all padding: when not even its first span
    fits, that span is truncated to the row. ``min_doc`` may not exceed the shortest document.
    """

    def __init__(
        self,
        seq_len: int,
        *,
        seed: int = 0,
        min_doc: int = 16,
        max_doc: int | None = None,
        documents: str = "chapters",
        max_pad: int | None = None,
    ):
        if seq_len < 4:
            raise ValueError(f"seq_len must be at least 4, got {seq_len}")
        self.seq_len = seq_len
        self.min_doc = max(2, min_doc)
        self.max_doc = max_doc if max_doc is not None else max(self.min_doc, seq_len // 2)
        if self.max_doc < self.min_doc:
            raise ValueError(f"max_doc={self.max_doc} is smaller than min_doc={self.min_doc}")
        if max_pad is not None and (isinstance(max_pad, bool) or not isinstance(max_pad, int) or max_pad < 0):
            raise ValueError(f"max_pad must be None or an int >= 0, got {max_pad!r}")
        self.fill_from = max(self.min_doc, seq_len // 4) if max_pad is None else max(2, max_pad + 1)
        self.docs = load_documents(documents)
        shortest = shortest_document(documents)
        if self.min_doc > shortest:  # a span never exceeds its document
            raise ValueError(
                f"min_doc={self.min_doc} is longer than the shortest {documents} document ({shortest} tokens); "
                f"use min_doc <= {shortest}"
            )
        self.rng = random.Random(seed)

    def _span(self) -> bytes:
        doc = self.docs[self.rng.randrange(len(self.docs))]
        n = self.rng.randint(self.min_doc, min(self.max_doc, len(doc)))
        start = self.rng.randrange(len(doc) - n + 1)
        return doc[start : start + n]

    def next_row(self) -> PackedRow:
        spans: list[bytes] = []
        used = 0
        while True:
            span = self._span()
            if used + len(span) > self.seq_len:
                room = self.seq_len - used
                # A short gap stays as the padding tail; a large one takes a truncated span, and so does an empty row
                # (all padding has no label: its loss would be 0 / 0).
                if room >= self.fill_from or not spans:
                    spans.append(span[:room])
                    used += room
                break
            spans.append(span)
            used += len(span)
        return pack_row(spans, self.seq_len)

    def __iter__(self):
        while True:
            yield self.next_row()
