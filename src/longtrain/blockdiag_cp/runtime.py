"""Block-diagonal attention over packed documents: the public varlen functions and the SDPA drop-in.

- :func:`varlen_attention`: flash-attn's calling convention on one device (``[total, H, D]`` + ``cu_seqlens``).
- :func:`cp_varlen_attention`: the same attention on this rank's shard of a :class:`~.step.CPStep`: K/V travel over
  the CP group by the step's exchange, then a provider runs; ``W = 1`` is the same path with no collective.
- :func:`cp_blockdiag_sdpa`: a layout adapter over :func:`cp_varlen_attention` for code that calls
  ``F.scaled_dot_product_attention``; it finds the step published by the batch builder's context.

Collective-order safety (every rank must issue the same collectives in the same order):

- The exchange path is chosen from replicated config and data, plus one all-reduce per step (the *preflight*)
  before a needed-only exchange: if any rank cannot run it, every rank uses all-gather.
- After a needed-only exchange, one all-reduce per call (the *post-kernel consensus*) makes every rank raise the
  same ``RuntimeError`` when the kernel failed anywhere, instead of one rank falling back alone.
- On the all-gather path (and at ``W = 1``) a rank-local fallback to the dense mask is safe: it adds no collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F

from . import consensus, exchange, providers, state
from .compiled import IMPL, register_eager, varlen_attention_op
from .mask import ORIGINAL_SDPA, dense_blockdiag_sdpa, masked_sdpa, rows_seeing
from .meta import VarlenMeta, meta_from_cu_seqlens, resolve_device
from .sanitize import fill_rows, sanitize
from .step import CPStep, build_cp_step

__all__ = [
    "ALLOW_XNODE_ENV",
    "attend",
    "autocast_like_sdpa",
    "check_dropout",
    "check_ranks_agree",
    "check_qkv",
    "check_recompute_outside_context",
    "cp_blockdiag_sdpa",
    "cp_varlen_attention",
    "current_cp_step",
    "refuse_on_every_rank",
    "select_kv_exchange_path",
    "varlen_attention",
]

logger = logging.getLogger(__name__)

#: Setting this environment variable to "1" allows the needed-only exchanges across nodes.
ALLOW_XNODE_ENV = "LONGTRAIN_CP_ALLOW_XNODE"

_NEEDED_ONLY = (state.KV_EXCHANGE_HALO, state.KV_EXCHANGE_A2A)
#: The consensus field that says whether a rank's first attention call of the step passed its own argument checks.
_OWN_CHECKS = "argument checks of the rank's first attention call"
_LOGGED: set[str] = set()
_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if e
)


def reraised_errors() -> tuple[type[BaseException], ...]:
    """Exceptions no fallback may swallow: out of memory (the dense fallback needs more) and non-reentrant
    checkpoint's early-stop signal, which is control flow, not a kernel failure."""
    import torch.utils.checkpoint as checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return _OOM_ERRORS + ((stop,) if stop is not None else ())


def reset_logs() -> None:
    """Re-arm the one-time log lines (``configure_cp_varlen`` calls this when the knobs change)."""
    _LOGGED.clear()


