"""Fakes for the prewarm tests: Triton-like kernel wrappers, stub fla / mamba_ssm / triton modules, toy modules.

The kernel fakes mirror Triton's object layout: ``Autotuner(.fn=Heuristics(.fn=JITFunction(.fn=python def,
.arg_names)))``, ``.values`` on the heuristics wrapper, ``.configs[i].kwargs`` on the autotuner, and
``kernel[grid](**kwargs)`` launches (recorded instead of run).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn


class FakeJIT:
    """A JITFunction stand-in: ``arg_names`` from a Python signature; launches recorded in ``launches``."""

    def __init__(self, fn: Callable[..., Any], launches: list | None = None):
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)
        self.launches = launches if launches is not None else []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.launches.append((grid, kwargs))

        return launch


class FakeHeuristics:
    def __init__(self, fn: Any, values: dict[str, Callable[..., Any]]):
        self.fn = fn
        self.values = values

    def __getitem__(self, grid):
        return self.fn[grid]


class FakeAutotuner:
    def __init__(self, fn: Any, config_kwargs: list[dict[str, Any]]):
        self.fn = fn
        self.configs = [types.SimpleNamespace(kwargs=kw, num_warps=4) for kw in config_kwargs]

    def __getitem__(self, grid):
        return self.fn[grid]


def wrapped(fn: Callable[..., Any], heuristics: tuple[str, ...] = (), autotuned: tuple[str, ...] = ()):
    """``Autotuner -> Heuristics -> FakeJIT`` around ``fn`` (returns the outer object and the JIT)."""
    jit = FakeJIT(fn)
    inner: Any = FakeHeuristics(jit, {name: (lambda args: False) for name in heuristics}) if heuristics else jit
    outer = FakeAutotuner(inner, [dict.fromkeys(autotuned, 32), dict.fromkeys(autotuned, 64)])
    return outer, jit


# The real parameter lists (fla 0.4.2 per its CP backward launch; fla 0.6.0 as read from its source).
def pre_process_bwd_kernel_merged(
    q, k, w, g, gk, do, dhm, dv, cu_seqlens, scale, T, H, K, V, BT, BK1, USE_EXP2, BLOCK_SIZE,
    USE_G, USE_GK, IS_VARLEN,
): ...  # fmt: skip


def merge_fwd_bwd_kernel(
    h, ag_hm, pre_or_post_num_ranks, rank, seq_offsets, init_offsets, h0_seq_ids, h0,
    H, K, V, BV, BK, FORWARD, INTRACARD_MODE, NUM_SEQ_ENTRIES, HAS_H0, TRANSPOSE_STATE=False,
): ...  # fmt: skip


def chunk_cp_bwd_kernel_dh(
    q, k, w, g, gk, do, dhm, dv, cu_seqlens, scale, T, H, HV, K, V, BT, BV, BK,
    USE_G, USE_GK, USE_BG, IS_VARLEN,
): ...  # fmt: skip


def chunk_cp_fwd_bwd_kernel_merge(
    h, ag_hm, num_ranks, rank, seq_offsets, init_offsets, h0_seq_ids, h0, h_seq_idx,
    HV, K, V, BV, BK, FORWARD, IS_INTRACARD, N, USE_INITIAL_STATE, USE_H_SEQ_IDX,
    STATE_V_FIRST=False, NUM_RANKS_ON_DEVICE=False,
): ...  # fmt: skip


def fla_v042_kernels():
    pre, pre_jit = wrapped(pre_process_bwd_kernel_merged, heuristics=("USE_G", "USE_GK", "IS_VARLEN"))
    merge, merge_jit = wrapped(merge_fwd_bwd_kernel, heuristics=("HAS_H0",), autotuned=("BV",))
    return pre, pre_jit, merge, merge_jit


def fla_v060_kernels():
    dh, dh_jit = wrapped(chunk_cp_bwd_kernel_dh, heuristics=("USE_G", "USE_GK", "IS_VARLEN"))
    merge, merge_jit = wrapped(
        chunk_cp_fwd_bwd_kernel_merge, heuristics=("USE_INITIAL_STATE", "USE_H_SEQ_IDX"), autotuned=("BV",)
    )
    return dh, dh_jit, merge, merge_jit


def install_modules(monkeypatch: pytest.MonkeyPatch, modules: dict[str, dict[str, Any]]) -> None:
    """Install fake modules (and their parent packages) into ``sys.modules`` for the test's duration."""
    for name, attrs in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:  # real parents (longtrain, an installed fla) stay as they are
                pkg = types.ModuleType(parent)
                pkg.__path__ = []  # a package, so submodule imports resolve through sys.modules
                pkg._longtrain_fake = True
                monkeypatch.setitem(sys.modules, parent, pkg)
        mod = types.ModuleType(name)
        mod._longtrain_fake = True
        for key, value in attrs.items():
            setattr(mod, key, value)
        monkeypatch.setitem(sys.modules, name, mod)
        parent_mod = sys.modules[".".join(parts[:-1])] if len(parts) > 1 else None
        if parent_mod is not None:
            monkeypatch.setattr(parent_mod, parts[-1], mod, raising=False)


