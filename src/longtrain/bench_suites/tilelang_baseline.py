"""TileLang's DeepSeek-V3.2 sparse MLA kernels as a baseline row of ``benchmarks/dsa.py`` (CUDA, where carried).

The kernels are tile-ai/tilelang's ``examples/deepseek_v32`` files (``sparse_mla_fwd_pipelined.py``,
``sparse_mla_fwd.py``, ``sparse_mla_bwd.py`` and what they import), which no wheel ships: name their folder in
``LONGTRAIN_TILELANG_EXAMPLES``, with the ``tilelang`` package importable (``../shared/reference/anchors.md``,
Appendix D, has the wheels; ``bash benchmarks/device.sh stash-tl`` carries them). They run on the benchmark's own
inputs, converted to TileLang's layout (:func:`tilelang_inputs`): one batch, one latent KV group, invalid slots set to
``T`` (past every query's causal window, which the kernels mask). Each row reports the largest relative difference of
its output from ours; a kernel that cannot import, compile or run is a row with its reason, never a missing row.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["EXAMPLES_ENV", "tilelang_inputs", "tilelang_rows", "tilelang_unavailable"]

EXAMPLES_ENV = "LONGTRAIN_TILELANG_EXAMPLES"
_FILES = ("sparse_mla_fwd_pipelined.py", "sparse_mla_fwd.py", "sparse_mla_bwd.py")


def tilelang_unavailable() -> str | None:
    """Why TileLang's example kernels cannot run here, or ``None`` when they can be tried."""
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang not installed (wheels: ../shared/reference/anchors.md, Appendix D)"
    folder = os.environ.get(EXAMPLES_ENV)
    if not folder:
        return f"{EXAMPLES_ENV} is not set (the folder of tile-ai/tilelang examples/deepseek_v32)"
    missing = [name for name in _FILES if not (Path(folder) / name).is_file()]
    if missing:
        return f"{EXAMPLES_ENV}={folder} lacks {', '.join(missing)}"
    if not torch.cuda.is_available():
        return "needs CUDA"
    return None


def tilelang_inputs(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ours -> TileLang's layout: ``q: [T, H, D] -> [1, T, H, D]``, ``kv: [T, 1, D] -> [1, T, 1, D]``,
    ``idx: [T, K]`` int32 (``-1`` = no key) -> ``[1, T, 1, K]`` int32 with ``T`` for every invalid slot."""
    total = q.shape[0]
    ind = torch.where(idx >= 0, idx, total).to(torch.int32)
    return (q.reshape(1, *q.shape).contiguous(), kv.reshape(1, total, 1, -1).contiguous(),
            ind.reshape(1, total, 1, -1).contiguous())  # fmt: skip


def _relative_difference(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    ours = ours.float().reshape(theirs.shape)
    return float((theirs.float() - ours).abs().max() / ours.abs().max().clamp_min(1e-30))


def tilelang_rows(
    add: Callable[..., None],
    bench: Callable,
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    ours_out: torch.Tensor,
    dout: torch.Tensor,
    shape: str,
    fwd_flops: float,
    bwd_flops: float,
) -> None:
    """TileLang's pipelined and simple forwards and its backward on our inputs, one row each (``add(**row)``)."""
    reason = tilelang_unavailable()
    if reason is not None:
        for op in ("sparse_mla_fwd", "sparse_mla_bwd"):
            add(op=op, impl="TileLang examples/deepseek_v32", shape=shape, note=f"unavailable: {reason}")
        return
    folder = os.environ[EXAMPLES_ENV]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    q4, kv4, ind = tilelang_inputs(q, kv, idx)
    start = torch.zeros(1, dtype=torch.int32, device=q.device)

    def row(op: str, impl: str, make: Callable[[], Callable], flops: float, check=None) -> None:
        try:
            fn = make()
            note = None if check is None else f"max relative difference from ours {check(fn()):.2e}"
            ms = bench(fn)
            add(op=op, impl=impl, shape=shape, ms=ms[0], p20=ms[1], p80=ms[2], tflops=flops / ms[0] / 1e9, note=note)
        except Exception as exc:  # a baseline that does not build or run is a row with its reason
            add(op=op, impl=impl, shape=shape, note=f"failed: {type(exc).__name__}: {exc!s:.150}")

    def pipelined():
        mod = importlib.import_module("sparse_mla_fwd_pipelined")
        kernel = mod.sparse_mla_fwd_interface(q4, kv4, ind, 0, 1, return_kernel=True)
        return lambda: kernel(q4, kv4, ind, start)

    def simple():
        mod = importlib.import_module("sparse_mla_fwd")
        return lambda: mod.sparse_mla_fwd_interface(q4, kv4, ind)

    fwd_check = lambda res: _relative_difference(res[0], ours_out)  # noqa: E731
    row("sparse_mla_fwd", "TileLang sparse_mla_fwd_pipelined.py", pipelined, fwd_flops, fwd_check)
    row("sparse_mla_fwd", "TileLang sparse_mla_fwd.py", simple, fwd_flops, fwd_check)

    def backward():  # its kernels built once and timed alone, as the example's own benchmark does
        mod = importlib.import_module("sparse_mla_bwd")
        out, lse = importlib.import_module("sparse_mla_fwd").sparse_mla_fwd_interface(q4, kv4, ind)
        batch, seq, heads, dim_qk = q4.shape
        d_v = out.shape[-1]
        pre = mod.preprocess(batch, seq, heads, d_v)
        bwd = mod.bwd(batch, seq, kv4.shape[1], heads, d_v, dim_qk - d_v, ind.shape[-1], 1, None, True)
        do4 = dout.reshape(out.shape).contiguous()
        delta = pre(out, do4)
        dkv = torch.zeros_like(kv4, dtype=torch.float32)
        return lambda: bwd(q4, kv4, do4, ind, lse, delta, dkv)

    row("sparse_mla_bwd", "TileLang sparse_mla_bwd.py (kernel alone, its own fwd's out and lse)", backward, bwd_flops)
