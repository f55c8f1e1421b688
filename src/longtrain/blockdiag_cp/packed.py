"""The single-rank (cp = 1) packed path: block-diagonal varlen attention scoped by hooks on ``self_attn``.

``enable_cp1_packed_varlen(doc_ids, backend)`` arms a process-wide packed state; inside the forward of every
module hooked by :func:`attach_cp1_packed_varlen_hooks`, ``F.scaled_dot_product_attention`` is replaced by
:func:`_packed_varlen_sdpa`, which runs per-document causal attention when the call's shapes match the armed
ids and is stock SDPA otherwise. Outside hooked forwards SDPA is never patched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import kernels, runtime, state

__all__ = [
    "attach_cp1_packed_varlen_hooks",
    "cp1_packed_varlen_backend",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
]

_PACKED_STATE = state._ThreadSharedVar("cp1_packed_state")
# SDPA values replaced by the pre-hooks, restored (last in, first out) by the post-hooks.
_PATCH_STACK: list[Any] = []


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
    """SDPA replacement active inside hooked forwards. ``query: [B, Hq, S, D]``, ``key/value: [B, Hkv, S, D]``.

    When the packed state is armed with ids ``[B0, S0]`` and q/k/v are 4-D with batch ``B0`` and length ``S0``,
    runs per-document causal attention (``attn_mask``/``is_causal`` ignored; GQA inferred): the armed varlen
    backend, or the dense mask when the backend is ``dense`` or the kernel declines. Any other call (vision
    towers, other lengths, nothing armed) is stock SDPA, minus ``**kwargs``.
    """
    packed = _PACKED_STATE.get()
    ids = packed["doc_ids"] if packed is not None else None
    if not _matches(ids, query, key, value):
        return runtime._ORIGINAL_SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip
    backend = runtime._effective_backend(packed["backend"], query.dtype, query.device, dropout_p)
    if backend != state.ATTN_BACKEND_DENSE:
        out = kernels._cp_blockdiag_varlen(
            query, key, value, ids, 0, scale, backend, dropout_p=dropout_p, meta=packed["varlen_meta"]
        )
        if out is not None:
            return out
    return kernels.dense_blockdiag_sdpa(query, key, value, ids, 0, scale=scale, dropout_p=dropout_p)


def _matches(ids: torch.Tensor | None, *qkv: torch.Tensor) -> bool:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return False
    b0, s0 = ids.shape
    return all(t.dim() == 4 and t.shape[0] == b0 and t.shape[2] == s0 for t in qkv)


def enable_cp1_packed_varlen(doc_ids: torch.Tensor, backend: str | None = None) -> None:
    """Arm the cp = 1 packed path for the next forwards of hooked modules.

    ``doc_ids: [B, S] or [S]`` integer (0 == padding; padding only as a tail, each document one run).
    ``backend``: any name or synonym :func:`~longtrain.blockdiag_cp.state.normalize_attn_backend` accepts
    (``None`` -> the configured backend); an unknown name raises ``ValueError`` before anything changes.
    For ``[1, S]`` ids the varlen metadata is computed once here; multi-row ids are segmented per call.
    The state persists until :func:`disable_cp1_packed_varlen` (so activation-checkpoint recompute
    reproduces the forward): call that at the start of the next forward.
    """
    configured = backend if backend is not None else state.cp_varlen_runtime_config()["attn_backend"]
    name = state._require_provided(state.normalize_attn_backend(configured))
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2):
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"doc_ids must be a [B, S] or [S] tensor, got {got}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    ids = doc_ids.unsqueeze(0) if doc_ids.dim() == 1 else doc_ids
    meta = None
    if ids.shape[0] == 1:
        meta = kernels.precompute_blockdiag_varlen_meta(
            ids, row_offset=0, local_len=int(ids.shape[1]), device=ids.device
        )
    runtime._maybe_disable_dynamo()
    _PACKED_STATE.set({"doc_ids": ids, "backend": name, "varlen_meta": meta})


def disable_cp1_packed_varlen() -> None:
    """Disarm the cp = 1 packed path (hooked forwards then run stock SDPA)."""
    _PACKED_STATE.set(None)


def cp1_packed_varlen_backend() -> str | None:
    """The configured attention backend when it is a varlen one (``"auto"``, ``"flash"``, ``"te"``, ...), or None
    when it is ``"dense"``: what a model passes to :func:`enable_cp1_packed_varlen`."""
    name = state.cp_varlen_runtime_config()["attn_backend"]
    return None if name == state.ATTN_BACKEND_DENSE else name


def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    _PATCH_STACK.append(F.scaled_dot_product_attention)
    F.scaled_dot_product_attention = _packed_varlen_sdpa


def _post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    F.scaled_dot_product_attention = _PATCH_STACK.pop() if _PATCH_STACK else runtime._ORIGINAL_SDPA


def attach_cp1_packed_varlen_hooks(model: torch.nn.Module) -> int:
    """Hook every submodule whose qualified name ends in ``self_attn``; returns how many were hooked.

    A forward pre-hook patches ``torch.nn.functional.scaled_dot_product_attention`` with the packed SDPA; a
    forward post-hook (``always_call=True``: also when the forward raises) restores it. For a
    ``CheckpointWrapper`` the wrapped module is hooked, so activation-checkpoint recompute (which re-runs
    the inner forward) is patched too. Attaching twice does not add duplicate hooks.
    """
    hooked = 0
    for name, module in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        target = getattr(module, "_checkpoint_wrapped_module", module)
        if getattr(target, "_longtrain_cp1_hooked", False):
            continue
        target.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        target.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
        target._longtrain_cp1_hooked = True
        hooked += 1
    return hooked