def install_fake_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    install_modules(monkeypatch, {"triton": {"__version__": "fake", "jit": lambda fn: fn}})


class GDNOpStub:
    """Stands in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: records calls, differentiable output.

    It draws random numbers itself (as a real kernel's dropout or init might), so RNG neutrality is checked
    against the op's own draws too. ``fail_on`` makes calls whose (batch, has cu_seqlens) match raise.
    """

    def __init__(self, fail_on: Callable[[dict[str, Any]], bool] | None = None):
        self.calls: list[dict[str, Any]] = []
        self.fail_on = fail_on

    def __call__(self, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):  # fmt: skip
        call = {
            "q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "g": tuple(g.shape),
            "beta": tuple(beta.shape), "dtypes": (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype),
            "cu_seqlens": None if cu_seqlens is None else (cu_seqlens.tolist(), cu_seqlens.dtype),
            "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "grad_enabled": torch.is_grad_enabled(),
            "requires_grad": all(t.requires_grad for t in (q, k, v, g, beta)), "kwargs": dict(kwargs),
        }  # fmt: skip
        self.calls.append(call)
        torch.rand(3)
        if self.fail_on is not None and self.fail_on(call):
            raise RuntimeError("stub GDN op failure")
        o = (q * k).sum(-1, keepdim=True) * v + (g + beta.float()).unsqueeze(-1).to(v.dtype)
        return o, None


class MambaOpStub:
    """``mamba_chunk_scan_combined`` with keyword-only options and no ``**kwargs`` (any extra keyword fails)."""

    def __init__(self, fail: bool = False):
        self.calls: list[dict[str, Any]] = []
        self.fail = fail

    def __call__(self, x, dt, A, B, C, chunk_size, *, D, z, dt_bias, seq_idx, dt_softplus):
        self.calls.append(
            {
                "x": tuple(x.shape),
                "dt": tuple(dt.shape),
                "A": tuple(A.shape),
                "B": tuple(B.shape),
                "C": tuple(C.shape),
                "chunk_size": chunk_size,
                "D": tuple(D.shape),
                "z": z,
                "dt_bias": tuple(dt_bias.shape),
                "dt_softplus": dt_softplus,
                "seq_idx": None if seq_idx is None else (tuple(seq_idx.shape), seq_idx.dtype),
                "dtypes": (x.dtype, dt.dtype, A.dtype, B.dtype, D.dtype, dt_bias.dtype),
                "grad_enabled": torch.is_grad_enabled(),
            }  # fmt: skip
        )
        torch.randn(2)
        if self.fail:
            raise RuntimeError("stub Mamba op failure")
        return x * D[:, None].to(x.dtype) + (dt * dt_bias.to(dt.dtype)).unsqueeze(-1) + B.sum() + C.sum()


class ToyGDN(nn.Module):
    """A GDN-shaped module (Qwen3-Next style: ints and the op as plain instance attributes)."""

    def __init__(self, heads: int = 4, k_dim: int = 16, v_dim: int = 32, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_v_heads = heads
        self.head_k_dim = k_dim
        self.head_v_dim = v_dim
        self.chunk_gated_delta_rule = object()
        self.in_proj = nn.Linear(8, 8, dtype=dtype)


class ToyCP:
    def __init__(self, heads: int, groups: int):
        self.num_heads_local = heads
        self.n_groups_local = groups


class ToyMamba(nn.Module):
    def __init__(self, heads=8, head_dim=16, state=32, groups=4, chunk=16, cp=None, dtype=torch.bfloat16):
        super().__init__()
        self.num_heads = heads
        self.head_dim = head_dim
        self.ssm_state_size = state
        self.n_groups = groups
        self.chunk_size = chunk
        self.cp = cp
        self.in_proj = nn.Linear(4, 4, dtype=dtype)


class ToyDSA(nn.Module):
    def __init__(self, heads: int = 4, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.heads = heads
        self.dtype_ = dtype
        self.w = nn.Linear(4, 4)

    def dsa_autotune_shape(self) -> dict[str, Any]:
        return {
            "num_heads": self.heads, "d_qk": 576, "d_v": 512, "topk": 2048,
            "index_heads": 32, "index_dim": 128, "dtype": self.dtype_,
        }  # fmt: skip


class ToyModel(nn.Module):
    """Two GDN layers of one shape, one of another, a Mamba mixer and a DSA layer, plus plain parameters."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(
            [ToyGDN(4, 16, 32), ToyGDN(4, 16, 32), ToyGDN(2, 8, 8, dtype=torch.bfloat16), ToyMamba(), ToyDSA()]
        )
        self.head = nn.Linear(8, 10)


def snapshot_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "opt": None if optimizer is None else repr(optimizer.state_dict()),
    }


def assert_state_equal(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, value in before["params"].items():
        assert torch.equal(value, after["params"][name]), name
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None and other is None) or torch.equal(grad, other), name
    assert before["opt"] == after["opt"]


def rng_state() -> torch.Tensor:
    return torch.get_rng_state().clone()