def _once(key: str, level: int, msg: str, *args: Any) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str = "q/k/v") -> None:
    """``ValueError``/``TypeError`` unless ``q: [T_q, Hq, D]`` and ``k/v: [T_k, Hkv, D]`` agree (``Hq % Hkv == 0``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be a packed [tokens, heads, head_dim] tensor, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"key and value shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query/key/value devices differ: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"query/key/value dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{what}: query heads ({hq}) must be a positive multiple of key/value heads ({hkv}); fix the model's "
            "num_key_value_heads"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{what}: query and key head dims differ: {q.shape[2]} vs {k.shape[2]}")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    backend: str,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """One provider over one segmentation. ``q: [L, Hq, D]`` (row ``i`` = the meta's query row ``i``), ``k/v:
    [S_k, Hkv, D]`` (key index = the meta's key coordinate) -> ``[L, Hq, D]`` with rows ``>= meta.n_real`` exactly 0.

    An all-padding chunk launches no kernel and returns zeros attached to ``q``, ``k`` and ``v`` (so the backward
    collectives of the exchange that produced ``k``/``v`` fire on every rank). A provider that does not isolate
    non-finite values by itself runs on inputs whose non-finite elements are zeroed, and every row that attends a
    non-finite query, key or value comes out NaN (zero gradients): one document's NaN never reaches another
    document. Provider errors propagate.
    """
    if meta.n_real == 0:
        return exchange.zero_touch(q, q, k, v)
    provider = providers.get(backend)
    n_real, length = meta.n_real, q.shape[0]
    kwargs = {"scale": scale, "dropout_p": dropout_p, "causal": causal, "deterministic": deterministic}
    if provider.full_rows:
        run_meta, qs, ks, vs = meta, q, k, v
    else:
        run_meta = meta.cache.get(("local", meta.s_first, meta.real_end))
        if run_meta is None:
            run_meta = meta.cache[("local", meta.s_first, meta.real_end)] = meta.rebased(
                0, meta.kv_len, share_cache=False
            )
        qs = q if n_real == length else q[:n_real]
        ks = k if (meta.s_first, meta.real_end) == (0, k.shape[0]) else k[meta.s_first : meta.real_end]
        vs = v if (meta.s_first, meta.real_end) == (0, v.shape[0]) else v[meta.s_first : meta.real_end]
    bad_rows = None
    isolates = provider.isolates_nonfinite
    if callable(isolates):
        isolates = isolates(qs, ks)
    if not isolates and state.nonfinite_mode() == state.NONFINITE_ISOLATE:
        (qs, bad_q), (ks, bad_k), (vs, bad_v) = sanitize(qs), sanitize(ks), sanitize(vs)
        bad_rows = rows_seeing(run_meta, bad_k | bad_v, qs.shape[0], causal) | bad_q
    out = provider.attention(qs, ks, vs, run_meta, **kwargs).reshape(qs.shape[0], q.shape[1], v.shape[2])
    if bad_rows is not None:
        out = fill_rows(out, bad_rows, float("nan"))
    if out.shape[0] < length:
        out = F.pad(out, (0, 0, 0, 0, 0, length - out.shape[0]))
    return out


# ----------------------------------------------------------------------------------------------------------
# single device
# ----------------------------------------------------------------------------------------------------------


def _max_seqlen(value: Any, name: str) -> int:
    """``int(value)`` (flash-attn takes an int), or a ``TypeError`` naming the argument."""
    try:
        return int(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"varlen_attention: {name} must be an int (the longest document), got {value!r}") from None


def _varlen_attention_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           dropout_p, backend):  # fmt: skip
    check_qkv(q, k, v, "varlen_attention")
    dropout_p = check_dropout(dropout_p, "varlen_attention")
    device = resolve_device(q.device)
    plan = meta_from_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], _max_seqlen(max_seqlen_q, "max_seqlen_q"),
        _max_seqlen(max_seqlen_k, "max_seqlen_k"), causal=bool(causal), device=device,
    )  # fmt: skip
    name = providers.resolve_backend(backend, q.dtype, device, dropout_p=dropout_p, meta=plan.meta)
    reason = providers.unavailable_reason(name, q.dtype, device, dropout_p=dropout_p)
    if reason is not None:
        raise ValueError(f"varlen_attention: backend {name!r} cannot run this call: {reason}; use backend='auto'")
    kwargs = {"scale": softmax_scale, "dropout_p": float(dropout_p), "causal": bool(causal),
              "deterministic": torch.are_deterministic_algorithms_enabled()}  # fmt: skip
    if plan.q_index is None:
        return attend(q, k, v, plan.meta, name, **kwargs)
    if plan.meta.n_real == 0:  # no query sees a key: zeros, still attached to q/k/v
        return exchange.zero_touch(q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q, k, v)
    out = attend(q.index_select(0, plan.q_index), k.index_select(0, plan.k_index), v.index_select(0, plan.k_index),
                 plan.meta, name, **kwargs)  # fmt: skip
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[2]).index_copy(0, plan.q_index, out)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-document attention over packed documents, flash-attn's ``flash_attn_varlen_func`` convention.

    Args:
        q: ``[T_q, Hq, D]`` packed queries, any float dtype (the fast kernels need fp16/bf16 on CUDA).
        k, v: ``[T_k, Hkv, D]`` packed keys and values, ``Hq % Hkv == 0`` (GQA native: heads are never repeated
            by the fast kernels).
        cu_seqlens_q, cu_seqlens_k: ``[N+1]`` int32/int64 document offsets on q's device, non-decreasing from 0;
            rows after ``cu[-1]`` are padding (zero output, never read as keys).
        max_seqlen_q, max_seqlen_k: at least the longest document's query / key count.
        causal: causal within each document, aligned **bottom-right** when a document has fewer queries than keys
            (query ``i`` of a document with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``); query rows
            that see no key (``Lq > Lk``) give exact zeros. ``False``: every query sees its whole document.
        softmax_scale: ``None`` -> ``D ** -0.5``.
        dropout_p: attention dropout (backends ``flash``, ``reference``, ``dense``).
        backend: ``"auto"`` (the fastest available for the dtype, device, dropout and layout) or any provider name
            or synonym (``cudnn``, ``fa4``, ``flash``, ``te``, ``flex``, ``reference``, ``dense``); a backend that
            cannot run this call is a ``ValueError`` saying why.

    Returns:
        ``[T_q, Hq, D]`` in q's dtype, differentiable in q, k and v.

    The offsets are validated on the host once per offsets tensor (one device-to-host copy); calls that pass the
    same unmodified tensors again (every layer of a step) reuse the result with no host work.

    Under ``torch.compile`` (``fullgraph=True`` included) a call without dropout is one opaque custom op
    (:mod:`.compiled`): this same eager function runs inside it at run time, and its backward recomputes the
    attention (one more attention forward per call in the backward, on the compiled path only). With
    ``dropout_p > 0`` it runs eagerly at a graph break.
    """
    if torch.compiler.is_compiling() and not dropout_p:
        name = state.normalize_attn_backend(backend)  # the op's schema takes a str (None -> "auto", as eager)
        return varlen_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, backend=name)  # fmt: skip
    return IMPL["varlen"](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           dropout_p, backend)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# context parallel
# ----------------------------------------------------------------------------------------------------------


def _spans_nodes(world: int) -> tuple[bool, int]:
    """``(spans, ranks per node)`` of :func:`_cp_group_spans_nodes` for a group of ``world`` ranks, read from this
    rank's environment."""
    if os.environ.get(ALLOW_XNODE_ENV) == "1":
        return False, 0
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
    return local_ws > 0 and world > local_ws, local_ws


def _cp_group_spans_nodes(group: Any) -> bool:
    """Heuristic: the CP group is larger than the ranks of one node (no GPU<->NIC peer-to-peer assumed).

    ``LONGTRAIN_CP_ALLOW_XNODE=1`` answers False (forces needed-only across nodes, for validation). The ranks
    per node come from ``LOCAL_WORLD_SIZE``, then ``NPROC_PER_NODE``, then the visible CUDA device count. Each rank
    reads its own environment; the step's rank check compares the answers (:func:`cp_varlen_attention`).
    """
    world = torch.distributed.get_world_size(group)
    spans, local_ws = _spans_nodes(world)
    if spans:
        _once("xnode", logging.WARNING,
              "block-diagonal CP group of %d ranks spans nodes (%d ranks per node): the needed-only K/V exchange is "
              "disabled and all-gather is used (set %s=1 to force it)", world, local_ws, ALLOW_XNODE_ENV)  # fmt: skip
    return spans


def _all_ranks_ok(ok: bool, group: Any, device: Any, *, diagnostic: dict | None = None) -> bool:
    """All-reduce(MIN) of ``ok`` over the group and one sync; ``ok`` itself without a multi-rank group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return ok
    try:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    except Exception as exc:  # an asynchronous CUDA fault of the kernel surfaces at the first device op
        logger.exception("CP_NEEDED_ONLY_ASYNC_ERROR device=%s error=%s diagnostic=%s", device, exc, diagnostic)
        raise
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _needed_only_local_reason(step: CPStep, backend: str, dtype: torch.dtype) -> str | None:
    reason = providers.unavailable_reason(backend, dtype, step.device)
    if reason is not None:
        return reason
    plan, meta, rank = step.kv_plan, step.varlen_meta, step.rank
    if plan is None:  # a balanced step: its all-to-all-v comes from the shard plan
        return None
    if plan.nreal[rank] != meta.n_real or (
        meta.n_real and (plan.s_first[rank] != meta.s_first or plan.real_end[rank] != meta.real_end)
    ):
        return (
            f"exchange plan disagrees with this rank's varlen meta (plan n_real/s_first/real_end="
            f"{plan.nreal[rank]}/{plan.s_first[rank]}/{plan.real_end[rank]}, meta={meta.n_real}/{meta.s_first}/"
            f"{meta.real_end})"
        )
    return None


def select_kv_exchange_path(step: CPStep, backend: str, dtype: torch.dtype, dropout_p: float = 0.0) -> tuple[str, str]:
    """``(path, reason)`` with path ``"allgather"``, ``"halo"`` or ``"a2a"``; the first matching rule wins.

    1. the step's exchange is allgather (or ``W == 1``) -> allgather ("mode=allgather").
    2. the backend is ``dense`` (not a varlen kernel) -> allgather.
    3. dropout with a backend that cannot apply it -> allgather (the dense fallback keeps dropout).
    4. the group spans nodes -> allgather.
    5. the preflight consensus fails on any rank -> allgather (on every rank).
    6. halo requested and every straddle fits on the left neighbour -> halo; otherwise a2a.

    Rules 1-4 depend only on replicated config, data and environment; rule 5 is one all-reduce. The answer is
    memoised on the step per ``(backend, dtype, dropout > 0)``: the preflight runs once per step.
    """
    key = ("path", backend, dtype, dropout_p > 0)
    hit = step.cache.get(key)
    if hit is not None:
        return hit
    mode = step.kv_exchange
    if mode not in _NEEDED_ONLY or step.world_size == 1:
        res = (state.KV_EXCHANGE_ALLGATHER, f"mode={mode}")
    elif backend == state.ATTN_BACKEND_DENSE:
        res = (state.KV_EXCHANGE_ALLGATHER,
               f"needed-only requires a varlen kernel (flash/te/cudnn/fa4/flex/reference), got {backend}")  # fmt: skip
    elif dropout_p > 0 and not providers.get(backend).dropout:
        res = (state.KV_EXCHANGE_ALLGATHER, f"{backend} varlen cannot apply dropout; dense fallback requires allgather")
    elif _cp_group_spans_nodes(step.group):
        res = (state.KV_EXCHANGE_ALLGATHER, "CP group spans nodes (no GPU<->NIC P2P)")
    else:
        reason = _needed_only_local_reason(step, backend, dtype)
        if not _all_ranks_ok(reason is None, step.group, step.device):
            res = (
                state.KV_EXCHANGE_ALLGATHER,
                f"needed-only preflight failed: {reason or 'varlen kernel is unavailable on at least one CP rank'}",
            )
        elif mode == state.KV_EXCHANGE_HALO and step.kv_plan is not None and step.kv_plan.use_halo:
            res = (state.KV_EXCHANGE_HALO, "neighbor p2p (doc<=2 ranks)")
        else:
            res = (state.KV_EXCHANGE_A2A, "all-to-all-v (doc spans >2 ranks, or balanced sharding)")
    step.cache[key] = res
    _once(f"path:{res[0]}", logging.INFO, "block-diagonal CP K/V path=%s (%s) backend=%s cp_size=%d local_len=%d",
          res[0], res[1], backend, step.world_size, step.local_len)  # fmt: skip
    return res


def _dense(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, step: CPStep, scale, dropout_p):
    """The dense-mask fallback on THD tensors (``k_full``: every key of the row, index = global position)."""
    out = dense_blockdiag_sdpa(
        q.transpose(0, 1).unsqueeze(0), k_full.transpose(0, 1).unsqueeze(0), v_full.transpose(0, 1).unsqueeze(0),
        step.doc_ids, step.row_offset, scale=scale, dropout_p=dropout_p,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def _attend_or_dense(q, k_full, v_full, step: CPStep, backend: str, scale, dropout_p, deterministic):
    """The all-gather path's attention: the provider, or the dense mask when it cannot run or raises."""
    if backend != state.ATTN_BACKEND_DENSE:
        reason = providers.unavailable_reason(backend, q.dtype, q.device, dropout_p=dropout_p)
        if reason is None:
            try:
                return attend(q, k_full, v_full, step.varlen_meta, backend, scale=scale, dropout_p=dropout_p,
                              deterministic=deterministic)  # fmt: skip
            except reraised_errors():
                raise
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                _once(f"failed:{backend}", logging.WARNING,
                      "block-diagonal CP varlen backend=%s failed (%s); falling back to the dense path", backend,
                      reason)  # fmt: skip
        else:
            _once(f"unavailable:{backend}:{q.dtype}", logging.WARNING,
                  "block-diagonal CP varlen backend=%s cannot run (%s); using the dense path", backend,
                  reason)  # fmt: skip
    out = _dense(q, k_full, v_full, step, scale, dropout_p)
    if step.varlen_meta.n_real == 0:
        # All-padding rank: make its output save a tensor too, so checkpoint recompute of this region re-issues
        # the exchange here as on every other rank (see exchange.zero_touch).
        out = out + exchange.zero_touch(q, q, k_full, v_full)
    return out


def check_ranks_agree(
    step: CPStep,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    kind: str = "attention",
    knobs: tuple[tuple[str, object], ...] = (),
) -> None:
    """Once per step and ``kind``, before its first size-dependent collective: every rank compares what decides the
    step's collectives and results (:mod:`.consensus`); a difference is the same :class:`~.consensus.CPMismatchError`
    on every rank.

    ``q: [L, Hq, D]`` / ``k: [L, Hkv, D]`` of the first attention of that ``kind`` that runs on the step;
    ``knobs``: ``(name, value)`` pairs of that attention's own settings that every rank must share (a DSA layer's
    backend, FP8 indexer, top-k, indexer heads: ranks that differ there would select differently and agree with no
    single-GPU run). Block-diagonal attention is ``kind="attention"``, DSA layers ``kind="dsa"``: a model with both
    pays one exchange per kind and step. Later calls of the same kind on the step, and one-rank steps, return at
    once. A rank whose first call of the kind fails its own argument checks publishes that instead
    (:func:`refuse_on_every_rank`), so the others raise at once rather than wait for it."""
    cache_key = f"ranks_agree:{kind}"
    if step.world_size == 1 or cache_key in step.cache:
        return
    payload = ";".join(
        f"{name}={value}"
        for name, value in (
            ("attention kind", kind),
            (_OWN_CHECKS, "passed"),
            ("document layout (ids hash/length)", step.layout_hash),
            ("world size", step.world_size),
            ("local length", step.local_len),
            ("dtype", str(q.dtype).replace("torch.", "")),
            ("query heads", q.shape[1]),
            ("key/value heads", k.shape[1]),
            ("head dim", q.shape[2]),
            ("attention backend", step.attn_backend),
            ("kv_exchange", step.kv_exchange),
            *knobs,
        )
    )
    payloads = consensus.exchange_fingerprints(step.group, step.rank, step.world_size, payload, state.step_timeout_s())
    problem = consensus.mismatch(payloads)
    if problem is not None and _OWN_CHECKS in problem:
        raise consensus.CPMismatchError(
            f"{problem}: the failed ranks raised their own ValueError/TypeError on their arguments (see their "
            "tracebacks); no collective of the step was issued"
        )
    if problem is not None:
        raise consensus.CPMismatchError(
            f"{problem}: every CP rank must build its step from the same packed row and run the same attention "
            "(same ids, dtype, heads and knobs); no collective of the step was issued"
        )
    step.cache[cache_key] = True


def refuse_on_every_rank(step: CPStep, kind: str = "attention") -> None:
    """Tell the other ranks that this rank's first attention call of ``kind`` on ``step`` failed its own argument
    checks, before the caller raises its error: they are waiting in :func:`check_ranks_agree` and raise a
    :class:`~.consensus.CPMismatchError` naming this rank at once, instead of waiting for ``step_timeout_s`` (or
    the store's timeout: 30 minutes by default). Nothing to do on one rank or once the step's check has passed
    (later calls issue no check: their failure is the caller's error alone)."""
    if step.world_size == 1 or f"ranks_agree:{kind}" in step.cache:
        return
    payload = f"attention kind={kind};{_OWN_CHECKS}=failed"
    with contextlib.suppress(Exception):  # best effort: the caller's own error is the one to raise
        consensus.exchange_fingerprints(step.group, step.rank, step.world_size, payload, state.step_timeout_s())


def check_dropout(dropout_p: Any, what: str) -> float:
    """``dropout_p`` as a float in ``[0, 1)``; a ``ValueError`` naming ``what`` outside it (NaN included), a
    ``TypeError`` for a non-number. (Stock SDPA would take a negative value as no dropout and 1.0 as an all-zero
    output, without a word.)"""
    try:
        value = float(dropout_p)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: dropout_p must be a number in [0, 1), got {dropout_p!r}") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{what}: dropout_p must be in [0, 1), got {dropout_p}")
    return value


