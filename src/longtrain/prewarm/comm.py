"""Communicator warmup for the process groups gradient-norm clipping uses."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from longtrain.prewarm._common import _log, _log_failure, _normalize_device, _note_shapes, _skip

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _comm_device(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _normalize_device(device)


def _agree_on_groups(dist: Any, ranks_of_groups: list[list[int]] | None, error: str | None) -> None:
    """Before any collective, every rank publishes (through the default store) the ranks of the groups it will
    all-reduce on, in order, or the error that stopped it; every rank then raises the same ``RuntimeError`` when a
    rank failed or two ranks would issue their shared groups differently (the one that waits would hang)."""
    from longtrain.blockdiag_cp import consensus, state

    rank, world = dist.get_rank(), dist.get_world_size()
    payload = json.dumps({"error": error, "groups": ranks_of_groups})
    views = [json.loads(p) for p in consensus.exchange_fingerprints(None, rank, world, payload, state.step_timeout_s())]
    failed = {r: v["error"] for r, v in enumerate(views) if v["error"] is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise RuntimeError(
            f"comm-group prewarm: rank(s) {sorted(failed)} could not list their process groups ({detail}); no rank "
            "issued a collective. Fix that rank's device / model parts / pp_mesh, or turn comm_groups off on every rank"
        )
    for r, view in enumerate(views):
        for m in range(r + 1, world):
            mine = [g for g in view["groups"] if m in g]
            theirs = [g for g in views[m]["groups"] if r in g]
            if mine != theirs:
                raise RuntimeError(
                    f"comm-group prewarm: ranks disagree on the process groups they share: rank {r} would all-reduce "
                    f"on {mine}, rank {m} on {theirs}; no rank issued a collective. Every rank of a group must pass "
                    "model parts with the same DTensor placements and the same pp_mesh (a rank whose pp group failed "
                    "to resolve is logged above)"
                )


def _grad_norm_groups(model_parts: list[torch.nn.Module], pp_mesh: DeviceMesh | None) -> list[Any]:
    """The process groups ``clip_grad_norm`` all-reduces over, in first-seen order, the pipeline group last.

    One group per non-``Replicate`` placement dim (Shard, strided shard, Partial, custom) of every DTensor
    parameter's mesh, deduplicated by group identity (two group objects over the same ranks are distinct
    communicators). Parameters are never sharded along pp, so the pp group comes from ``pp_mesh``.
    """
    from torch.distributed.tensor import DTensor, Replicate

    groups: list[Any] = []
    seen: set[int] = set()
    for part in model_parts:
        for param in part.parameters():
            if not isinstance(param, DTensor):
                continue
            for mesh_dim, placement in enumerate(param.placements):
                if isinstance(placement, Replicate):
                    continue
                group = param.device_mesh.get_group(mesh_dim=mesh_dim)
                if id(group) not in seen:
                    seen.add(id(group))
                    groups.append(group)
    if pp_mesh is not None:
        try:
            pp_group = pp_mesh.get_group()
        except Exception:
            _log_failure("Failed to resolve the PP mesh process group; skipping its prewarm.")  # ranks agree below
            pp_group = None
        if pp_group is not None and id(pp_group) not in seen:
            seen.add(id(pp_group))
            groups.append(pp_group)
    return groups


def _prewarm_comm_groups(
    model_parts: list[torch.nn.Module],
    device: torch.device | int | str | None,
    pp_mesh: DeviceMesh | None = None,
) -> int:
    """Eagerly create the communicators gradient-norm clipping will use.

    torch creates a process group's NCCL communicator lazily on its first collective, and NCCL then
    cudaMallocs its scratch buffers outside the torch pool; ``clip_grad_norm``'s first collectives run after
    the step-1 backward, at peak memory. This replays ``clip_grad_norm``'s (mesh, placement dim) enumeration
    (every non-``Replicate`` placement dim of each DTensor parameter's mesh, deduplicated, the ``pp_mesh``
    group last) and issues a one-element SUM all-reduce of a zero fp32 scalar on each group.

    This is a collective: every rank must call it, and it issues the groups in parameter order, which is the
    same on every rank of a stage. Before the first collective the ranks compare their group lists through the
    default store: when one rank cannot list its groups (a bad device, a ``get_group`` error) or would issue a
    shared group in a different order or not at all (e.g. its ``pp_mesh`` group failed to resolve), every rank
    raises the same ``RuntimeError`` and none issues a collective, instead of the others waiting. It covers all
    parameters (also frozen ones), a superset of what clipping reduces; FSDP/TP/EP/CP collectives of the forward
    and backward are not warmed here. Collective errors propagate (``PrewarmConfig.apply`` logs them).

    Args:
        model_parts: model parts whose DTensor parameters define the groups.
        device: device of the warmup scalar; None means the current CUDA device, else CPU (gloo).
        pp_mesh: the 1-D pipeline-parallel submesh, if pipeline parallelism is enabled.

    Returns:
        The number of process groups warmed (0 when torch.distributed is not initialized or no group exists).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        _skip("Skipping comm-group prewarm: torch.distributed is not initialized.")
        return 0
    dev, groups, error = None, [], None
    try:
        dev = _comm_device(device)
        groups = _grad_norm_groups(model_parts, pp_mesh)
    except Exception as exc:
        if dist.get_world_size() == 1:
            raise
        error = f"{type(exc).__name__}: {exc}"
    if dist.get_world_size() > 1:
        ranks = None if error is not None else [dist.get_process_group_ranks(g) for g in groups]
        _agree_on_groups(dist, ranks, error)
    if not groups:
        _skip("Skipping comm-group prewarm: no sharded DTensor parameter and no pipeline group.")
        return 0
    _note_shapes([f"group ranks {dist.get_process_group_ranks(g)}" for g in groups])
    scalar = torch.zeros((), device=dev, dtype=torch.float32)
    for group in groups:
        torch.distributed.all_reduce(scalar, group=group)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    _log().info("Prewarmed %d process group(s) for grad-norm clipping.", len(groups))
    return len(groups)
