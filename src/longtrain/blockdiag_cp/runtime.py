"""``cp_blockdiag_sdpa``: the SDPA drop-in that runs block-diagonal attention over context-parallel shards.

Inside a step context (built by :func:`longtrain.blockdiag_cp.batch.make_cp_blockdiag_batch_and_ctx`) every
call exchanges K/V over the CP group and attends with the per-document causal mask rebuilt from the
replicated document ids; outside a context it is exactly stock SDPA.

Collective-order safety (every rank must issue the same collectives in the same order):

- The exchange path is chosen from replicated config and data, plus one all-reduce per step (the
  *preflight*) before a needed-only exchange: if any rank cannot run it, every rank uses all-gather.
- After a needed-only exchange, one all-reduce per call (the *post-kernel consensus*) makes every rank
  raise the same ``RuntimeError`` when the kernel failed anywhere, instead of one rank falling back alone.
- On the all-gather path a rank-local fallback to the dense mask is safe: it adds no collective.

``exchange``, ``kernels`` and ``state`` are used as module objects and their attributes looked up at call
time, so tests can substitute the gather or the kernel.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed

from . import backends, exchange, kernels, state

__all__ = ["cp_blockdiag_sdpa"]

logger = logging.getLogger(__name__)

#: Stock SDPA, captured before any cp=1 hook can patch ``F.scaled_dot_product_attention``.
_ORIGINAL_SDPA = backends.ORIGINAL_SDPA

#: Setting this environment variable to "1" allows the needed-only exchanges across nodes.
ALLOW_XNODE_ENV = "LONGTRAIN_CP_ALLOW_XNODE"

_KV_EXCHANGE_PATH_LOGGED = False
_KV_XNODE_LOGGED = False

_NEEDED_ONLY = (state.KV_EXCHANGE_HALO, state.KV_EXCHANGE_A2A)
# Varlen backends that cannot apply attention dropout: with dropout_p > 0 their kernel returns None and the
# all-gather path keeps dropout through the dense fallback, so needed-only is downgraded up front.
_NO_DROPOUT_BACKENDS = frozenset({state.ATTN_BACKEND_TE, state.ATTN_BACKEND_FLEX})


def _cp_group_spans_nodes(group: Any) -> bool:
    """Heuristic: the CP group is larger than the ranks of one node (no GPU<->NIC peer-to-peer assumed).

    ``LONGTRAIN_CP_ALLOW_XNODE=1`` answers False (forces needed-only across nodes, for validation). The ranks
    per node come from ``LOCAL_WORLD_SIZE``, then ``NPROC_PER_NODE``, then the visible CUDA device count.
    """
    global _KV_XNODE_LOGGED
    if os.environ.get(ALLOW_XNODE_ENV) == "1":
        return False
    world = torch.distributed.get_world_size(group)
    local_ws = 0
    for var in ("LOCAL_WORLD_SIZE", "NPROC_PER_NODE"):
        try:
            local_ws = int(os.environ.get(var, "0"))
        except ValueError:
            local_ws = 0
        if local_ws > 0:
            break
    if local_ws <= 0:
        try:
            local_ws = torch.cuda.device_count()
        except Exception:
            local_ws = world
    spans = local_ws > 0 and world > local_ws
    if spans and not _KV_XNODE_LOGGED:
        _KV_XNODE_LOGGED = True
        logger.warning(
            "block-diagonal CP group of %d ranks spans nodes (%d ranks per node): the needed-only K/V exchange is "
            "disabled and all-gather is used (set %s=1 to force it)",
            world,
            local_ws,
            ALLOW_XNODE_ENV,
        )
    return spans


def _resolve_cp_varlen_config(step: dict) -> tuple[str, str]:
    """``(attn_backend, kv_exchange)`` from the step's snapshot; missing keys read the current knobs."""
    cfg = state.cp_varlen_runtime_config()
    return step.get("attn_backend", cfg["attn_backend"]), step.get("kv_exchange", cfg["kv_exchange"])


def _effective_backend(configured: str, dtype: torch.dtype, device: Any, dropout_p: float) -> str:
    """The concrete backend a call runs: ``"auto"`` resolved for the call's dtype/device/dropout."""
    configured = state.normalize_attn_backend(configured)
    if configured == state.ATTN_BACKEND_AUTO:
        return backends.resolve_varlen_backend("auto", dtype, device, dropout_p)
    return configured


