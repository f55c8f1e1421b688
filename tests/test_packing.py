"""longtrain.packing edge cases: empty and zero-length documents, invalid lengths as clear errors, many documents."""

from __future__ import annotations

import time

import pytest
import torch

from longtrain.packing import doc_lengths, doc_starts_from_positions, ids_from_lengths, positions_from_lengths


def test_empty_and_zero_length_documents():
    assert ids_from_lengths([]).tolist() == [] and positions_from_lengths([], 2).tolist() == [0, 1]
    assert ids_from_lengths([0, 2, 0, 1], 1).tolist() == [2, 2, 4, 0]
    assert positions_from_lengths([0, 2, 0, 1], 1).tolist() == [0, 1, 0, 0]
    assert doc_lengths(0, 1, 3, 0) == []


@pytest.mark.parametrize(
    "lengths, pad",
    [([1.5, 2], 0), ([-1, 3], 0), ([2], -1), ([2], 1.0), ("12", 0), ([True], 0)],
    ids=["float", "negative", "negative-pad", "float-pad", "str", "bool"],
)
def test_invalid_lengths_are_value_errors(lengths, pad):
    """A float length was truncated by ids_from_lengths and rounded up by positions_from_lengths (rows of different
    lengths); negative ones raised torch's own errors."""
    for fn in (ids_from_lengths, positions_from_lengths):
        with pytest.raises(ValueError, match="non-negative int"):
            fn(lengths, pad)


@pytest.mark.parametrize("args", [(-5, 1, 3), (5, 3, 1), (5, 0, 0), (5.0, 1, 2)], ids=["neg", "lo>hi", "hi0", "float"])
def test_doc_lengths_refuses_bad_ranges(args):
    """(5, 0, 0) looped forever; (-5, 1, 3) raised IndexError."""
    with pytest.raises(ValueError, match="doc_lengths needs ints"):
        doc_lengths(*args, 0)


def test_doc_lengths_many_short_documents_is_linear():
    start = time.perf_counter()
    lens = doc_lengths(50_000, 1, 1, 0)  # took ~6 s when the list was re-summed per draw
    assert len(lens) == 50_000 and time.perf_counter() - start < 1.5


def test_unsigned_positions_do_not_wrap():
    """uint8 255 -> 0 differs by +1 modulo 256: that read as one document."""
    pos = torch.tensor([254, 255, 0, 1], dtype=torch.uint8)
    assert doc_starts_from_positions(pos).tolist() == [[True, False, True, False]]
