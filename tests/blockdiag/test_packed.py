"""The cp = 1 packed path: hooks scope the packed SDPA to ``self_attn`` forwards (including activation-checkpoint
recompute and forwards that raise) without reassigning ``F.scaled_dot_product_attention``; it equals the dense
block-causal reference; eager attention under armed ids is a clear error."""

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
)
from longtrain.blockdiag_cp.mask import ORIGINAL_SDPA
from tests.blockdiag import _cp_model as cm


class SelfAttn(torch.nn.Module):
    """Calls ``F.scaled_dot_product_attention`` through the module attribute, as model code does."""

    def __init__(self, raise_in_forward: bool = False):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(p.float()) for p in cm.make_params()])
        self.patched_seen: list[bool] = []
        self.raise_in_forward = raise_in_forward

    def forward(self, x):
        self.patched_seen.append(packed.active())
        if self.raise_in_forward:
            raise RuntimeError("boom inside attention")
        return cm.attention_layer(x, list(self.params), self.sdpa)

    @staticmethod
    def sdpa(*args, **kwargs):
        return F.scaled_dot_product_attention(*args, **kwargs)


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
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA and not packed.active()


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
    with pytest.warns(UserWarning, match="nothing was hooked"):  # arming would change nothing: said, not silent
        assert attach_cp1_packed_varlen_hooks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0
    x64, g = cm.make_inputs(ids.numel())
    x = x64.float().requires_grad_()
    enable_cp1_packed_varlen(ids, backend)
    assert not packed.active()  # arming alone changes nothing
    y = model(x)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA and not packed.active()
    (y * g.float() * real).sum().backward()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA and not packed.active()
    # forward, plus the recompute when checkpointed: the packed path was active every time
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
    assert not packed.active()


def test_non_matching_calls_and_disarmed_state_are_stock_sdpa():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    want = ORIGINAL_SDPA(q, k, v, is_causal=True)
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
    assert st.doc_ids is ids2 and st.backend == "reference" and [s.varlen_meta.n_real for s in st.steps] == [3, 4]
    enable_cp1_packed_varlen(torch.tensor([1, 1, 2, 0]), None)
    st = packed._PACKED_STATE.get()
    assert st.doc_ids.shape == (1, 4) and st.backend == "auto" and st.varlen_meta.n_real == 3
    # every row is validated like a single row, before anything changes
    for bad, match in ((torch.tensor([[1, 1, 2, 0], [1, 0, 2, 2]]), "row 1: .*tail"),
                       (torch.tensor([[1, 2, 1, 0], [1, 1, 1, 1]]), "row 0: .*runs")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            enable_cp1_packed_varlen(bad, "dense")
        assert packed._PACKED_STATE.get() is st


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


class EagerSelfAttn(torch.nn.Module):
    """Attention written out by hand (what ``attn_implementation="eager"`` does): no SDPA call."""

    def forward(self, x):
        scores = x @ x.transpose(-1, -2)
        return scores.softmax(-1) @ x


def test_eager_attention_under_armed_ids_is_a_clear_error():
    model = torch.nn.ModuleDict({"self_attn": EagerSelfAttn()})
    attach_cp1_packed_varlen_hooks(model)
    x = torch.randn(1, 6, 4)
    model["self_attn"](x)  # nothing armed: fine
    enable_cp1_packed_varlen(torch.tensor([1, 1, 1, 2, 2, 2]), "reference")
    with pytest.raises(RuntimeError, match="attn_implementation='sdpa'"):
        model["self_attn"](x)
    assert not packed.active()


def test_sdpa_imported_under_another_name_is_covered():
    from torch.nn.functional import scaled_dot_product_attention as renamed

    ids = torch.tensor([1, 1, 1, 2, 2, 2])

    class Renamed(torch.nn.Module):
        def forward(self, q, k, v):
            return renamed(q, k, v, is_causal=True)

    model = torch.nn.ModuleDict({"self_attn": Renamed()})
    attach_cp1_packed_varlen_hooks(model)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    enable_cp1_packed_varlen(ids, "reference")
    out = model["self_attn"](q, k, v)
    ref = cm.reference_sdpa(ids)(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)  # float64, summation order only