def _needed_only_preflight(
    step: dict,
    group: Any,
    backend: str,
    query_dtype: torch.dtype,
    device: Any,
    *,
    query_len: int,
    key_len: int,
) -> tuple[bool, str | None]:
    """Once per step: can every rank run the needed-only path? One all-reduce(MIN) and one sync, memoised.

    The local check covers the backend (dtype, device, library), the host validation of the step meta and the
    exchange plan (computed here, memoised in ``step["kv_plan"]``; it must agree with this rank's meta).
    """
    key = (backend, str(query_dtype), str(device), int(query_len), int(key_len))
    memo = step.get("_needed_only_preflight")
    if memo is not None and memo[0] == key:
        return memo[1], memo[2]
    reason = _local_needed_only_reason(step, group, backend, query_dtype, device, query_len, key_len)
    ok = _all_ranks_ok(reason is None, group, device)
    if not ok and reason is None:
        reason = "varlen kernel is unavailable on at least one CP rank"
    step["_needed_only_preflight"] = (key, ok, reason)
    return ok, reason


def _local_needed_only_reason(
    step: dict, group: Any, backend: str, dtype: torch.dtype, device: Any, query_len: int, key_len: int
) -> str | None:
    if backend not in state.VARLEN_ATTN_BACKENDS:
        return f"needed-only requires a varlen kernel (flash/te/cudnn/flex/reference), got {backend}"
    reason = kernels._varlen_backend_unavailable_reason(backend, dtype, torch.device(device))
    if reason is not None:
        return reason
    gm = step.get("varlen_meta")
    reason = kernels._varlen_metadata_unavailable_reason(gm, query_len=query_len, key_len=key_len, device=device)
    if reason is not None:
        return reason
    try:
        plan = _plan_for_step(step, group, query_len, device, step.get("row_offset", 0))
    except Exception as exc:  # bad ids: every rank sees the same replicated ids, reported through the consensus
        return f"exchange plan failed: {type(exc).__name__}: {str(exc)[:200]}"
    rank = plan["rank"]
    n_real = int(gm.get("n_real", 0))
    if plan["nreal"][rank] != n_real or (
        n_real and (plan["s_first"][rank] != int(gm["s_first"]) or plan["real_end"][rank] != int(gm["real_end"]))
    ):
        return (
            f"exchange plan disagrees with this rank's varlen meta (plan n_real/s_first/real_end="
            f"{plan['nreal'][rank]}/{plan['s_first'][rank]}/{plan['real_end'][rank]}, meta={n_real}/"
            f"{gm.get('s_first')}/{gm.get('real_end')})"
        )
    return None


def _plan_for_step(step: dict, group: Any, local_len: int, device: Any, offset: int) -> dict:
    plan = step.get("kv_plan")
    if plan is None:
        world = torch.distributed.get_world_size(group)
        plan = exchange._compute_blockdiag_kv_plan(step["doc_ids"], world, local_len, device)
        plan["rank"] = offset // local_len if local_len else 0
        plan["world"] = world
        step["kv_plan"] = plan
    return plan


def _needed_only_kernel_succeeded_on_all_ranks(
    out: torch.Tensor | None, group: Any, device: Any, *, diagnostic: dict | None = None
) -> bool:
    """After a needed-only exchange: did the kernel succeed on every rank? One all-reduce(MIN) + one sync.

    An all-padding rank (which launches no kernel) contributes success. Asynchronous CUDA faults of the
    kernel usually surface here; they are logged with the diagnostic and re-raised.
    """
    return _all_ranks_ok(out is not None, group, device, diagnostic=diagnostic)


