"""The single-rank (cp = 1) packed path: block-diagonal attention scoped by hooks on ``self_attn`` modules.

``enable_cp1_packed_varlen(doc_ids, backend)`` arms a process-wide packed state: one
:class:`~longtrain.blockdiag_cp.step.CPStep` per row of ids (world size 1, the same object the CP path runs on).
Inside the forward of every module hooked by :func:`attach_cp1_packed_varlen_hooks`, a torch function mode
routes ``F.scaled_dot_product_attention`` calls whose shapes match the armed ids to :func:`_packed_varlen_sdpa`;
every other call is stock SDPA. Nothing is swapped globally (``F.scaled_dot_product_attention`` is never
reassigned), so code that imported the function under another name is covered too, and outside hooked forwards
nothing changes. A hooked forward that computes attention without SDPA (``attn_implementation="eager"``) while
ids are armed is a ``RuntimeError``: its attention would silently cross documents.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import state
from .compiled import maybe_disable_dynamo
from .mask import ORIGINAL_SDPA
from .runtime import cp_varlen_attention
from .step import CPStep, build_cp_step

__all__ = [
    "PackedState",
    "active",
    "attach_cp1_packed_varlen_hooks",
    "cp1_packed_varlen_backend",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
]


@dataclass(frozen=True, eq=False)
class PackedState:
    """What :func:`enable_cp1_packed_varlen` armed."""

    doc_ids: torch.Tensor
    """``[B, S]`` ids as given (a 1-D row is promoted to ``[1, S]``)."""
    backend: str
    """The canonical configured backend (``"auto"`` or a provider name)."""
    steps: tuple[CPStep, ...]
    """One one-rank step per row."""

    @property
    def varlen_meta(self):
        """Row 0's segmentation (the documented single-row metadata)."""
        return self.steps[0].varlen_meta


_PACKED_STATE = state.ThreadSharedVar("cp1_packed_state")
# Function modes entered by the pre-hooks, exited (last in, first out) by the post-hooks.
_MODE_STACK: list[_PackedSDPAMode] = []


def _packed_varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """SDPA inside hooked forwards. ``query: [B, Hq, S, D]``, ``key/value: [B, Hkv, S, D]``.

    When the packed state is armed with ids ``[B0, S0]`` and q/k/v are 4-D with batch ``B0`` and length ``S0``,
    runs per-document causal attention row by row on the armed steps (``attn_mask``/``is_causal`` ignored; GQA
    inferred): the armed backend, or the dense mask when the backend is ``dense`` or cannot run. Any other call
    (vision towers, other lengths, nothing armed) is stock SDPA, minus ``**kwargs``.
    """
    packed = _PACKED_STATE.get()
    if packed is None or not _matches(packed.doc_ids, query, key, value):
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    rows = [
        cp_varlen_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), step, softmax_scale=scale, dropout_p=dropout_p
        ).transpose(0, 1)  # fmt: skip
        for q, k, v, step in zip(query.unbind(0), key.unbind(0), value.unbind(0), packed.steps)
    ]
    return torch.stack(rows)


def active() -> bool:
    """Whether a hooked forward is running (its SDPA calls go through the packed path when they match)."""
    return bool(_MODE_STACK)


def _matches(ids: torch.Tensor, *qkv: torch.Tensor) -> bool:
    b0, s0 = ids.shape
    return all(t.dim() == 4 and t.shape[0] == b0 and t.shape[2] == s0 for t in qkv)


