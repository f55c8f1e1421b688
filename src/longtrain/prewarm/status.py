"""``backend_status()`` for ``longtrain doctor``: which prewarm can run here, and why not."""

from __future__ import annotations

import importlib.util

from longtrain import _optional
from longtrain.prewarm.steps import PREWARM_STEPS


def _needs(*probes: tuple[bool, str]) -> str | None:
    reasons = [reason for ok, reason in probes if not ok]
    return "; ".join(reasons) if reasons else None


def _dsa_warmup_probe() -> tuple[bool, str]:
    try:
        found = importlib.util.find_spec("longtrain.dsa.triton") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return False, "longtrain.dsa.triton is not installed"
    try:
        module = importlib.import_module("longtrain.dsa.triton")
    except Exception as exc:  # a broken sibling module is a reason, never a crash of `doctor`
        return False, f"longtrain.dsa.triton failed to import: {type(exc).__name__}: {str(exc)[:120]}"
    if not callable(getattr(module, "warmup", None)):
        return False, "longtrain.dsa.triton has no warmup()"
    return True, ""


def _comm_probe() -> tuple[bool, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, "this torch build has no torch.distributed"
    if not dist.is_initialized():
        return False, "needs an initialised torch.distributed process group at run time (none in this process)"
    return True, ""


def backend_status() -> list[tuple[str, str | None]]:
    """``(prewarm, None if it can run here else the reason)`` for every switch of the step table, in run order."""
    cuda = _optional.torch_cuda()
    cuda_reason = (False, f"needs CUDA ({cuda[1]})") if not cuda[0] else cuda
    probes = {
        "cuda": (cuda_reason,),
        "fla": (_optional.fla(), cuda_reason),
        "mamba": (_optional.mamba_ssm(), cuda_reason),
        "dsa": (_optional.triton(), cuda_reason, _dsa_warmup_probe()),
        "comm": (_comm_probe(),),
    }
    first = {}
    for step in PREWARM_STEPS:
        first.setdefault(step.switch, step.needs)
    return [(switch, _needs(*probes[needs])) for switch, needs in first.items()]