def _all_ranks_ok(ok: bool, group: Any, device: Any, *, diagnostic: dict | None = None) -> bool:
    """All-reduce(MIN) of ``ok`` over the group and one sync; ``ok`` itself without a multi-rank group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return ok
    try:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    except Exception as exc:  # an asynchronous CUDA fault of the kernel surfaces at the first device op
        try:
            grank = dist.get_rank()
        except Exception:
            grank = -1
        logger.exception(
            "CP_NEEDED_ONLY_ASYNC_ERROR global_rank=%s device=%s error=%s diagnostic=%s", grank, device, exc, diagnostic
        )
        raise
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _select_kv_exchange_path(
    step: dict,
    group: Any,
    doc_ids: torch.Tensor,
    local_len: int,
    device: Any,
    offset: int,
    *,
    query_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    backend: str | None = None,
) -> tuple[str, dict | None, str]:
    """``(path, plan, reason)`` with path ``"allgather"``, ``"halo"`` or ``"a2a"``; first matching rule wins.

    1. exchange is allgather -> allgather ("mode=allgather").
    2. the backend is not a varlen kernel (dense) -> allgather.
    3. dropout with a backend that cannot apply it -> allgather (the dense fallback keeps dropout).
    4. the step has no ``varlen_meta`` -> allgather.
    5. the group spans nodes -> allgather.
    6. the preflight consensus fails on any rank -> allgather (on every rank).
    7. halo requested and every straddle fits on the left neighbour -> halo; otherwise a2a.

    Rules 1-5 depend only on replicated config, data and environment; rule 6 is an all-reduce. ``backend``
    is the concrete backend of the call (``"auto"`` already resolved); None resolves the step's setting.
    """
    configured, exchange_mode = _resolve_cp_varlen_config(step)
    exchange_mode = state.normalize_kv_exchange(exchange_mode)
    if exchange_mode not in _NEEDED_ONLY:
        return state.KV_EXCHANGE_ALLGATHER, None, f"mode={exchange_mode}"
    if backend is None:
        backend = _effective_backend(configured, query_dtype or torch.get_default_dtype(), device, dropout_p)
    if state.normalize_attn_backend(configured) == state.ATTN_BACKEND_DENSE or backend == state.ATTN_BACKEND_DENSE:
        return (
            state.KV_EXCHANGE_ALLGATHER,
            None,
            f"needed-only requires a varlen kernel (flash/te/cudnn/flex/reference), got {backend}",
        )
    if dropout_p > 0 and backend in _NO_DROPOUT_BACKENDS:
        return (
            state.KV_EXCHANGE_ALLGATHER,
            None,
            f"{backend} varlen cannot apply dropout; dense fallback requires allgather",
        )
    if step.get("varlen_meta") is None:
        return state.KV_EXCHANGE_ALLGATHER, None, "no varlen_meta (dense / non-varlen step)"
    if _cp_group_spans_nodes(group):
        return state.KV_EXCHANGE_ALLGATHER, None, "CP group spans nodes (no GPU<->NIC P2P)"
    if query_dtype is not None:
        key_len = int(doc_ids.shape[-1])
        ok, reason = _needed_only_preflight(
            step, group, backend, query_dtype, device, query_len=local_len, key_len=key_len
        )
        if not ok:
            return state.KV_EXCHANGE_ALLGATHER, None, f"needed-only preflight failed: {reason}"
    plan = _plan_for_step(step, group, local_len, device, offset)
    if exchange_mode == state.KV_EXCHANGE_HALO and plan["use_halo"]:
        return state.KV_EXCHANGE_HALO, plan, "neighbor p2p (doc<=2 ranks)"
    return state.KV_EXCHANGE_A2A, plan, "all-to-all-v (doc spans >2 ranks)"


def _dense_fallback(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    doc_ids: torch.Tensor,
    row_offset: int,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    return kernels.dense_blockdiag_sdpa(query, key, value, doc_ids, row_offset, scale=scale, dropout_p=dropout_p)


def _log_path_once(path: str, reason: str, group: Any, local_len: int, backend: str) -> None:
    global _KV_EXCHANGE_PATH_LOGGED
    if _KV_EXCHANGE_PATH_LOGGED:
        return
    _KV_EXCHANGE_PATH_LOGGED = True
    try:
        cp_size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else -1
    except Exception:
        cp_size = -1
    logger.info(
        "block-diagonal CP K/V path=%s (%s) backend=%s cp_size=%d local_len=%d",
        path,
        reason,
        backend,
        cp_size,
        local_len,
    )


def _cp_blockdiag_sdpa_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    step = state._CP_BLOCKDIAG_STATE.get()
    if step is None:
        _check_recompute_outside_context()
        return _ORIGINAL_SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip
    state._CP_ATTN_FIRE_COUNT[0] += 1
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        step["_grad_calls"] = True
    group, doc_ids, row_offset = step["group"], step["doc_ids"], int(step["row_offset"])
    configured, _ = _resolve_cp_varlen_config(step)
    local_len = query.shape[2]
    device = query.device
    backend = _effective_backend(configured, query.dtype, device, dropout_p)
    gm = step.get("varlen_meta")
    path, plan, reason = _select_kv_exchange_path(
        step, group, doc_ids, local_len, device, row_offset, query_dtype=query.dtype, dropout_p=dropout_p,
        backend=backend,
    )  # fmt: skip
    _log_path_once(path, reason, group, local_len, backend)

    if path in _NEEDED_ONLY:
        driver = exchange._blockdiag_halo_attention if path == "halo" else exchange._blockdiag_a2a_attention
        out = driver(query, key, value, doc_ids, group, plan, gm, row_offset, scale, backend, dropout_p)
        diagnostic = gm.get("_needed_only_diagnostic") if isinstance(gm, dict) else None
        if _needed_only_kernel_succeeded_on_all_ranks(out, group, device, diagnostic=diagnostic):
            return out
        logger.error(
            "needed-only CP %s exchange: varlen kernel failed on at least one rank (this rank ok=%s) diagnostic=%s",
            path,
            out is not None,
            diagnostic,
        )
        raise RuntimeError(
            f"needed-only CP {path} exchange completed, but the {backend} varlen kernel failed on at least one CP "
            "rank; all ranks are refusing an unsafe post-exchange full-allgather fallback (the all-gather exchange, "
            "configure_cp_varlen(kv_exchange='allgather'), can fall back to the dense mask per rank)"
        )

    hkv = key.shape[1]
    kv_full = exchange._AllGatherSeqDiff.apply(torch.cat([key, value], dim=1), group, 2)
    k_full, v_full = kv_full[:, :hkv], kv_full[:, hkv:]
    if backend != state.ATTN_BACKEND_DENSE:
        out = kernels._cp_blockdiag_varlen(
            query, k_full, v_full, doc_ids, row_offset, scale, backend=backend, dropout_p=dropout_p, meta=gm
        )
        if out is not None:
            if isinstance(gm, dict) and int(gm.get("n_real", -1)) == 0:
                # All-padding rank: make its zeros save a tensor too, so checkpoint recompute of this region
                # re-issues the all-gather here as on every other rank (see exchange._zero_touch).
                out = out + exchange._zero_touch(query, kv_full)
            return out
    return _dense_fallback(query, k_full, v_full, doc_ids, row_offset, scale, dropout_p)


def _check_recompute_outside_context() -> None:
    """Raise when activation-checkpoint recompute runs after the CP context exited.

    The recompute would otherwise run stock, local-only SDPA: same shapes, silently wrong gradients. The
    marker is set when a context exits after CP attention ran with grad, and cleared by the next context or by
    the next forward call outside any context (the model is then used without CP).
    """
    last = state._CP_LAST_EXITED_STATE.get()
    if last is None:
        return
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None or task_id() == -1:  # not inside a backward pass (or a torch that cannot tell)
        state._CP_LAST_EXITED_STATE.set(None)
        return
    raise RuntimeError(
        "cp_blockdiag_sdpa ran during backward (activation-checkpoint recompute) after the block-diagonal CP "
        "context had exited: run loss.backward() inside `with ctx_factory():` (the context returned by "
        "make_cp_blockdiag_batch_and_ctx) so the recompute sees the step's CP state"
    )


# The implementation behind the public function; swapped for a ``torch.compiler.disable``-d version by
# ``_maybe_disable_dynamo`` once torch._dynamo is loaded (importing it here would import triton).
_IMPL = [_cp_blockdiag_sdpa_impl]


def _maybe_disable_dynamo() -> None:
    """Hide the CP runtime from torch.compile tracing (host syncs, collectives and Python control flow).

    Called eagerly by the batch builder and the cp=1 path; a no-op until the user's program has imported
    ``torch._dynamo`` (``torch.compile`` does), so ``import longtrain`` never imports it.
    """
    import sys

    if _IMPL[0] is not _cp_blockdiag_sdpa_impl or "torch._dynamo" not in sys.modules:
        return
    try:
        _IMPL[0] = torch._dynamo.disable(_cp_blockdiag_sdpa_impl, reason="block-diagonal CP runtime (collectives)")
    except TypeError:  # torch without the ``reason`` keyword
        _IMPL[0] = torch._dynamo.disable(_cp_blockdiag_sdpa_impl)


def cp_blockdiag_sdpa(
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
    """Drop-in for ``F.scaled_dot_product_attention`` on context-parallel shards of packed documents.

    ``query: [B, Hq, L, D]``, ``key/value: [B, Hkv, L, D]`` (this rank's local rows; B = 1 under CP), any
    float dtype; returns ``[B, Hq, L, D]``.

    - Outside a CP step context: exactly stock SDPA with the given arguments (extra ``**kwargs`` dropped).
    - Inside: ``attn_mask``, ``is_causal`` and ``**kwargs`` are ignored; the per-document causal mask is
      rebuilt from the step's replicated document ids. GQA (``Hq`` a multiple of ``Hkv``) is inferred
      whatever ``enable_gqa`` says. K/V travel over the CP group by the configured exchange, then the
      configured varlen backend runs (``"auto"``: the fastest for the call's dtype/device), or the dense mask
      when the backend is ``dense`` or the varlen kernel declines (all-gather path only). Real rows equal
      the single-process block-causal result; padding rows are zero on the varlen path and self-attending
      (``V[p]``) on the dense path: they carry label -100.
    - ``loss.backward()`` must run inside the context when activation checkpointing recomputes attention.
    """
    return _IMPL[0](query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
