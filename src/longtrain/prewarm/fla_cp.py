"""fla context-parallel GDN backward kernels: launch contracts, signature validation and the direct warmup.

The CP backward kernels are private fla API and change between releases, so each supported layout carries a
hand-written launch contract (the keyword names the launch passes) that is checked against the installed
kernel before any launch:

- fla 0.4.2: ``fla.ops.cp.chunk_delta_h.pre_process_bwd_kernel_merged`` (contract
  ``_FLA_PRE_PROCESS_BWD_KERNEL_ARGS``) and ``fla.ops.cp.chunk_delta_h.merge_fwd_bwd_kernel``
  (``_FLA_MERGE_FWD_BWD_KERNEL_ARGS``);
- fla 0.6.0: ``fla.ops.cp.chunk_bwd.chunk_cp_bwd_kernel_dh`` (``_FLA_CP_BWD_DH_KERNEL_ARGS``) and
  ``fla.ops.cp.chunk_merge.chunk_cp_fwd_bwd_kernel_merge`` (``_FLA_CP_MERGE_KERNEL_ARGS``).

A layout is used when its first kernel imports; a kernel whose parameter list drifted from the contract (a
contract name missing, or a required parameter the contract does not supply) is skipped with a WARNING that
names it, and nothing is launched for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from longtrain.prewarm._common import _cdiv, _log, _log_failure, _next_power_of_2, _pkg, _release, _skip, _synchronize

# fla 0.4.2: the launch keywords of its CP backward (byte-for-byte the names its own launch passes).
_FLA_PRE_PROCESS_BWD_KERNEL_ARGS = frozenset(
    ("q", "k", "w", "g", "gk", "do", "dhm", "dv", "cu_seqlens", "scale")
    + ("T", "H", "K", "V", "BT", "BK1", "USE_EXP2", "BLOCK_SIZE")
)
_FLA_MERGE_FWD_BWD_KERNEL_ARGS = frozenset(
    ("h", "ag_hm", "pre_or_post_num_ranks", "rank", "seq_offsets", "init_offsets", "h0_seq_ids", "h0")
    + ("H", "K", "V", "BK", "FORWARD", "INTRACARD_MODE", "NUM_SEQ_ENTRIES")
)
# fla 0.6.0: ``chunk_cp_bwd_dh`` and ``chunk_cp_merge`` (USE_G/USE_GK/IS_VARLEN and USE_INITIAL_STATE /
# USE_H_SEQ_IDX come from the kernels' heuristics, BV of the merge from its autotune configs).
_FLA_CP_BWD_DH_KERNEL_ARGS = frozenset(
    ("q", "k", "w", "g", "gk", "do", "dhm", "dv", "cu_seqlens", "scale")
    + ("T", "H", "HV", "K", "V", "BT", "BV", "BK", "USE_BG")
)
_FLA_CP_MERGE_KERNEL_ARGS = frozenset(
    ("h", "ag_hm", "num_ranks", "rank", "seq_offsets", "init_offsets", "h0_seq_ids", "h0", "h_seq_idx")
    + ("HV", "K", "V", "BK", "FORWARD", "IS_INTRACARD", "N", "STATE_V_FIRST", "NUM_RANKS_ON_DEVICE")
)

_MAX_WRAPPER_DEPTH = 8
_FLA_CHUNK_SIZE = 64  # fla's default GDN chunk size (the BT key of every chunked kernel)


def _kernel_chain(kernel: object) -> list[object]:
    """``kernel`` and the objects behind it through ``.fn`` (Heuristics -> Autotuner -> JITFunction -> the
    Python function), at most 8, stopping at the Python function."""
    chain: list[object] = []
    obj = kernel
    for _ in range(_MAX_WRAPPER_DEPTH):
        if obj is None:
            break
        chain.append(obj)
        if inspect.isfunction(obj):
            break
        obj = getattr(obj, "fn", None)
    return chain


def _triton_kernel_accepts(kernel: object, expected_args: frozenset[str], kernel_name: str) -> bool:
    """Check that a (possibly wrapped) Triton kernel accepts the expected launch arguments.

    Unwraps autotuner/heuristics layers via their ``fn`` attribute (at most 8 hops) until an object exposing
    the JITFunction's ``arg_names`` is found.

    Args:
        kernel: the Triton kernel object (a JITFunction, or an Autotuner / Heuristics wrapper around one).
        expected_args: keyword-argument names the prewarm launch will pass.
        kernel_name: kernel name used in log messages.

    Returns:
        True when every expected argument is in the kernel's parameter list; otherwise False with a WARNING.
    """
    arg_names = next((a for a in (getattr(o, "arg_names", None) for o in _kernel_chain(kernel)) if a is not None), None)
    if arg_names is None:
        _log().warning("Cannot determine the parameter list of fla kernel %s; skipping its prewarm.", kernel_name)
        return False
    missing = sorted(set(expected_args) - set(arg_names))
    if missing:
        _log().warning(
            "fla kernel %s does not accept %s: the installed fla version has drifted from the prewarm launch "
            "contract; skipping its prewarm.",
            kernel_name,
            missing,
        )
        return False
    return True


def _triton_kernel_unsupplied_params(kernel: object, passed_args: frozenset[str]) -> list[str]:
    """Required kernel parameters (no default) that neither the launch nor the kernel's wrappers supply.

    Catches the other direction of drift (fla added a required parameter), which would otherwise fail at
    launch. Returns [] when the signature cannot be read (then only the name check applies).
    """
    chain = _kernel_chain(kernel)
    if not chain or not inspect.isfunction(chain[-1]):
        return []
    provided: set[str] = set()
    for obj in chain:  # names filled in by heuristics values and autotune config keywords
        values = getattr(obj, "values", None)
        if isinstance(values, dict):
            provided.update(str(k) for k in values)
        configs = getattr(obj, "configs", None)
        if isinstance(configs, (list, tuple)):
            for config in configs:
                kwargs = getattr(config, "kwargs", None)
                if isinstance(kwargs, dict):
                    provided.update(str(k) for k in kwargs)
    try:
        params = inspect.signature(chain[-1]).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    supplied = set(passed_args) | provided
    return sorted(p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in supplied)


def _kernel_launchable(kernel: object, contract: frozenset[str], kernel_name: str) -> bool:
    if not _pkg()._triton_kernel_accepts(kernel, contract, kernel_name):
        return False
    unsupplied = _triton_kernel_unsupplied_params(kernel, contract)
    if unsupplied:
        _log().warning(
            "fla kernel %s requires %s, which the prewarm launch contract does not supply: the installed fla "
            "version has drifted; skipping its prewarm.",
            kernel_name,
            unsupplied,
        )
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# Launches (zero-filled inputs: autotuning only times the kernel, values are irrelevant).


def _launch_pre_process_v042(kernel: Any, H: int, K: int, V: int, dtype: torch.dtype, dev: torch.device, T: int):
    block = 32 if K <= 64 else 64
    q = torch.zeros(1, T, H, K, device=dev, dtype=dtype)
    k, w = torch.zeros_like(q), torch.zeros_like(q)
    g = torch.zeros(1, T, H, device=dev, dtype=torch.float32)
    do = torch.zeros(1, T, H, V, device=dev, dtype=dtype)
    dv = torch.zeros_like(do)
    dhm = torch.zeros(H, K, V + K, device=dev, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, T], device=dev, dtype=torch.int64)
    grid = (_cdiv(V, block) + _cdiv(K, block), H)
    kernel[grid](
        q=q, k=k, w=w, g=g, gk=None, do=do, dhm=dhm, dv=dv, cu_seqlens=cu_seqlens, scale=1.0,
        T=T, H=H, K=K, V=V, BT=_FLA_CHUNK_SIZE, BK1=_next_power_of_2(K), USE_EXP2=False, BLOCK_SIZE=block,
    )  # fmt: skip


def _launch_merge_v042(kernel: Any, H: int, K: int, V: int, dev: torch.device) -> None:
    h = torch.zeros(H, K, V, device=dev, dtype=torch.float32)
    ag_hm = torch.zeros(2 * H, K, V + K, device=dev, dtype=torch.float32)  # two rank slices of [H, K, V+K]

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (_cdiv(V, meta["BV"]), H)

    # backward reads slice rank+1, forward slice rank-1: both stay inside the two slices
    for forward, rank in ((False, 0), (True, 1)):
        kernel[grid](
            h=h, ag_hm=ag_hm, pre_or_post_num_ranks=1, rank=rank,
            seq_offsets=None, init_offsets=None, h0_seq_ids=None, h0=None,
            H=H, K=K, V=V, BK=_next_power_of_2(K), FORWARD=forward, INTRACARD_MODE=False, NUM_SEQ_ENTRIES=0,
        )  # fmt: skip


def _launch_bwd_dh_v060(kernel: Any, H: int, K: int, V: int, dtype: torch.dtype, dev: torch.device, T: int):
    # Mirrors fla 0.6.0's chunk_cp_bwd_dh for GDN (HV == H, no bg): g is the fp32 chunk cumsum, the CP
    # context's local cu_seqlens is int32 and holds one sequence.
    bv = 32 if K <= 64 else 64
    q = torch.zeros(1, T, H, K, device=dev, dtype=dtype)
    k, w = torch.zeros_like(q), torch.zeros_like(q)
    g = torch.zeros(1, T, H, device=dev, dtype=torch.float32)
    do = torch.zeros(1, T, H, V, device=dev, dtype=dtype)
    dv = torch.zeros_like(do)
    dhm = torch.zeros(H, K, V + K, device=dev, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, T], device=dev, dtype=torch.int32)
    grid = (_cdiv(V, bv) + _cdiv(K, bv), H)
    kernel[grid](
        q=q, k=k, w=w, g=g, gk=None, do=do, dhm=dhm, dv=dv, cu_seqlens=cu_seqlens, scale=K**-0.5,
        T=T, H=H, HV=H, K=K, V=V, BT=_FLA_CHUNK_SIZE, BV=bv, BK=_next_power_of_2(K), USE_BG=False,
    )  # fmt: skip


def _launch_merge_v060(kernel: Any, H: int, K: int, V: int, dev: torch.device) -> None:
    h = torch.zeros(H, K, V, device=dev, dtype=torch.float32)
    ag_hm = torch.zeros(2, H, K, V + K, device=dev, dtype=torch.float32)  # two gathered rank summaries

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (_cdiv(V, meta["BV"]), H)

    # FORWARD is not an autotune key: both variants share one cached config, the second launch compiles it.
    for forward, rank in ((False, 0), (True, 1)):
        kernel[grid](
            h=h, ag_hm=ag_hm, num_ranks=1, rank=rank,
            seq_offsets=None, init_offsets=None, h0_seq_ids=None, h0=None, h_seq_idx=None,
            HV=H, K=K, V=V, BK=_next_power_of_2(K), FORWARD=forward, IS_INTRACARD=False, N=0,
            STATE_V_FIRST=False, NUM_RANKS_ON_DEVICE=False,
        )  # fmt: skip


@dataclass(frozen=True)
class _CPLayout:
    fla_version: str
    bwd_module: str
    bwd_name: str
    bwd_args: frozenset[str]
    launch_bwd: Callable[..., None]
    merge_module: str
    merge_name: str
    merge_args: frozenset[str]
    launch_merge: Callable[..., None]


_CP_LAYOUTS = (
    _CPLayout(
        "0.4.2",
        "fla.ops.cp.chunk_delta_h",
        "pre_process_bwd_kernel_merged",
        _FLA_PRE_PROCESS_BWD_KERNEL_ARGS,
        _launch_pre_process_v042,
        "fla.ops.cp.chunk_delta_h",
        "merge_fwd_bwd_kernel",
        _FLA_MERGE_FWD_BWD_KERNEL_ARGS,
        _launch_merge_v042,
    ),
    _CPLayout(
        "0.6.0",
        "fla.ops.cp.chunk_bwd",
        "chunk_cp_bwd_kernel_dh",
        _FLA_CP_BWD_DH_KERNEL_ARGS,
        _launch_bwd_dh_v060,
        "fla.ops.cp.chunk_merge",
        "chunk_cp_fwd_bwd_kernel_merge",
        _FLA_CP_MERGE_KERNEL_ARGS,
        _launch_merge_v060,
    ),
)


def _find_cp_layout() -> tuple[_CPLayout, Any] | None:
    pkg = _pkg()
    for layout in _CP_LAYOUTS:
        ok, kernel = pkg.safe_import_from(layout.bwd_module, layout.bwd_name)
        if ok:
            return layout, kernel
    return None


def _prewarm_fla_gdn_cp_kernels(
    shapes: dict[tuple[int, int, int, torch.dtype], str], device: torch.device, seq_len: int
) -> None:
    """Warm the fla context-parallel GDN backward kernels (best-effort).

    These kernels only fire on the context-parallel code path, which the end-to-end warmup does not reach
    (non-first CP ranks run the dh-summary kernel, non-last ranks the state merge; the first rank would reach
    the merge cold, at backward peak), so they are launched once directly with zero-filled tiny tensors under
    ``no_grad``. fla builds without CP kernels are skipped (INFO), as are kernels whose parameter list no
    longer matches the launch contract (WARNING naming the kernel; nothing launched). One failing launch is
    logged at ERROR and the next shape or kernel still runs. The CP forward kernels are not warmed: they run
    in the forward pass, at lower memory; in fla 0.6 the forward merge shares the backward merge's autotune key.

    Args:
        shapes: ``(num_v_heads, head_k_dim, head_v_dim, dtype) -> module name``, as returned by
            :func:`_collect_gdn_autotune_shapes`.
        device: target CUDA device.
        seq_len: warmup sequence length (not part of the autotune key).
    """
    pkg = _pkg()
    ok_triton, _ = pkg.safe_import("triton")
    found = _find_cp_layout() if ok_triton else None
    if found is None:
        _skip("Skipping fla CP GDN kernel prewarm: fla CP kernels not importable.")
        return
    layout, bwd_kernel = found
    ok_merge, merge_kernel = pkg.safe_import_from(layout.merge_module, layout.merge_name)
    if not ok_merge:
        _log().info("fla %s not present in this fla version; skipping its prewarm.", layout.merge_name)
    warm_bwd = _kernel_launchable(bwd_kernel, layout.bwd_args, layout.bwd_name)
    warm_merge = ok_merge and _kernel_launchable(merge_kernel, layout.merge_args, layout.merge_name)
    if not (warm_bwd or warm_merge):
        _log().info("No fla CP GDN backward kernel can be warmed with the fla %s launch contract.", layout.fla_version)
        return

    dev = torch.device(device)
    with torch.no_grad():
        for (H, K, V, dtype), name in shapes.items():
            if K > 256:
                _log().info("Skipping fla CP GDN kernels for %s: head_k_dim=%d > 256 has no CP kernel.", name, K)
                continue
            if warm_bwd:
                _log().info(
                    "Prewarming fla CP GDN bwd kernel | module=%s H=%d K=%d V=%d dtype=%s", name, H, K, V, dtype
                )
                try:
                    layout.launch_bwd(bwd_kernel, H, K, V, dtype, dev, seq_len)
                    _synchronize(dev)
                except Exception:
                    _log_failure("fla CP GDN pre-process prewarm failed for %s; continuing.", name)
                finally:
                    _release(dev)
            if warm_merge:
                try:
                    layout.launch_merge(merge_kernel, H, K, V, dev)
                    _synchronize(dev)
                except Exception:
                    _log_failure("fla CP GDN merge prewarm failed for %s; continuing.", name)
                finally:
                    _release(dev)
