"""K/V exchange pieces that need no process group: the all-gather autograd with stub collectives, the
replicated exchange plan (:class:`ExchangePlan`), the all-to-all-v splits and the collective emulation used on
backends without ``reduce_scatter``. (The exchanges themselves run on gloo in ``test_runtime_dist.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import exchange, kernels
from longtrain.blockdiag_cp.step import exchange_plan


def _ids(*runs: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), d, dtype=torch.int64) for d, n in runs])


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_allgather_backward_is_reduce_scatter_with_stubs(monkeypatch, world):
    calls = []

    def all_gather(bufs, x, group=None, async_op=False):
        calls.append("all_gather")
        for b in bufs:
            b.copy_(x)

    def reduce_scatter(out, chunks, op=None, group=None, async_op=False):
        calls.append("reduce_scatter")
        assert op == dist.ReduceOp.SUM and len(chunks) == world
        out.copy_(sum(chunks))

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(dist, "reduce_scatter", reduce_scatter)
    x = torch.randn(1, 4, 3, 2, requires_grad=True)
    y = exchange._AllGatherSeqDiff.apply(x, None, 2)
    assert y.shape == (1, 4, 3 * world, 2)
    torch.testing.assert_close(y, torch.cat([x.detach()] * world, dim=2), rtol=0, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, float(world)), rtol=0, atol=0)
    assert calls == ["all_gather", "reduce_scatter"]


def test_allgather_second_order_gradient_raises_with_stubs(monkeypatch):
    """The exchange's backward is a collective, not a graph: differentiating its gradient again (create_graph=True)
    raises instead of leaving the exchange's term out; the first-order gradient is unchanged."""
    world = 2
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "all_gather", lambda bufs, x, group=None, async_op=False: [b.copy_(x) for b in bufs])
    monkeypatch.setattr(
        dist, "reduce_scatter", lambda out, chunks, op=None, group=None, async_op=False: out.copy_(sum(chunks))
    )
    x = torch.randn(1, 4, 3, 2, requires_grad=True)
    (grad,) = torch.autograd.grad(exchange._AllGatherSeqDiff.apply(x, None, 2).square().sum(), x, create_graph=True)
    torch.testing.assert_close(grad, 2 * world * x.detach(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="the CP all-gather of K/V is differentiable once"):
        torch.autograd.grad(grad.sum() + x.sum(), x)


def test_reduce_scatter_emulation_when_backend_lacks_it(monkeypatch):
    """A backend answering "unsupported" switches to all_reduce + slice, once, for good."""
    world, rank = 3, 1
    calls = []

    def unsupported(*args, **kwargs):
        calls.append("reduce_scatter")
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    def all_reduce(t, op=None, group=None, async_op=False):
        calls.append("all_reduce")
        t.mul_(world)  # every rank holds the same chunks in this stub

    monkeypatch.setattr(exchange, "_EMULATED", set())
    monkeypatch.setattr(dist, "reduce_scatter", unsupported)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    chunks = [torch.full((2, 2), float(i)) for i in range(world)]
    for _ in range(2):
        out = torch.empty(2, 2)
        exchange._reduce_scatter(out, chunks, None)
        torch.testing.assert_close(out, torch.full((2, 2), float(rank * world)), rtol=0, atol=0)
    assert calls == ["reduce_scatter", "all_reduce", "all_reduce"]


def test_other_collective_errors_propagate(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(exchange, "_EMULATED", set())
    monkeypatch.setattr(dist, "reduce_scatter", broken)
    with pytest.raises(RuntimeError, match="Connection closed"):
        exchange._reduce_scatter(torch.empty(2), [torch.zeros(2), torch.zeros(2)], None)


def test_plan_reference_cases():
    plan = exchange_plan(_ids((1, 6), (2, 6), (3, 4)), 4, 4)
    assert plan.recv == (0, 4, 2, 0)
    assert plan.send == (4, 2, 0, 0)
    assert plan.nreal == (4, 4, 4, 4)
    assert plan.use_halo is True

    plan = exchange_plan(_ids((1, 16)), 4, 4)
    assert plan.recv == (0, 4, 8, 12)
    assert plan.s_first == (0, 0, 0, 0)
    assert plan.real_end == (4, 8, 12, 16)
    assert plan.use_halo is False

    # all-padding ranks: empty range at r*L
    plan = exchange_plan(_ids((1, 3), (0, 9)), 3, 4)
    assert plan.nreal == (3, 0, 0)
    assert plan.s_first == (0, 4, 8)
    assert plan.real_end == (3, 4, 8)
    assert plan.recv == (0, 0, 0)


def test_plan_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="world\\*local_len"):
        exchange_plan(_ids((1, 10)), 3, 4)


@st.composite
def _layouts(draw):
    world = draw(st.integers(2, 6))
    lens = draw(st.lists(st.integers(1, 12), min_size=1, max_size=10))
    pad = draw(st.integers(0, 10))
    ids = [d + 1 for d, n in enumerate(lens) for _ in range(n)] + [0] * pad
    ids += [0] * ((-len(ids)) % (2 * world))
    return world, torch.tensor(ids, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(_layouts())
def test_a2a_splits_deliver_exactly_the_needed_range(layout):
    world, ids = layout
    local_len = ids.numel() // world
    plan = exchange_plan(ids, world, local_len)
    splits = [plan.a2a_splits(r, "cpu") for r in range(world)]
    positions = torch.arange(ids.numel())
    for r in range(world):
        meta = kernels.precompute_blockdiag_varlen_meta(
            ids, row_offset=r * local_len, local_len=local_len, device="cpu"
        )
        assert plan.nreal[r] == meta["n_real"]
        if meta["n_real"]:
            assert (plan.s_first[r], plan.real_end[r]) == (meta["s_first"], meta["real_end"])
            assert plan.recv[r] == r * local_len - meta["s_first"]
    assert plan.send == (*plan.recv[1:], 0)
    assert plan.use_halo == all(b <= local_len for b in plan.recv)
    for src in range(world):
        in_splits, _, send_index = splits[src]
        assert send_index.numel() == sum(in_splits) and send_index.dtype == torch.int64
        for dst in range(world):
            assert in_splits[dst] == splits[dst][1][src]
    for dst in range(world):
        out_splits = splits[dst][1]
        assert sum(out_splits) == plan.real_end[dst] - plan.s_first[dst]
        # Simulate the all-to-all-v on global positions: the received pieces, in source order, are the range.
        received = []
        for src in range(world):
            in_splits, _, send_index = splits[src]
            start = sum(in_splits[:dst])
            local = send_index[start : start + in_splits[dst]]
            received.append(positions[src * local_len + local])
        got = torch.cat(received)
        torch.testing.assert_close(got, torch.arange(plan.s_first[dst], plan.real_end[dst]), rtol=0, atol=0)


def test_zero_touch_is_exact_zero_and_attached_even_with_inf():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    kv = torch.full((1, 2, 5, 4), float("inf"), requires_grad=True)
    out = exchange.zero_touch(q, q, kv)
    assert torch.equal(out, torch.zeros_like(q)) and out.requires_grad
    out.sum().backward()
    assert torch.equal(kv.grad, torch.zeros_like(kv)) and torch.equal(q.grad, torch.zeros_like(q))
