"""The cp = 1 packed path: hooks scope the SDPA patch to ``self_attn`` forwards (including activation-checkpoint
recompute and forwards that raise); the patched SDPA equals the dense block-causal reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from longtrain.blockdiag_cp import (
    attach_cp1_packed_varlen_hooks,
    configure_cp_varlen,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    packed,
    runtime,
)
from tests.blockdiag import _cp_model as cm


class SelfAttn(torch.nn.Module):
    """Calls ``F.scaled_dot_product_attention`` through the module attribute, as model code does."""

    def __init__(self, raise_in_forward: bool = False):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(p.float()) for p in cm.make_params()])
        self.patched_seen: list[bool] = []
        self.raise_in_forward = raise_in_forward

    def forward(self, x):
        self.patched_seen.append(F.scaled_dot_product_attention is packed._packed_varlen_sdpa)
        if self.raise_in_forward:
            raise RuntimeError("boom inside attention")
        return cm.attention_layer(x, list(self.params), F.scaled_dot_product_attention)


class Block(torch.nn.Module):
    def __init__(self, ckpt: str | None = None, **kw):
        super().__init__()
        self.self_attn = SelfAttn(**kw)
        if ckpt == "wrapper":
            self.self_attn = checkpoint_wrapper(self.self_attn)
        self.ckpt = ckpt

    def forward(self, x):
        if self.ckpt == "function":
            return x + checkpoint(self.self_attn, x, use_reentrant=False)
        return x + self.self_attn(x)


class Model(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(**kw)])

    def forward(self, x):
        return self.layers[0](x)


def _inner(model: Model) -> SelfAttn:
    attn = model.layers[0].self_attn
    return getattr(attn, "_checkpoint_wrapped_module", attn)


@pytest.fixture(autouse=True)
def _clean():
    previous = configure_cp_varlen()
    yield
    disable_cp1_packed_varlen()
    configure_cp_varlen(**previous)
    assert F.scaled_dot_product_attention is runtime._ORIGINAL_SDPA


def _reference(ids, x64):
    params = [p.requires_grad_() for p in cm.make_params()]
    x = x64.clone().requires_grad_()
    y = x + cm.attention_layer(x, params, cm.reference_sdpa(ids))
    return y, x, params


@pytest.mark.parametrize("ckpt", [None, "function", "wrapper"])
@pytest.mark.parametrize("backend", ["auto", "ref", "sdpa"])
def test_hooked_forward_matches_reference_and_patch_is_scoped(ckpt, backend):
    ids = cm.case_ids("many_short")
    real = (ids > 0).view(1, -1, 1)
    model = Model(ckpt=ckpt)
    assert attach_cp1_packed_varlen_hooks(model) == 1
    assert attach_cp1_packed_varlen_hooks(model) == 0  # no duplicate hooks
    x64, g = cm.make_inputs(ids.numel())
    x = x64.float().requires_grad_()
    enable_cp1_packed_varlen(ids, backend)
    assert F.scaled_dot_product_attention is runtime._ORIGINAL_SDPA  # arming alone patches nothing
    y = model(x)
    assert F.scaled_dot_product_attention is runtime._ORIGINAL_SDPA
    (y * g.float() * real).sum().backward()
    assert F.scaled_dot_product_attention is runtime._ORIGINAL_SDPA
    # forward, plus the recompute when checkpointed: the patch was active every time
    assert _inner(model).patched_seen == ([True, True] if ckpt else [True])

    y_ref, x_ref, params_ref = _reference(ids, x64)
    (y_ref * g * real).sum().backward()
    # fp32 against float64, max-norm relative: a handful of roundings over <= 4-token documents
    assert cm.rel_err(y[real.expand_as(y)], y_ref[real.expand_as(y_ref)]) <= 1e-5
    assert cm.rel_err(x.grad, x_ref.grad) <= 1e-5
    for p, p_ref in zip(_inner(model).params, params_ref):
        assert cm.rel_err(p.grad, p_ref.grad) <= 1e-5


def test_patch_restored_when_forward_raises():
    model = Model(raise_in_forward=True)
    attach_cp1_packed_varlen_hooks(model)
    enable_cp1_packed_varlen(torch.ones(1, 8, dtype=torch.int64), "reference")
    with pytest.raises(RuntimeError, match="boom inside attention"):
        model(torch.randn(1, 8, cm.E))
    assert _inner(model).patched_seen == [True]
    assert F.scaled_dot_product_attention is runtime._ORIGINAL_SDPA


def test_non_matching_calls_and_disarmed_state_are_stock_sdpa():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    want = runtime._ORIGINAL_SDPA(q, k, v, is_causal=True)
    assert torch.equal(packed._packed_varlen_sdpa(q, k, v, is_causal=True, extra=1), want)  # nothing armed
    enable_cp1_packed_varlen(torch.tensor([1, 1, 2, 2, 2, 0, 0]), "reference")  # length 7 != 6
    assert torch.equal(packed._packed_varlen_sdpa(q, k, v, is_causal=True), want)
    disable_cp1_packed_varlen()
    assert packed._PACKED_STATE.get() is None


def test_enable_validates_and_keeps_ids():
    with pytest.raises(ValueError, match="attention backend"):
        enable_cp1_packed_varlen(torch.ones(4, dtype=torch.int64), "flash3")
    assert packed._PACKED_STATE.get() is None
    with pytest.raises(TypeError, match="integer"):
        enable_cp1_packed_varlen(torch.ones(4), "reference")
    ids2 = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    enable_cp1_packed_varlen(ids2, "Torch-Reference")
    st = packed._PACKED_STATE.get()
    assert st["doc_ids"] is ids2 and st["backend"] == "reference" and st["varlen_meta"] is None
    enable_cp1_packed_varlen(torch.tensor([1, 1, 2, 0]), None)
    st = packed._PACKED_STATE.get()
    assert st["doc_ids"].shape == (1, 4) and st["backend"] == "auto" and st["varlen_meta"]["n_real"] == 3


def test_multi_row_ids_segment_per_row():
    ids = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    enable_cp1_packed_varlen(ids, "reference")
    out = packed._packed_varlen_sdpa(q, k, v)
    for b in range(2):
        ref = cm.reference_sdpa(ids[b])(q[b : b + 1].double(), k[b : b + 1].double(), v[b : b + 1].double())
        real = ids[b] > 0
        assert cm.rel_err(out[b : b + 1, :, real], ref[:, :, real]) <= 1e-5


def test_cp1_backend_reports_configured_varlen_backend():
    configure_cp_varlen(attn_backend="reference")
    assert cp1_packed_varlen_backend() == "reference"
    configure_cp_varlen(attn_backend="auto")
    assert cp1_packed_varlen_backend() == "auto"
    configure_cp_varlen(attn_backend="sdpa")
    assert cp1_packed_varlen_backend() is None
