"""Mamba-2 SSD autotune warmup (``mamba_ssm``'s Triton chunked scan)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from longtrain.prewarm._common import (
    _device_and_shapes,
    _log,
    _log_failure,
    _named_modules_with_dtype,
    _note_shapes,
    _note_skip,
    _pkg,
    _release,
    _rng_neutral,
    _synchronize,
)

MambaShape = tuple[int, int, int, int, int, torch.dtype]  # (H, P, N, G, chunk_size, dtype)


@runtime_checkable
class _MambaSSDContextParallel(Protocol):
    """Per-rank geometry a context-parallel Mamba mixer carries (heads and groups after CP sharding)."""

    num_heads_local: int
    n_groups_local: int


@runtime_checkable
class _MambaSSDMixer(Protocol):
    """Structural type of a Mamba-2 SSD mixer: presence of these attributes matches (values not type-checked).

    ``cp`` is None without context parallelism, else an object matching :class:`_MambaSSDContextParallel`.
    A mixer without a ``cp`` attribute does not match; set ``mixer.cp = None`` to opt one in.
    """

    num_heads: int
    head_dim: int
    ssm_state_size: int
    n_groups: int
    chunk_size: int
    cp: _MambaSSDContextParallel | None


def _collect_mamba_ssd_autotune_shapes(model_parts: list[torch.nn.Module]) -> dict[MambaShape, str]:
    """Discover the Mamba SSD kernel shapes present in ``model_parts``.

    Under context parallelism the kernels see the per-rank heads and groups (``cp.num_heads_local``,
    ``cp.n_groups_local``); a ``cp`` object of another shape is skipped with a WARNING. The dtype follows the
    same rule as :func:`_collect_gdn_autotune_shapes`.

    Returns:
        ``(num_heads, head_dim, ssm_state_size, n_groups, chunk_size, dtype) -> first module name``, ordered.
    """
    shapes: dict[MambaShape, str] = {}
    for part in model_parts:
        for name, module, dtype in _named_modules_with_dtype(part):
            if not isinstance(module, _MambaSSDMixer):
                continue
            heads, groups = int(module.num_heads), int(module.n_groups)
            cp = module.cp
            if cp is not None:
                if not isinstance(cp, _MambaSSDContextParallel):
                    _log().warning("Skipping Mamba SSD prewarm for %s: unrecognized context-parallel geometry.", name)
                    continue
                heads, groups = int(cp.num_heads_local), int(cp.n_groups_local)
            key = (heads, int(module.head_dim), int(module.ssm_state_size), groups, int(module.chunk_size), dtype)
            shapes.setdefault(key, name)
    return shapes


def _prewarm_mamba_ssd_end_to_end(shapes: dict[MambaShape, str], device: torch.device) -> bool:
    """fwd+bwd through ``mamba_chunk_scan_combined`` per shape, with and without ``seq_idx``.

    Two chunks (``L = 2 * chunk_size``, batch 1: neither is an autotune key) exercise inter-chunk state
    passing. Triton appends each tensor argument's dtype to the autotune key, so a ``seq_idx`` tensor
    (packed/THD training) and ``seq_idx=None`` (plain BSHD training) are different keys: both are warmed.
    The call is ``op(x, dt, A, B, C, chunk_size, D=, z=None, dt_bias=, seq_idx=, dt_softplus=True)`` with
    ``x: [1, L, H, P]``, ``dt: [1, L, H]``, ``B, C: [1, L, G, N]`` in the module dtype, ``A, D, dt_bias: [H]``
    fp32 and ``seq_idx: [1, L]`` int32. RNG-neutral; a CPU device is allowed (no CUDA call is made then).

    Returns:
        True if at least one (shape, seq_idx variant) ran.
    """
    ok, op = _pkg().safe_import_from("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    if not ok:
        _log().info("Skipping Mamba SSD end-to-end prewarm: mamba_ssm SSD operators are not importable.")
        _note_skip("mamba_ssm SSD operators are not importable")
        return False
    dev = torch.device(device)
    ran = False
    with _rng_neutral(dev), torch.enable_grad():
        for (H, P, N, G, chunk, dtype), name in shapes.items():
            L = 2 * chunk
            for with_seq_idx in (True, False):
                variant = "seq_idx" if with_seq_idx else "no seq_idx"
                _log().info(
                    "Prewarming Mamba SSD (%s) | module=%s H=%d P=%d N=%d G=%d chunk=%d dtype=%s",
                    variant, name, H, P, N, G, chunk, dtype,
                )  # fmt: skip
                try:
                    x = torch.randn(1, L, H, P, device=dev, dtype=dtype, requires_grad=True)
                    dt = torch.zeros(1, L, H, device=dev, dtype=dtype, requires_grad=True)
                    A = torch.full((H,), -1.0, device=dev, dtype=torch.float32, requires_grad=True)
                    B = torch.randn(1, L, G, N, device=dev, dtype=dtype, requires_grad=True)
                    C = torch.randn(1, L, G, N, device=dev, dtype=dtype, requires_grad=True)
                    D = torch.ones(H, device=dev, dtype=torch.float32, requires_grad=True)
                    dt_bias = torch.zeros(H, device=dev, dtype=torch.float32, requires_grad=True)
                    seq_idx = torch.zeros(1, L, device=dev, dtype=torch.int32) if with_seq_idx else None
                    out = op(x, dt, A, B, C, chunk, D=D, z=None, dt_bias=dt_bias, seq_idx=seq_idx, dt_softplus=True)
                    out.float().sum().backward()
                    _synchronize(dev)
                    ran = True
                except Exception:
                    _log_failure("Mamba SSD end-to-end prewarm (%s) failed for %s; continuing.", variant, name)
                finally:
                    x = dt = A = B = C = D = dt_bias = seq_idx = out = None
                    _release(dev)
    _log().info("Finished Mamba SSD autotune prewarm.")
    return ran


def _prewarm_mamba_ssd_autotune(model_parts: list[torch.nn.Module], device: torch.device | int | str | None) -> bool:
    """Pre-populate the Mamba SSD Triton autotune caches (the motivating step-1 OOM was the backward kernel
    ``_chunk_scan_bwd_ddAcs_stable``, keyed on ``chunk_size, hdim``) before large activations exist.

    Returns:
        The end-to-end result; False when there is no CUDA device, no mixer or no ``mamba_ssm``.
    """
    pkg = _pkg()
    dev, shapes = _device_and_shapes(
        device,
        "Mamba SSD autotune",
        "_collect_mamba_ssd_autotune_shapes",
        model_parts,
        "no Mamba SSD mixer modules found",
        "Mamba SSD autotune prewarm enabled but no Mamba SSD mixer modules were found.",
    )
    if dev is None:
        return False
    listing = sorted((*key[:5], str(key[5]), name) for key, name in shapes.items())
    _log().info("Prewarming Mamba SSD autotune caches for %d unique shape(s): %s", len(shapes), listing)
    _note_shapes(
        [f"H={h} P={p} N={n} G={g} chunk={c} {dt} ({nm or '<root>'})" for (h, p, n, g, c, dt), nm in shapes.items()]
    )
    return pkg._prewarm_mamba_ssd_end_to_end(shapes, dev)