def _check_cp_args(q, k, v, step: CPStep, dropout_p) -> float:
    check_qkv(q, k, v, "cp_varlen_attention")
    if q.shape[0] != step.local_len or k.shape[0] != step.local_len:
        raise ValueError(
            f"cp_varlen_attention takes this rank's shard of {step.local_len} rows (the step's local length); got "
            f"q/k of {q.shape[0]}/{k.shape[0]} rows"
        )
    return check_dropout(dropout_p, "cp_varlen_attention")


def _cp_varlen_attention_impl(q, k, v, step, softmax_scale, dropout_p):
    if not isinstance(step, CPStep):
        raise TypeError(
            f"step must be a CPStep (build_cp_step or the batch builder's context), got {type(step).__name__}"
        )
    try:
        dropout_p = _check_cp_args(q, k, v, step, dropout_p)
    except (TypeError, ValueError):
        refuse_on_every_rank(step)
        raise
    state.count_cp_attn_call()
    backend = step.backend_for(q.dtype, dropout_p)
    deterministic = torch.are_deterministic_algorithms_enabled()
    # whether dropout is on decides the exchange path (select_kv_exchange_path, rule 3) and, for "auto", the backend
    knobs: tuple[tuple[str, object], ...] = (("attention dropout", "on" if dropout_p > 0 else "off"),)
    if step.world_size > 1 and "ranks_agree:attention" not in step.cache:
        # read from each rank's environment, it decides the needed-only exchanges' path (select_kv_exchange_path)
        knobs += ((f"CP group spans nodes (LOCAL_WORLD_SIZE / NPROC_PER_NODE / {ALLOW_XNODE_ENV})",
                   _spans_nodes(step.world_size)[0]),)  # fmt: skip
    check_ranks_agree(step, q, k, knobs=knobs)
    if step.world_size == 1:
        return _attend_or_dense(q, k, v, step, backend, softmax_scale, dropout_p, deterministic)
    path, _ = select_kv_exchange_path(step, backend, q.dtype, dropout_p)
    if not step.contiguous:
        return _cp_pieces_attention(q, k, v, step, path, backend, softmax_scale, dropout_p, deterministic)
    kv = torch.stack([k, v])  # [2, L, Hkv, D]: K and V of the exchanged result stay contiguous views
    group, plan, rank = step.group, step.kv_plan, step.rank
    if path == state.KV_EXCHANGE_ALLGATHER:
        kv_full = exchange.all_gather_tokens(kv, group, dim=1)
        return _attend_or_dense(q, kv_full[0], kv_full[1], step, backend, softmax_scale, dropout_p, deterministic)
    if path == state.KV_EXCHANGE_HALO:
        recv = plan.recv[rank]
        if plan.max_halo > 0:
            prev_peer = exchange.global_rank(group, rank - 1) if rank > 0 else None
            next_peer = exchange.global_rank(group, rank + 1) if rank < step.world_size - 1 else None
            halo = exchange.left_halo(kv, group, plan.max_halo, prev_peer, next_peer, dim=1)[:, plan.max_halo - recv :]
            kv_needed = torch.cat([halo, kv], dim=1)
        else:
            kv_needed = kv
        first = step.row_offset - recv
    else:
        in_splits, out_splits, send_index = plan.a2a_splits(rank, q.device)
        kv_needed = exchange.needed_a2a(kv, group, in_splits, out_splits, send_index, dim=1)
        first = plan.s_first[rank]
    meta = step.varlen_meta
    local = meta if meta.n_real == 0 else meta.rebased(meta.s_first - first, meta.real_end - first)
    out, failure = None, None
    try:
        out = attend(q, kv_needed[0], kv_needed[1], local, backend, scale=softmax_scale, dropout_p=dropout_p,
                     deterministic=deterministic)  # fmt: skip
    except reraised_errors():
        raise
    except Exception as exc:
        failure = f"{type(exc).__name__}: {str(exc)[:200]}"
    diagnostic = {"path": path, "rank": rank, "world": step.world_size, "row_offset": step.row_offset,
                  "needed_len": int(kv_needed.shape[1]), "failure": failure}  # fmt: skip
    if _all_ranks_ok(out is not None, group, q.device, diagnostic=diagnostic):
        return out
    logger.error("needed-only CP %s exchange: varlen kernel failed on at least one rank (this rank: %s) diagnostic=%s",
                 path, failure or "ok", diagnostic)  # fmt: skip
    raise consensus.CPStepError(
        f"needed-only CP {path} exchange completed, but the {backend} varlen kernel failed on at least one CP rank; "
        "all ranks are refusing an unsafe post-exchange full-allgather fallback (the all-gather exchange, "
        "configure_cp_varlen(**{**cp_varlen_runtime_config(), 'kv_exchange': 'allgather'}), can fall back to the "
        "dense mask per rank)"
    )


