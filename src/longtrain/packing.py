"""Packed-row layouts: the one home of the generators that tests, benchmarks and the demo use.

- :func:`doc_lengths`: document lengths drawn from ``U[lo, hi]`` (a torch generator seeded with ``seed``) that
  fill exactly ``total`` tokens (the last one cut to fit): the benchmark layouts are ``(512, 8192, seed 1)`` and
  ``(64, 2048, seed 2)``;
- :func:`ids_from_lengths`: document ids ``[S]`` (``1, 2, ...``, 0 == padding) of lengths and a padding tail;
- :func:`positions_from_lengths`: position ids restarting at 0 per document (``DataCollatorWithFlattening``'s).
"""

from __future__ import annotations

import torch

__all__ = ["BENCH_LAYOUTS", "doc_lengths", "ids_from_lengths", "positions_from_lengths"]

#: The documented benchmark layouts: name -> (lo, hi, seed) of :func:`doc_lengths`.
BENCH_LAYOUTS = {"long": (512, 8192, 1), "short": (64, 2048, 2)}


def doc_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Document lengths from ``U[lo, hi]`` (torch generator ``seed``) filling exactly ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def ids_from_lengths(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """``[sum(lengths) + pad] int64``: document ``i + 1`` repeated ``lengths[i]`` times, then ``pad`` zeros."""
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths, dtype=torch.long))
    return torch.cat([ids, torch.zeros(pad, dtype=torch.long)])


def positions_from_lengths(lengths: list[int], pad: int = 0) -> torch.Tensor:
    """``[sum(lengths) + pad] int64`` positions restarting at 0 per document (the padding tail counts from 0)."""
    parts = [torch.arange(n) for n in lengths] + [torch.arange(pad)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
