"""The shared test infrastructure works: poisoning, the gloo harness (results, errors, timeouts)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankError, RankTimeout, run_ranks


def _allreduce_rank(rank: int, world: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"boom on {rank}")
    return rank


def _hang_on_rank(rank: int, world: int, bad: int) -> int:
    if rank != bad:
        dist.barrier()  # never matched by the bad rank within the deadline
    else:
        time.sleep(30)
    return rank


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_results_in_rank_order(world):
    out = run_ranks(_allreduce_rank, world, 2.0)
    assert out == [2.0 * sum(range(world))] * world


@pytest.mark.dist
def test_exception_propagates_with_rank_and_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank, 2, 1)
    assert set(info.value.errors) == {1}
    assert "boom on 1" in info.value.errors[1]
    assert info.value.results == {0: 0}


@pytest.mark.dist
def test_hang_is_bounded():
    start = time.monotonic()
    with pytest.raises(RankTimeout):
        run_ranks(_hang_on_rank, 2, 1, timeout=5)
    assert time.monotonic() - start < 20
    # A fresh pool is created after a timeout.
    assert run_ranks(_allreduce_rank, 2, 1.0) == [1.0, 1.0]


def test_poison_fixture(poison):
    t = poison((3, 4), torch.bfloat16)
    assert torch.isnan(t).all()
    i = poison((2,), torch.int32)
    assert (i == torch.iinfo(torch.int32).min).all()


def test_triton_interpret_fixture(triton_interpret):
    assert os.environ["TRITON_INTERPRET"] == "1"
