"""The indexer's selection kernel alone, on hand-made score keys under TRITON_INTERPRET=1: every path of the exact
top-K (a row held whole, the sampled union, a bracket whose top or bottom missed, an overflowing union, ties)
against a plain-torch selection of the same keys."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.interpret

_BLOCK = 256


def _keys(values: torch.Tensor) -> torch.Tensor:
    """The int32 storage of the uint32 keys ``values`` (in ``[0, 2**32)``)."""
    values = values.to(torch.int64)
    return torch.where(values >= (1 << 31), values - (1 << 32), values).to(torch.int32)


def _reference(rows: list[torch.Tensor], topk: int) -> torch.Tensor:
    """Per row: the columns of the ``topk`` largest keys (equal keys: the smaller column first), ascending, then -1."""
    out = torch.full((len(rows), topk), -1, dtype=torch.int32)
    for r, keys in enumerate(rows):
        order = (keys.to(torch.int64) & 0xFFFFFFFF).numpy()
        ranked = sorted(range(len(order)), key=lambda j: (-int(order[j]), j))[:topk]
        out[r, : len(ranked)] = torch.tensor(sorted(ranked), dtype=torch.int32)
    return out


def _select(rows: list[torch.Tensor], topk: int, sample: int, cand: int) -> torch.Tensor:
    from longtrain.dsa.triton.indexer_topk import indexer_topk_fwd_kernel_select

    width = max(len(r) for r in rows)
    scratch = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, r in enumerate(rows):
        scratch[i, : len(r)] = r
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    starts = torch.zeros(len(rows), dtype=torch.int32)
    out = torch.full((len(rows), topk), -7, dtype=torch.int32)  # poison: every slot must be written
    buf = torch.full((len(rows), cand), -7, dtype=torch.int32)
    indexer_topk_fwd_kernel_select[(len(rows),)](
        scratch, starts, lens, out, buf, 0, width, topk, scratch.stride(0), BLOCK=_BLOCK, SAMPLE=sample, CAND=cand
    )
    return out


def _sample_positions(n: int, sample: int) -> torch.Tensor:
    stride = n // sample
    return torch.arange(sample) * stride + stride // 2


def _split_row(n: int, sample: int, at_samples: torch.Tensor, elsewhere: torch.Tensor) -> torch.Tensor:
    """A row whose strided-sample positions hold ``at_samples`` and every other position ``elsewhere``."""
    values = torch.empty(n, dtype=torch.int64)
    is_sample = torch.zeros(n, dtype=torch.bool)
    is_sample[_sample_positions(n, sample)] = True
    values[is_sample] = at_samples
    values[~is_sample] = elsewhere
    return _keys(values)


def test_select_paths_equal_the_plain_selection(triton_interpret):
    g = torch.Generator().manual_seed(3)
    n, sample, cand, topk = 600, 64, 512, 300
    n_other = n - sample
    rows = {
        # Random keys: the sampled union fits (about K plus the bracket's margin).
        "union": _keys(torch.randint(0, 1 << 32, (n,), generator=g)),
        # The top of the bracket missed: 320 keys above every sampled key, so K or more lie above hi; the union of
        # the keys >= lo (those 320 and the top of the sample) still fits and holds the K largest.
        "hi-missed": _split_row(
            n,
            sample,
            10_000 + torch.randperm(sample, generator=g),
            torch.cat([1_000_000 + torch.randperm(320, generator=g), torch.arange(n_other - 320)]),
        ),
        # The bottom missed: every sampled key is above all others, so fewer than K keys are >= lo: whole-row radix.
        "lo-missed": _split_row(
            n, sample, 1_000_000 + torch.randperm(sample, generator=g), torch.randint(0, 1000, (n_other,), generator=g)
        ),
        # Every key equal: the union is the whole row (wider than the buffer): whole-row radix, the first K columns.
        "all-tied": _keys(torch.full((n,), 77)),
        # Few distinct keys: ties at the K-th largest inside the union.
        "ties": _keys(torch.randint(0, 40, (n,), generator=g) * 100_000_000),
        # Narrower than the buffer: held whole in registers, with ties.
        "held": _keys(torch.randint(0, 9, (400,), generator=g)),
        # Wider than K by one, and at most K (every key, then -1).
        "k+1": _keys(torch.randperm(topk + 1, generator=g)),
        "short": _keys(torch.randperm(topk - 5, generator=g)),
        "one": _keys(torch.tensor([5])),
    }
    names = list(rows)
    got = _select([rows[k] for k in names], topk, sample, cand)
    ref = _reference([rows[k] for k in names], topk)
    for i, name in enumerate(names):
        assert torch.equal(got[i], ref[i]), name
    # Without sampling every row takes the whole-row radix select: the same selection.
    assert torch.equal(_select([rows[k] for k in names], topk, 0, cand), ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_wide_rows_random_lengths(triton_interpret, seed):
    """Rows of random widths (some under K, some under the buffer, most above it) and random keys with ties."""
    g = torch.Generator().manual_seed(seed)
    topk, sample, cand = 40, 64, 256
    rows = []
    for _ in range(12):
        n = int(torch.randint(1, 1400, (1,), generator=g))
        hi = int(torch.randint(2, 1 << 20, (1,), generator=g))
        rows.append(_keys(torch.randint(0, hi, (n,), generator=g)))
    assert torch.equal(_select(rows, topk, sample, cand), _reference(rows, topk))
