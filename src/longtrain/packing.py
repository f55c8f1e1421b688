"""Packed-row layouts: the one home of the generators that tests, benchmarks and the demo use.

- :func:`doc_lengths`: document lengths drawn from ``U[lo, hi]`` (a torch generator seeded with ``seed``) that
  fill exactly ``total`` tokens (the last one cut to fit): the benchmark layouts are ``(512, 8192, seed 1)`` and
  ``(64, 2048, seed 2)``;
- :func:`ids_from_lengths`: document ids ``[S]`` (``1, 2, ...``, 0 == padding) of lengths and a padding tail;
- :func:`positions_from_lengths`: position ids restarting at 0 per document (``DataCollatorWithFlattening``'s);
- :func:`doc_starts_from_positions`: where packed position ids start documents (the one rule every reader of
  position ids uses: the batch builder, the Hugging Face attention and the torchtitan adapter).
"""

from __future__ import annotations

import operator

import torch

__all__ = [
    "BENCH_LAYOUTS",
    "as_index",
    "doc_lengths",
    "doc_starts_from_positions",
    "ids_from_lengths",
    "positions_from_lengths",
]

#: The documented benchmark layouts: name -> (lo, hi, seed) of :func:`doc_lengths`.
BENCH_LAYOUTS = {"long": (512, 8192, 1), "short": (64, 2048, 2)}


def doc_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Document lengths from ``U[lo, hi]`` (torch generator ``seed``) filling exactly ``total`` tokens."""
    if any(as_index(x) is None for x in (total, lo, hi)) or total < 0 or not 0 <= lo <= hi or hi < 1:
        raise ValueError(
            "doc_lengths needs ints total >= 0 and 0 <= lo <= hi with hi >= 1, "
            f"got total={total!r}, lo={lo!r}, hi={hi!r}"
        )
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    filled = 0  # a running sum: re-summing the list per draw made many short documents quadratic
    while filled < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
        filled += lengths[-1]
    if lengths:
        lengths[-1] -= filled - total
    return [n for n in lengths if n > 0]


def as_index(value: object) -> int | None:
    """``value`` as an int when it is an integer (Python, NumPy or a 0-d integer tensor; not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _checked(lengths, pad: int) -> list[int]:
    """``lengths`` as non-negative ints, ``pad`` a non-negative int; else a ``ValueError`` (a float length would be
    truncated by one helper and rounded up by the other, giving ids and positions of different rows)."""
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
    out = [] if isinstance(values, (str, bytes)) else [as_index(n) for n in values]
    if isinstance(values, (str, bytes)) or any(n is None or n < 0 for n in out):
        raise ValueError(f"lengths must be non-negative ints (document lengths in tokens), got {lengths!r}")
    if as_index(pad) is None or pad < 0:
        raise ValueError(f"pad must be a non-negative int (padding positions after the documents), got {pad!r}")
    return out


def ids_from_lengths(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """``[sum(lengths) + pad] int64``: document ``i + 1`` repeated ``lengths[i]`` times, then ``pad`` zeros."""
    lengths = _checked(lengths, pad)
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths, dtype=torch.long))
    return torch.cat([ids, torch.zeros(pad, dtype=torch.long)])


def positions_from_lengths(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """``[sum(lengths) + pad] int64`` positions restarting at 0 per document (the padding tail counts from 0)."""
    lengths = _checked(lengths, pad)
    parts = [torch.arange(n) for n in lengths] + [torch.arange(pad)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def doc_starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S] bool``: True where packed position ids start a document (always at a row's first token).

    ``position_ids``: ``[S]``, ``[B, S]``, or mRoPE ``[P, B, S]``.

    - Text positions (``[S]``, ``[B, S]``, and the first plane of transformers' packed mRoPE layout ``[4, B, S]``,
      text positions then temporal / height / width): a document starts wherever the position does not grow by
      exactly 1 (Hugging Face's packed-sequence rule; ``DataCollatorWithFlattening`` restarts each document at 0).
    - 3-plane mRoPE ``[3, B, S]`` (temporal, height, width; no text plane): the temporal plane does not grow over
      an image's patches, so a document starts where it is 0. A document that opens with vision tokens repeats
      temporal 0 while the spatial planes move; that is a ``ValueError`` (every patch would start a document).
    """
    pos = position_ids
    if pos.dim() == 3 and pos.shape[0] == 3:
        t, hw = pos[0], pos[1:]
        repeat = (t[..., 1:] == 0) & (t[..., :-1] == 0) & (hw[..., 1:] != hw[..., :-1]).any(0)
        if bool(repeat.any()):
            b, i = (int(x) for x in repeat.nonzero()[0])
            raise ValueError(
                f"mRoPE position_ids [3, B, S]: at row {b}, position {i + 1} the temporal plane is 0 again while the "
                "spatial planes move (vision tokens at the start of a document), so restarts of the first plane do "
                "not mark documents there. Prepend the text positions as a first plane ([4, B, S], transformers' "
                "packed layout), or pass _packed_seq_ids or cu_seq_lens_q"
            )
        starts = t == 0
    else:
        plane = pos[0] if pos.dim() == 3 else pos
        plane = plane.reshape(1, -1) if plane.dim() == 1 else plane
        if not plane.dtype.is_floating_point:  # unsigned differences wrap: uint8 255 -> 0 would read as "+1"
            plane = plane.long()
        starts = torch.ones_like(plane, dtype=torch.bool)
        starts[:, 1:] = plane[:, 1:] - plane[:, :-1] != 1
    starts[:, :1] = True
    return starts