def _dense_rows(q, k_full, v_full, step: CPStep, scale, dropout_p):
    """The dense-mask attention of this rank's rows at global positions ``step.token_index`` (``k_full``: every key
    of the row in row order): the balanced path's ``dense`` backend and fallback."""
    ids = step.doc_ids[0]
    pos = step.token_index
    q_doc, k_doc = ids[pos], ids
    keys = torch.arange(ids.numel(), device=ids.device)
    allow = (q_doc[:, None] == k_doc[None, :]) & (k_doc[None, :] > 0) & (keys[None, :] <= pos[:, None])
    allow |= keys[None, :] == pos[:, None]
    out = masked_sdpa(q.transpose(0, 1)[None], k_full.transpose(0, 1)[None], v_full.transpose(0, 1)[None],
                      allow[None, None], scale=scale, dropout_p=dropout_p)  # fmt: skip
    return out[0].transpose(0, 1)


def _cp_pieces_attention(q, k, v, step: CPStep, path: str, backend: str, scale, dropout_p, deterministic):
    """A balanced step: this rank's rows are several pieces of the row. K/V travel by all-gather (then the keys of
    every pass are picked from the gathered rows) or by one all-to-all-v of exactly the needed keys ("halo"
    becomes all-to-all-v); the keys are compacted pass by pass (a pass reads each key row at most once, so the
    gathers' backward is deterministic) and concatenated, all the rank's segments run as one varlen call, and its
    rows are written back to local order. Padding rows are zero. On the all-gather path a provider
    that cannot run or raises falls back to the dense mask on this rank alone (no collective depends on it); on
    the all-to-all-v path a failure on any rank is the same ``CPStepError`` on every rank."""
    pieces, group, rank = step.pieces, step.group, step.rank
    kv = torch.stack([k, v])
    gathered = path == state.KV_EXCHANGE_ALLGATHER
    if gathered:
        buf = exchange.all_gather_tokens(kv, group, dim=1)  # rows in plan order
        key_index = pieces.key_index("allgather", step.shard_plan.permutation, q.device)
    else:
        in_splits, out_splits, send_index, recv_pos = pieces.a2a_splits(rank, q.device)
        buf = exchange.needed_a2a(kv, group, in_splits, out_splits, send_index, dim=1)
        key_index = pieces.key_index("a2a", recv_pos, q.device)
    out = exchange.zero_touch(q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q, buf)
    failure = None
    if backend == state.ATTN_BACKEND_DENSE:
        failure = "the dense backend"
    else:
        failure = providers.unavailable_reason(backend, q.dtype, q.device, dropout_p=dropout_p)
    if failure is None:
        try:
            if pieces.passes:
                kvp = torch.cat([buf.index_select(1, kidx) for kidx in key_index], dim=1)  # [2, n_keys, Hkv, D]
                o = attend(q.index_select(0, pieces.q_rows), kvp[0], kvp[1], pieces.meta, backend, scale=scale,
                           dropout_p=dropout_p, deterministic=deterministic)  # fmt: skip
                out = out.index_copy(0, pieces.q_rows, o)
        except reraised_errors():
            raise
        except Exception as exc:
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
    if gathered:
        if failure is None:
            return out
        if backend != state.ATTN_BACKEND_DENSE:
            _once(f"failed:{backend}:pieces", logging.WARNING,
                  "block-diagonal CP varlen backend=%s cannot run or failed (%s); using the dense path", backend,
                  failure)  # fmt: skip
        inverse = pieces.cache.get(("inverse", str(q.device)))
        if inverse is None:
            perm = step.shard_plan.permutation
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel())
            inverse = pieces.cache[("inverse", str(q.device))] = inverse.to(q.device)
        full = buf.index_select(1, inverse)  # rows in row order
        return _dense_rows(q, full[0], full[1], step, scale, dropout_p) + out
    diagnostic = {"path": path, "rank": rank, "world": step.world_size, "sharding": "balanced",
                  "needed_len": int(buf.shape[1]), "failure": failure}  # fmt: skip
    if _all_ranks_ok(failure is None, group, q.device, diagnostic=diagnostic):
        return out
    raise consensus.CPStepError(
        f"balanced CP {path} exchange completed, but the {backend} varlen kernel failed on at least one CP rank; "
        "every rank raises this error (the all-gather exchange, configure_cp_varlen(**{**cp_varlen_runtime_config(), "
        "'kv_exchange': 'allgather'}), lets each rank fall back on its own)"
    )


