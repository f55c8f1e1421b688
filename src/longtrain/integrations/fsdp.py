"""FSDP2 under context parallelism, for every stack: :func:`set_fsdp_gradient_divide_factor`."""

from __future__ import annotations

import math

import torch

__all__ = ["set_fsdp_gradient_divide_factor"]


def set_fsdp_gradient_divide_factor(model: torch.nn.Module, factor: float = 1.0) -> int:
    """Set FSDP2's gradient divide factor on every FSDP module of ``model``; returns how many it set.

    With a ``dp_shard x cp`` mesh flattened into FSDP's mesh, FSDP averages gradients over every rank of it
    (divides by ``D x C``). The CP ranks of one replica hold parts of one row whose losses sum to the row's loss,
    so that average comes out divided by the CP size ``C`` as well. Pass ``factor=D``, the number of data-parallel
    replicas, when each replica's loss is its row's mean (:func:`~longtrain.integrations.hf.hf_cp_batch`'s default
    ``num_items_in_batch``): an average over the replicas, a sum over the CP ranks. Pass ``factor=1.0`` (a plain
    sum) when every rank's loss is already divided by the token count of the whole global batch; without DP both
    are 1.0. Raises a ``ValueError`` when ``model`` holds no FSDP module (call it after ``fully_shard``).
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"factor must be a finite number > 0 (the number of data-parallel replicas, or 1.0), got {factor!r}: a "
            "zero, negative or non-finite factor would scale every gradient wrongly"
        )
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # torch < 2.6
        raise ImportError(
            "set_fsdp_gradient_divide_factor needs torch.distributed.fsdp.FSDPModule (torch>=2.6)"
        ) from exc
    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            count += 1
    if not count:
        raise ValueError("the model holds no FSDP2 module: call set_fsdp_gradient_divide_factor after fully_shard")
    return count
