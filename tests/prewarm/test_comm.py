"""comm_groups prewarm on 4 gloo ranks: a 2x2 DeviceMesh with DTensor parameters, plus a pipeline mesh."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import longtrain.prewarm as prewarm


def _count_all_reduces(fn):
    """Run ``fn()`` with ``torch.distributed.all_reduce`` wrapped; returns (fn's result, [group ranks per call])."""
    seen: list[list[int]] = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert tensor.numel() == 1 and tensor.dtype == torch.float32
        seen.append(dist.get_process_group_ranks(group))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting  # the pool's worker processes are reused: restored below
    try:
        return fn(), seen
    finally:
        dist.all_reduce = real


def _comm_groups_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "rest"))["pp"]

    def param(placements):
        return nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, placements))

    one_dim = nn.Module()
    one_dim.a = param([Shard(0), Replicate()])  # dp group
    one_dim.b = param([Shard(1), Replicate()])  # dp again: deduplicated
    one_dim.c = param([Replicate(), Replicate()])  # nothing
    one_dim.plain = nn.Parameter(torch.zeros(3))  # not a DTensor: ignored
    two_dim = nn.Module()
    two_dim.w = param([Shard(0), Shard(1)])  # dp (seen) + tp
    frozen = nn.Module()
    frozen.f = nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Replicate(), Shard(0)]), requires_grad=False)

    out: dict = {}
    out["one_dim"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([one_dim], "cpu"))
    out["two_dim"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([one_dim, two_dim], None))
    out["with_pp"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([two_dim], "cpu", pp_mesh=pp_mesh))
    out["frozen_only"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([frozen], "cpu"))
    out["nothing"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([nn.Linear(2, 2)], "cpu"))

    partial = nn.Module()
    partial.p = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Replicate(), Partial()]))
    out["partial"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([partial], "cpu"))

    class BadPP:
        def get_group(self):
            raise RuntimeError("multi-dim mesh")

    out["bad_pp"] = _count_all_reduces(lambda: prewarm._prewarm_comm_groups([two_dim], "cpu", pp_mesh=BadPP()))

    # Through apply: the report says how many groups were warmed; RNG untouched.
    rng = torch.get_rng_state()
    cfg = prewarm.PrewarmConfig(comm_groups=True)
    report, calls = _count_all_reduces(lambda: prewarm.run_prewarms(cfg, [one_dim, two_dim], "cpu", pp_mesh=pp_mesh))
    out["report"] = (report.ran, report.step("comm_groups").result, len(calls), report.step("comm_groups").shapes)
    out["rng_equal"] = torch.equal(rng, torch.get_rng_state())
    out["mesh_groups"] = {
        "dp": dist.get_process_group_ranks(mesh.get_group("dp")),
        "tp": dist.get_process_group_ranks(mesh.get_group("tp")),
        "pp": dist.get_process_group_ranks(pp_mesh.get_group()),
    }
    return out


@pytest.mark.dist
def test_comm_groups_on_2x2_gloo_mesh(gloo):
    results = gloo(_comm_groups_rank, 4, timeout=180)
    for rank, out in enumerate(results):
        groups = out["mesh_groups"]
        assert rank in groups["dp"] and rank in groups["tp"]
        assert out["one_dim"] == (1, [groups["dp"]])
        assert out["two_dim"] == (2, [groups["dp"], groups["tp"]])
        assert out["with_pp"] == (3, [groups["dp"], groups["tp"], groups["pp"]])  # pipeline group last
        assert out["frozen_only"] == (1, [groups["tp"]])  # frozen parameters count too
        assert out["nothing"] == (0, [])
        assert out["partial"] == (1, [groups["tp"]])  # Partial is "not Replicate"
        assert out["bad_pp"] == (2, [groups["dp"], groups["tp"]])
        ran, result, calls, shapes = out["report"]
        assert ran == ["comm_groups"] and result == 3 and calls == 3 and len(shapes) == 3
        assert out["rng_equal"]
    # Same order on every rank: the i-th collective of each rank is on its mesh dim of the same index.
    dims = [[("dp", "tp", "pp")[i] for i in range(len(out["with_pp"][1]))] for out in results]
    assert all(d == dims[0] for d in dims)


def test_comm_groups_without_process_group(caplog):
    assert not dist.is_initialized()
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        assert prewarm._prewarm_comm_groups([nn.Linear(2, 2)], None) == 0
    assert "Skipping comm-group prewarm: torch.distributed is not initialized." in caplog.text


class _PPMesh:
    """A pipeline submesh stand-in whose ``get_group`` fails on the ranks listed in ``failing``."""

    def __init__(self, failing: tuple[int, ...]):
        self.failing = failing

    def get_group(self):
        if dist.get_rank() in self.failing:
            raise RuntimeError("simulated: cannot resolve the pp group on this rank")
        return dist.group.WORLD


def _one_rank_cannot_resolve_pp_rank(rank: int, world: int) -> dict:
    report, calls = _count_all_reduces(
        lambda: prewarm.run_prewarms(
            prewarm.PrewarmConfig(comm_groups=True), [nn.Linear(2, 2)], "cpu", pp_mesh=_PPMesh((1,))
        )
    )
    step = report.step("comm_groups")
    both = prewarm._prewarm_comm_groups([nn.Linear(2, 2)], "cpu", pp_mesh=_PPMesh((0, 1)))  # all ranks alike: fine
    ok = prewarm._prewarm_comm_groups([nn.Linear(2, 2)], "cpu", pp_mesh=_PPMesh(()))
    bad_device = prewarm.run_prewarms(
        prewarm.PrewarmConfig(comm_groups=True), [nn.Linear(2, 2)], "bogus" if rank == 0 else "cpu", pp_mesh=_PPMesh(())
    ).step("comm_groups")
    return {
        "status": step.status,
        "reason": step.reason,
        "calls": calls,
        "both": both,
        "ok": ok,
        "bad_device": (bad_device.status, bad_device.reason),
    }


@pytest.mark.dist
def test_one_rank_failing_to_resolve_its_groups_fails_every_rank_without_a_collective(gloo):
    # Before: rank 1 logged the pp failure and returned while rank 0 all-reduced on the pp group and waited for it.
    results = gloo(_one_rank_cannot_resolve_pp_rank, 2, timeout=45)
    for out in results:
        assert out["status"] == "failed" and out["calls"] == []  # no rank issued a collective
        assert "ranks disagree on the process groups" in out["reason"] and "rank 1" in out["reason"]
        assert out["both"] == 0 and out["ok"] == 1
        status, reason = out["bad_device"]  # rank 0 cannot even build its device: both ranks fail, none waits
        assert status == "failed" and "rank(s) [0] could not list their process groups" in reason and "bogus" in reason