def cp_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    step: CPStep,
    *,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Block-diagonal causal attention of this rank's shard of a packed row.

    Args:
        q: ``[L, Hq, D]`` this rank's queries (``L = step.local_len``, rows ``[step.row_offset, +L)`` of the row).
        k, v: ``[L, Hkv, D]`` this rank's keys and values (``Hq % Hkv == 0``).
        step: the :class:`~longtrain.blockdiag_cp.step.CPStep` of the row (the same object on every layer).
        softmax_scale: ``None`` -> ``D ** -0.5``.
        dropout_p: attention dropout in ``[0, 1)`` (``ValueError`` otherwise).

    Returns:
        ``[L, Hq, D]``: every real row equals single-device block-causal attention over the whole row; padding rows
        are zero (or attend to themselves when the dense fallback ran). Differentiable in q, k and v; the backward
        issues the mirror collectives of the exchange, so it must run while the group is alive.

    K/V travel by the step's exchange (all-gather, halo or all-to-all-v; none when ``W == 1``), then the step's
    backend runs (``"auto"``: the fastest for the call's dtype). Zero host syncs per call on the all-gather path;
    the needed-only paths make one all-reduce per call (the post-kernel consensus). Arguments that fail their checks
    raise ``ValueError``/``TypeError``; on the step's first call with ``W > 1`` the other ranks learn it in the step's
    check and raise :class:`~.consensus.CPMismatchError` instead of waiting for this rank.
    """
    if isinstance(step, CPStep):
        step.cache["attention_calls"] = True  # hf_cp_batch's context checks that some attention used its step
    return IMPL["cp_varlen"](q, k, v, step, softmax_scale, dropout_p)


# ----------------------------------------------------------------------------------------------------------
# the SDPA drop-in
# ----------------------------------------------------------------------------------------------------------


def current_cp_step() -> CPStep | None:
    """The :class:`~longtrain.blockdiag_cp.step.CPStep` published by the active step context, or None outside one."""
    return _step_from_slot(state.STEP_SLOT.get())


def _step_from_slot(value: Any) -> CPStep | None:
    """The slot's step; a hand-built legacy state dict (``group``, ``doc_ids``, ``row_offset`` and optionally
    ``attn_backend``/``kv_exchange``) is converted once and the result kept in the dict."""
    if value is None or isinstance(value, CPStep):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"the block-diagonal CP state slot holds a {type(value).__name__}, expected a CPStep")
    step = value.get("_cp_step")
    if step is None:
        ids = value["doc_ids"]
        row = ids[0] if ids.dim() == 2 else ids
        group = value.get("group")
        world = torch.distributed.get_world_size(group) if group is not None or _dist_on() else 1
        mesh = None if world == 1 else _GroupMesh(group, int(value.get("row_offset", 0)) * world // row.numel(), world)
        step = value["_cp_step"] = build_cp_step(
            row, mesh, attn_backend=value.get("attn_backend"), kv_exchange=value.get("kv_exchange")
        )
    return step


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _GroupMesh:
    """A group, a rank and a world size in the mesh protocol (for hand-built legacy states)."""

    def __init__(self, group: Any, rank: int, world: int):
        self._group, self._rank, self._world = group, rank, world

    def size(self) -> int:
        return self._world

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> Any:
        return self._group


def autocast_like_sdpa(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in the autocast dtype when ``torch.autocast`` is on for their device, as
    ``F.scaled_dot_product_attention`` casts its inputs there; otherwise unchanged.

    Under autocast a model's q and k often leave RoPE in float32 (fp32 cos/sin) while v leaves a Linear in bf16; the
    varlen paths take one dtype, so the SDPA-shaped entry points cast first, as the SDPA they stand in for does.
    """
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _cp_blockdiag_sdpa_impl(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    step = current_cp_step()
    if step is None:
        check_recompute_outside_context()
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    query, key, value = autocast_like_sdpa(query, key, value)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        step.cache["grad_calls"] = True
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if any(len(s) != 4 or s[0] != 1 or s[2] != step.local_len for s in shapes):
        refuse_on_every_rank(step)
        raise ValueError(
            f"inside a block-diagonal CP step, cp_blockdiag_sdpa takes this rank's shard [1, heads, {step.local_len}, "
            f"head_dim]; got q/k/v of shapes {shapes}. Attention over other tensors (e.g. a vision tower) should call "
            "torch.nn.functional.scaled_dot_product_attention directly"
        )
    out = cp_varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), step,
                              softmax_scale=scale, dropout_p=dropout_p)  # fmt: skip
    return out.transpose(0, 1).unsqueeze(0)


