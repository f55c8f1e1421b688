"""FSDP2 under context parallelism, for every stack: :func:`set_fsdp_gradient_divide_factor`."""

from __future__ import annotations

import torch

__all__ = ["set_fsdp_gradient_divide_factor"]


def set_fsdp_gradient_divide_factor(model: torch.nn.Module, factor: float = 1.0) -> int:
    """Set FSDP2's gradient divide factor on every FSDP module of ``model``; returns how many it set.

    With a ``dp_shard x cp`` mesh flattened into FSDP's mesh, FSDP averages gradients over every rank of it, so a
    loss normalised by the global token count (what :func:`~longtrain.integrations.hf.hf_cp_batch`'s
    ``num_items_in_batch`` gives, summed over the CP ranks) comes out divided by the CP size as well. ``factor=1.0``
    makes the reduction a plain sum: right when every rank's loss is already divided by the token count of the
    whole global batch (all DP and CP ranks). Raises a ``ValueError`` when ``model`` holds no FSDP module (call it
    after ``fully_shard``).
    """
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