class _PackedSDPAMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :func:`_packed_varlen_sdpa` while a hooked forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is ORIGINAL_SDPA:
            self.sdpa_calls += 1
            return _packed_varlen_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def enable_cp1_packed_varlen(doc_ids: torch.Tensor, backend: str | None = None) -> None:
    """Arm the cp = 1 packed path for the next forwards of hooked modules.

    ``doc_ids: [B, S] or [S]`` integer (0 == padding; padding only as a tail, each document one run: every row
    is validated, ``ValueError`` otherwise). ``backend``: any name or synonym
    :func:`~longtrain.blockdiag_cp.state.normalize_attn_backend` accepts (``None`` -> the configured backend); an
    unknown name raises ``ValueError`` before anything changes. One step per row is built here (one host copy of
    the ids). The state persists until :func:`disable_cp1_packed_varlen` (so activation-checkpoint recompute
    reproduces the forward): call that at the start of the next forward.
    """
    configured = backend if backend is not None else state.cp_varlen_runtime_config()["attn_backend"]
    name = state.require_provided(state.normalize_attn_backend(configured))
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"doc_ids must be a [B, S] or [S] tensor, got {got}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    ids = doc_ids.unsqueeze(0) if doc_ids.dim() == 1 else doc_ids
    steps = []
    for b, row in enumerate(ids):
        try:
            steps.append(build_cp_step(row, None, device=ids.device, attn_backend=name))
        except ValueError as exc:
            raise ValueError(f"doc_ids row {b}: {exc}") from None
    maybe_disable_dynamo()
    _PACKED_STATE.set(PackedState(doc_ids=ids, backend=name, steps=tuple(steps)))


def disable_cp1_packed_varlen() -> None:
    """Disarm the cp = 1 packed path (hooked forwards then run stock SDPA)."""
    _PACKED_STATE.set(None)


def cp1_packed_varlen_backend() -> str | None:
    """The configured attention backend when it is a varlen one (``"auto"``, ``"flash"``, ``"te"``, ...), or None
    when it is ``"dense"``: what a model passes to :func:`enable_cp1_packed_varlen`."""
    name = state.cp_varlen_runtime_config()["attn_backend"]
    return None if name == state.ATTN_BACKEND_DENSE else name


def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    mode = _PackedSDPAMode()
    mode.__enter__()
    _MODE_STACK.append(mode)


def _post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if not _MODE_STACK:
        return
    mode = _MODE_STACK.pop()
    mode.__exit__(None, None, None)
    if output is not None and mode.sdpa_calls == 0 and _PACKED_STATE.get() is not None:
        raise RuntimeError(
            f"{type(module).__name__}.forward ran without calling torch.nn.functional.scaled_dot_product_attention "
            "while packed varlen attention is armed (enable_cp1_packed_varlen): its attention ignored the document "
            "boundaries. Use an SDPA attention implementation (Hugging Face: attn_implementation='sdpa'), or call "
            "disable_cp1_packed_varlen() for forwards that are not packed"
        )


def attach_cp1_packed_varlen_hooks(model: torch.nn.Module) -> int:
    """Hook every submodule whose qualified name ends in ``self_attn``; returns how many were hooked.

    A forward pre-hook enters the packed SDPA function mode; a forward post-hook (``always_call=True``: also when
    the forward raises) leaves it. For a ``CheckpointWrapper`` the wrapped module is hooked, so
    activation-checkpoint recompute (which re-runs the inner forward) is covered too. Attaching twice does not
    add duplicate hooks. A model with no such submodule gets a ``UserWarning``: arming the path would then change
    nothing, and its attention would cross the documents.
    """
    hooked = found = 0
    for name, module in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        found += 1
        target = getattr(module, "_checkpoint_wrapped_module", module)
        if getattr(target, "_longtrain_cp1_hooked", False):
            continue
        target.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        target.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
        target._longtrain_cp1_hooked = True
        hooked += 1
    if not found:
        warnings.warn(
            f"attach_cp1_packed_varlen_hooks: {type(model).__name__} has no submodule whose name ends in 'self_attn', "
            "so nothing was hooked and enable_cp1_packed_varlen will not make its attention block-diagonal (it would "
            "cross the documents). Call cp_varlen_attention / varlen_attention from the attention module instead, or "
            "use the batch builder's step with cp_blockdiag_sdpa",
            stacklevel=2,
        )
    return hooked