def check_recompute_outside_context(what: str = "cp_blockdiag_sdpa") -> None:
    """Raise when activation-checkpoint recompute of CP attention (``what``) runs after the CP context exited.

    The recompute would otherwise run stock, local-only attention: same shapes, silently wrong gradients. The
    marker is set when a context exits after CP attention ran with grad, and cleared by the next context or by
    the next forward call outside any context (the model is then used without CP).
    """
    last = state.LAST_EXITED_SLOT.get()
    if last is None:
        return
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None or task_id() == -1:  # not inside a backward pass (or a torch that cannot tell)
        state.LAST_EXITED_SLOT.set(None)
        return
    raise RuntimeError(
        f"{what} ran during backward (activation-checkpoint recompute) after the block-diagonal CP "
        "context had exited: run loss.backward() inside `with ctx_factory():` (the context returned by "
        "make_cp_blockdiag_batch_and_ctx) so the recompute sees the step's CP state"
    )


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

    ``query: [B, Hq, L, D]``, ``key/value: [B, Hkv, L, D]`` (this rank's local rows; B = 1 inside a step), any
    float dtype; returns ``[B, Hq, L, D]``.

    - Outside a step context: exactly stock SDPA with the given arguments (extra ``**kwargs`` dropped).
    - Inside (``make_cp_blockdiag_batch_and_ctx``'s context, at any world size, 1 included): a layout adapter
      over :func:`cp_varlen_attention` with the published step. ``attn_mask``, ``is_causal`` and ``**kwargs`` are
      ignored (the per-document causal mask comes from the step's document ids); GQA (``Hq`` a multiple of
      ``Hkv``) is inferred whatever ``enable_gqa`` says. Real rows equal the single-process block-causal result;
      padding rows are zero on the varlen path and self-attending (``V[p]``) on the dense path: they carry label
      -100. A call whose shapes are not this rank's shard is a ``ValueError``. Under ``torch.autocast`` q/k/v are
      cast to the autocast dtype first, as stock SDPA does.
    - ``loss.backward()`` must run inside the context when activation checkpointing recomputes attention.
    """
    return IMPL["cp_blockdiag_sdpa"](query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# The implementations behind the public functions, in ``compiled.IMPL``; swapped for ``torch.compiler.disable``-d
# versions by ``maybe_disable_dynamo`` once torch._dynamo is loaded.
register_eager("cp_blockdiag_sdpa", _cp_blockdiag_sdpa_impl)
register_eager("cp_varlen", _cp_varlen_attention_impl)
register_eager("varlen", _varlen_attention_impl)
