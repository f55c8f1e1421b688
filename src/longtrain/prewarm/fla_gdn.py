"""fla gated-delta-net (GDN) autotune warmup: structural discovery and end-to-end fwd+bwd passes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from longtrain.prewarm._common import (
    _cdiv,
    _device_and_shapes,
    _log,
    _log_failure,
    _named_modules_with_dtype,
    _note_shapes,
    _note_skip,
    _pkg,
    _release,
    _rng_neutral,
    _skip,
    _synchronize,
)

GDNShape = tuple[int, int, int, torch.dtype]

# cu_seqlens dtypes of the packed passes. Triton appends every tensor argument's dtype to the autotune key,
# so an int32 cu_seqlens and an int64 one are different keys. fla documents a LongTensor; fla's own unpadding
# helpers, its CP context (0.6) and flash-attn-style packers produce int32. Both are warmed.
_GDN_PACKED_CU_SEQLENS_DTYPES: tuple[tuple[str, torch.dtype], ...] = (
    ("packed", torch.int64),
    ("packed-int32", torch.int32),
)
# fla >= 0.6 keys its fused l2-norm kernels on NB = cdiv(B * T * H, 2048 * 32): a bucket of the token count.
_FLA_L2NORM_ROWS_PER_BUCKET = 2048 * 32


@runtime_checkable
class _GDNAttention(Protocol):
    """Structural type of a gated-delta-net attention module.

    Matches modules (e.g. Qwen3-Next / Qwen3.5 GDN attention layers) that expose the head geometry needed to
    reconstruct the fla kernel shapes plus the ``chunk_gated_delta_rule`` op backed by those kernels. Presence
    of the four attributes is what matches; their values are not type-checked. q and k are expected to be
    expanded to ``num_v_heads`` heads before the op is called (so ``num_v_heads`` is the kernel head count).
    """

    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    chunk_gated_delta_rule: Callable[..., Any]


def _collect_gdn_autotune_shapes(model_parts: list[torch.nn.Module]) -> dict[GDNShape, str]:
    """Discover the gated-delta-net kernel shapes present in ``model_parts``.

    A module counts as a GDN attention module when it structurally matches :class:`_GDNAttention`. Most fla
    autotune caches are keyed on ``(H, K, V[, BT])`` rather than sequence length. Dense cumulative-sum kernels
    additionally key on batch size; that runtime value is handled by the warmup rather than shape discovery.

    The dtype is the compute dtype the kernels will see: a module's ``prewarm_dtype`` attribute if set, else
    the FSDP2 mixed-precision ``param_dtype`` governing the module, else the dtype of its largest
    fp16/bf16/fp32 parameter (its own small fp32 ``A_log``-like parameters come first), else bfloat16.

    Args:
        model_parts: model parts to scan for GDN modules.

    Returns:
        Mapping of ``(num_v_heads, head_k_dim, head_v_dim, dtype)`` to the qualified name (within its part) of
        the first module with that shape, in discovery order (the warmup order).
    """
    shapes: dict[GDNShape, str] = {}
    for part in model_parts:
        for name, module, dtype in _named_modules_with_dtype(part):
            if not isinstance(module, _GDNAttention):
                continue
            key = (int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim), dtype)
            shapes.setdefault(key, name)
    return shapes


def _describe(shapes: dict[GDNShape, str]) -> list[str]:
    return [f"H={h} K={k} V={v} {dtype} ({name or '<root>'})" for (h, k, v, dtype), name in shapes.items()]


def _check_positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


Mode = tuple[str, int, int, torch.dtype | None]  # (label, batch, seq_len, cu_seqlens dtype or None = dense)


def _run_gdn_passes(
    op: Callable[..., Any],
    shapes: dict[GDNShape, str],
    device: torch.device,
    modes_for: Callable[[GDNShape], Iterable[Mode]],
) -> bool:
    """fwd+bwd of ``op`` for every shape and mode; one failing (shape, mode) is logged and the loop goes on."""
    ran = False
    with _rng_neutral(device), torch.enable_grad():
        for key, name in shapes.items():
            H, K, V, dtype = key
            for mode, B, T, cu_dtype in modes_for(key):
                _log().info(
                    "Prewarming fla GDN %s path | module=%s B=%d T=%d H=%d K=%d V=%d dtype=%s",
                    mode, name, B, T, H, K, V, dtype,
                )  # fmt: skip
                try:
                    q = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
                    k = torch.randn(B, T, H, K, device=device, dtype=dtype, requires_grad=True)
                    v = torch.randn(B, T, H, V, device=device, dtype=dtype, requires_grad=True)
                    g = torch.zeros(B, T, H, device=device, dtype=torch.float32, requires_grad=True)
                    beta = torch.full((B, T, H), 0.5, device=device, dtype=dtype, requires_grad=True)
                    cu_seqlens = None if cu_dtype is None else torch.tensor([0, T], device=device, dtype=cu_dtype)
                    out = op(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
                    out[0].sum().backward()
                    _synchronize(device)
                    ran = True
                except Exception:
                    _log_failure("fla GDN %s end-to-end prewarm failed for %s; continuing.", mode, name)
                finally:
                    q = k = v = g = beta = cu_seqlens = out = None
                    _release(device)
    return ran


def _import_gdn_op() -> Callable[..., Any] | None:
    ok, op = _pkg().safe_import_from("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    if not ok:
        _log().info("Skipping fla GDN end-to-end prewarm: fla is not importable.")
        _note_skip("fla is not importable")
        return None
    return op


def _prewarm_fla_gdn_end_to_end(
    shapes: dict[GDNShape, str], device: torch.device, seq_len: int, batch_size: int = 1
) -> bool:
    """Run dense and packed fwd+bwd warmups through ``chunk_gated_delta_rule``.

    This caches the autotune config of every kernel in the op's call graph (cumsum, kkt, solve_tril, w/u
    recompute, chunk fwd h, chunk o, dqkwg, dhu, l2norm, ...) for both ``IS_VARLEN=False`` and
    ``IS_VARLEN=True`` while the allocator pool is empty. Runs with grad enabled (also under a caller's
    ``no_grad``) so the backward kernels fire. The dense path uses the real per-rank batch size because fla's
    cumulative-sum autotuner includes it in its cache key; packed GDN always flattens to batch size 1 and is
    run once per cu_seqlens dtype (int64, then int32: the dtype is part of the key). The op is called as
    ``op(q, k, v, g=, beta=, use_qk_l2norm_in_kernel=True, cu_seqlens=)`` with ``q, k: [B, T, H, K]``,
    ``v: [B, T, H, V]`` in the module dtype, ``g: [B, T, H]`` fp32, ``beta: [B, T, H]`` in the module dtype.
    RNG-neutral (CPU and the target CUDA generator); a CPU device is allowed (no CUDA call is made then).

    Args:
        shapes: ``(num_v_heads, head_k_dim, head_v_dim, dtype) -> module name``, as returned by
            :func:`_collect_gdn_autotune_shapes`.
        device: target CUDA device.
        seq_len: warmup sequence length (not part of the autotune key).
        batch_size: per-rank batch size for the dense path.

    Returns:
        True if the warmup ran for at least one (shape, mode).
    """
    _check_positive_int(seq_len, "seq_len")
    _check_positive_int(batch_size, "batch_size")
    op = _import_gdn_op()
    if op is None:
        return False
    dev = torch.device(device)

    def modes_for(key: GDNShape) -> list[Mode]:
        modes: list[Mode] = [("dense", batch_size, seq_len, None)]
        modes += [(label, 1, seq_len, dtype) for label, dtype in _GDN_PACKED_CU_SEQLENS_DTYPES]
        return modes

    ran = _run_gdn_passes(op, shapes, dev, modes_for)
    _log().info("Finished fla GDN autotune prewarm.")
    return ran


def _prewarm_fla_gdn_autotune(
    model_parts: list[torch.nn.Module],
    device: torch.device | int | str | None,
    seq_len: int = 64,
    batch_size: int = 1,
) -> bool:
    """Pre-populate fla gated-delta-net autotune caches before large activations exist.

    On its first launch each Triton-autotuned kernel benchmarks all candidate configs; when that first launch
    is the step-1 backward at peak memory, the benchmark allocations can fail with ``Triton Error [CUDA]: out
    of memory``. Three warmup paths run per unique GDN shape found in ``model_parts``:

    1. the context-parallel backward kernels (:func:`_prewarm_fla_gdn_cp_kernels`), which the end-to-end
       warmups cannot reach; a failure there is logged and does not skip the next two;
    2. a dense end-to-end fwd+bwd using the real per-rank batch size, and
    3. packed end-to-end fwd+bwd passes with ``cu_seqlens`` (:func:`_prewarm_fla_gdn_end_to_end`).

    fla >= 0.6's fused l2-norm kernels also key on a bucket of the token count; those are warmed by the
    separate ``fla_gdn_seq_len`` option (:func:`_prewarm_fla_gdn_l2norm_bucket`).

    Args:
        model_parts: model parts to scan for GDN modules.
        device: target CUDA device (skipped when None or not CUDA).
        seq_len: warmup sequence length (not part of the autotune key).
        batch_size: per-rank dense training batch size.

    Returns:
        True if at least the end-to-end prewarm ran, False if skipped.
    """
    _check_positive_int(seq_len, "seq_len")
    _check_positive_int(batch_size, "batch_size")
    pkg = _pkg()
    dev, shapes = _device_and_shapes(
        device,
        "fla GDN autotune",
        "_collect_gdn_autotune_shapes",
        model_parts,
        "no gated-delta-net modules found",
        "fla GDN autotune prewarm enabled but no gated-delta-net modules were found.",
    )
    if dev is None:
        return False
    listing = sorted((h, k, v, str(dtype), name) for (h, k, v, dtype), name in shapes.items())
    _log().info("Prewarming fla GDN autotune caches for %d unique shape(s): %s", len(shapes), listing)
    _note_shapes(_describe(shapes))
    try:
        pkg._prewarm_fla_gdn_cp_kernels(shapes, dev, seq_len)
    except Exception:
        _log_failure("fla CP GDN kernel prewarm failed; continuing with the end-to-end prewarm.")
    return pkg._prewarm_fla_gdn_end_to_end(shapes, dev, seq_len, batch_size)


def _l2norm_bucket_seq_len(num_heads: int, batch_size: int, train_seq_len: int) -> int | None:
    """The shortest T whose ``batch_size * T * num_heads`` rows fall in training's l2-norm bucket (None: bucket 1).

    fla tunes one config per bucket, so any row count inside the bucket hits the same key; the shortest keeps
    the warmup's memory to the minimum.
    """
    rows = batch_size * train_seq_len * num_heads
    bucket = _cdiv(rows, _FLA_L2NORM_ROWS_PER_BUCKET)
    if bucket <= 1:
        return None
    return (bucket - 1) * _FLA_L2NORM_ROWS_PER_BUCKET // (batch_size * num_heads) + 1


def _prewarm_fla_gdn_l2norm_bucket(
    model_parts: list[torch.nn.Module],
    device: torch.device | int | str | None,
    batch_size: int,
    train_seq_len: int,
) -> bool:
    """Warm fla's token-bucketed l2-norm kernels for the training token count (one dense fwd+bwd per shape).

    fla >= 0.6 keys ``l2norm_fwd_kernel`` / ``l2norm_bwd_kernel`` on ``cdiv(B * T * H, 65536)``, so the
    64-token passes of :func:`_prewarm_fla_gdn_end_to_end` only cover bucket 1. This runs the op once more per
    shape with the shortest sequence that lands in training's bucket; every other kernel's key is unchanged,
    so only the l2-norm kernels tune here. Transient memory is about one GDN op's activations at that length.

    Args:
        model_parts: model parts to scan for GDN modules.
        device: target CUDA device (skipped when None or not CUDA).
        batch_size: per-rank batch size (1 for packed batches).
        train_seq_len: per-rank tokens per sample in training (the packed length for packed batches, after
            context-parallel sharding).

    Returns:
        True if a warmup ran for at least one shape; False if skipped (bucket 1 needs nothing).
    """
    _check_positive_int(batch_size, "batch_size")
    _check_positive_int(train_seq_len, "fla_gdn_seq_len")
    pkg = _pkg()
    dev = pkg._resolve_cuda_device(device, "fla GDN l2norm bucket")
    if dev is None:
        return False
    shapes = pkg._collect_gdn_autotune_shapes(model_parts)
    needed = {key: name for key, name in shapes.items() if _l2norm_bucket_seq_len(key[0], batch_size, train_seq_len)}
    if not needed:
        _skip("Skipping fla GDN l2norm bucket prewarm: no shape needs a bucket beyond the first.")
        return False
    op = _import_gdn_op()
    if op is None:
        return False

    def modes_for(key: GDNShape) -> list[Mode]:
        T = _l2norm_bucket_seq_len(key[0], batch_size, train_seq_len)
        assert T is not None
        return [("l2norm-bucket", batch_size, T, None)]

    return _run_gdn_passes(op, needed, dev, modes_for)
