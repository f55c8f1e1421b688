"""The varlen driver ``_cp_blockdiag_varlen``: parity with the dense path, padding, fallbacks, kernel contracts.

Tolerances: float64 varlen vs float64 dense differ only in summation order (atol/rtol 1e-10); fp32 varlen vs
the float64 dense oracle uses rtol/atol 2e-5 (fp32 softmax and matmuls over <= 64 keys, error ~1e-6).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp import kernels
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention
from tests.blockdiag._kernels_util import ids_from_lengths, patch_provider

TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-10}, torch.float32: {"rtol": 2e-5, "atol": 2e-5}}


def _inputs(hq, hkv, local, s, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, local, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, hkv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, hkv, s, d, generator=gen, dtype=torch.float64)
    g = torch.randn(1, hq, local, d, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, g)]


def _fwd_bwd(fn, q, k, v, g, real):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    assert out is not None
    grads = torch.autograd.grad((out * g * real).sum(), (q, k, v), allow_unused=True)
    return out.detach(), [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, (q, k, v))]


def _check_rank(ids, off, local, hq, hkv, d, dtype, flex=False):
    s = ids.numel()
    q, k, v, g = _inputs(hq, hkv, local, s, d, dtype, seed=off)
    real = (ids[off : off + local] > 0).view(1, 1, local, 1)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cpu")

    def dense(a, b, c):
        return kernels.dense_blockdiag_sdpa(a, b, c, ids, off)

    ref_out, ref_grads = _fwd_bwd(dense, *(t.double() for t in (q, k, v, g)), real)

    def varlen(a, b, c):
        return kernels._cp_blockdiag_varlen(a, b, c, ids, off, backend="reference", meta=meta)

    out, grads = _fwd_bwd(varlen, q, k, v, g, real)
    tol = TOL[dtype]
    torch.testing.assert_close((out * real).double(), ref_out * real, **tol)
    assert (out * ~real).abs().max().item() == 0.0 if (~real).any() else True
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, **tol)
    if flex:
        with torch.no_grad():
            fl = kernels._cp_blockdiag_varlen(q, k, v, ids, off, backend="flex", meta=meta)
        assert fl is not None
        torch.testing.assert_close((fl * real).double(), ref_out * real, **tol)
        if (~real).any():
            assert (fl * ~real).abs().max().item() == 0.0


_lengths = st.one_of(
    st.lists(st.integers(1, 4), min_size=1, max_size=24),  # many short documents, length-1 documents
    st.lists(st.integers(20, 64), min_size=1, max_size=2),  # one long document
    st.lists(st.integers(1, 16), min_size=1, max_size=6),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=_lengths,
    pad=st.one_of(st.just(0), st.integers(1, 40)),
    world=st.sampled_from([1, 2, 3, 4]),
    heads=st.sampled_from([(4, 1), (8, 2), (2, 2)]),
    d=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
)
def test_reference_backend_matches_dense_on_every_rank(lengths, pad, world, heads, d, dtype):
    ids = ids_from_lengths(lengths, pad)
    total = min(ids.numel(), 64)
    total -= total % world
    ids = ids[:total]
    if total == 0:
        return
    local = total // world
    for rank in range(world):
        _check_rank(ids, rank * local, local, *heads, d, dtype, flex=(rank % 2 == 0))


@pytest.mark.parametrize(
    "lengths,pad,world",
    [([7, 1, 1, 20, 3], 0, 4), ([1] * 16, 16, 2), ([40], 24, 4), ([30, 2], 32, 4)],
    ids=["straddles", "one_token_docs", "long_doc_all_padding_rank", "heavy_padding"],
)
def test_hand_layouts_fp32_and_flex(lengths, pad, world):
    ids = ids_from_lengths(lengths, pad)
    local = ids.numel() // world
    for rank in range(world):
        _check_rank(ids, rank * local, local, 8, 2, 64, torch.float32, flex=True)


@pytest.mark.parametrize("backend", ["reference", "te", "flash"])
def test_all_padding_rank_zero_attached_never_nan(backend, monkeypatch):
    """bf16 on CPU: flash/te launch no kernel for an all-padding chunk (gates pass with a flash_attn present)."""
    if backend == "flash":
        monkeypatch.setitem(vars(kernels), "HAS_FLASH_VARLEN", True)
    ids = ids_from_lengths([10], 22)
    local = 8
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 24, local, "cpu")
    assert meta == {"n_real": 0}
    q = torch.randn(1, 4, local, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 32, 16, dtype=torch.bfloat16)
    k[0, 0, 3, 1] = float("inf")
    k[0, 1, 5, 0] = float("-inf")
    v[0, 0, 7, 2] = float("nan")
    k.requires_grad_()
    v.requires_grad_()
    out = kernels._cp_blockdiag_varlen(q, k, v, ids, 24, backend=backend, meta=meta)
    assert out is not None and out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, torch.zeros_like(out))
    assert out.grad_fn is not None
    out.sum().backward()
    assert k.grad is not None and v.grad is not None, "zero output must stay attached to K/V"
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    assert q.grad is None


def test_batch_rows_segment_inline_and_ignore_meta():
    ids = torch.stack([ids_from_lengths([5, 3, 4], 4), ids_from_lengths([2, 10], 4)])
    local, off = 8, 8
    q, k, v, _ = _inputs(4, 2, local, 16, 16, torch.float64)
    q, k, v = (t.expand(2, -1, -1, -1).contiguous() for t in (q, k, v))
    meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cpu")  # row 0 only: must be ignored for B=2
    out = kernels._cp_blockdiag_varlen(q, k, v, ids, off, backend="reference", meta=meta)
    ref = kernels.dense_blockdiag_sdpa(q, k, v, ids, off)
    real = (ids[:, off : off + local] > 0)[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, **TOL[torch.float64])


@pytest.mark.parametrize("offset", [0, 2], ids=["chunk_holds_both_runs", "chunk_holds_the_second_run"])
def test_inline_segmentation_refuses_an_id_in_two_runs(offset):
    """Without ``meta`` the driver segments inline; an id in two runs is one document in the dense mask but would
    be two segments there (a silently different result, max error 2.3 before). It now validates the layout as
    ``precompute_blockdiag_varlen_meta`` does and returns None: the caller's dense path, the documented result."""
    ids = torch.tensor([1, 1, 2, 2, 1, 1])
    local = 6 - offset
    q, k, v, _ = _inputs(4, 2, local, 6, 8, torch.float64)
    with pytest.raises(ValueError, match="document id 1 appears in 2 separate runs"):
        kernels.precompute_blockdiag_varlen_meta(ids, offset, local, "cpu")
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, offset, backend="reference") is None


def test_backend_names():
    ids = ids_from_lengths([8], 0)
    q, k, v, _ = _inputs(2, 2, 8, 8, 8, torch.float64)
    with pytest.raises(ValueError, match="attention backend 'fa3'.*flash"):
        kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="fa3")
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="dense") is None
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="sdpa") is None
    auto = kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="auto")
    ref = kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference")
    torch.testing.assert_close(auto, ref, rtol=0, atol=0)


def test_fp32_on_flash_returns_none_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_CP_FLASH_WARNED", False)
    ids = ids_from_lengths([8], 0)
    q, k, v, _ = _inputs(2, 2, 8, 8, 8, torch.float32)
    with caplog.at_level(logging.WARNING, logger=kernels.logger.name):
        assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="flash") is None
        assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="flash") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "needs fp16/bf16" in warnings[0].getMessage()


def test_kernel_failure_returns_none_once_and_oom_is_reraised(monkeypatch, caplog):
    ids = ids_from_lengths([8], 0)
    q, k, v, _ = _inputs(2, 2, 8, 8, 8, torch.float64)
    monkeypatch.setattr(kernels, "_CP_FLASH_WARNED", False)

    def boom(*a, **kw):
        raise RuntimeError("kernel exploded")

    patch_provider(monkeypatch, "reference", boom)
    with caplog.at_level(logging.WARNING, logger=kernels.logger.name):
        assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference") is None
        assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError" in warnings[0].getMessage()

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    patch_provider(monkeypatch, "reference", oom)
    with pytest.raises(torch.OutOfMemoryError):
        kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference")


def test_unsafe_meta_falls_back():
    ids = ids_from_lengths([8], 0)
    q, k, v, _ = _inputs(2, 2, 8, 8, 8, torch.float64)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 0, 8, "cpu")
    meta["max_q"] = 3
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference", meta=meta) is None


def test_meta_of_another_chunk_falls_back_instead_of_attending_wrong_rows():
    ids = torch.tensor([1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0])
    q, k, v, _ = _inputs(2, 2, 6, 12, 4, torch.float64)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 0, 6, "cpu")  # built for rows [0, 6)
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference", meta=meta) is not None
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 6, backend="reference", meta=meta) is None
    # without meta, a chunk running past the ids is refused too (it used to give zeros past the end), and so is the
    # dense path it falls back to
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="reference") is None
    with pytest.raises(ValueError, match="must lie inside the doc_ids row"):
        kernels.dense_blockdiag_sdpa(q, k, v, ids, 8)


def test_reference_dropout_changes_output_grads_finite():
    ids = ids_from_lengths([12, 4], 0)
    q, k, v, _ = _inputs(4, 2, 16, 16, 16, torch.float64)
    q.requires_grad_()
    base = kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference")
    torch.manual_seed(1)
    dropped = kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="reference", dropout_p=0.5)
    assert not torch.allclose(base, dropped)
    (grad,) = torch.autograd.grad(dropped.sum(), q)
    assert torch.isfinite(grad).all()


def test_flex_refuses_dropout():
    ids = ids_from_lengths([8], 0)
    q, k, v, _ = _inputs(2, 2, 8, 8, 8, torch.float32)
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 0, backend="flex", dropout_p=0.1) is None


# ---- flash: the long-prefix guard with a fake flash_attn ------------------------------------------------


class _FakeFlash:
    """Records calls; computes real bottom-right causal attention through the reference backend."""

    def __init__(self):
        self.calls = []
        self.mod = types.ModuleType("flash_attn")
        self.mod.flash_attn_func = self.fixed
        self.mod.flash_attn_varlen_func = self.varlen

    def fixed(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, deterministic=False):
        self.calls.append(("fixed", tuple(q.shape), tuple(k.shape), causal, dropout_p, deterministic))
        cu_q = torch.tensor([0, q.shape[1]], dtype=torch.int32)
        cu_k = torch.tensor([0, k.shape[1]], dtype=torch.int32)
        return reference_varlen_attention(q[0], k[0], v[0], cu_q, cu_k, scale=softmax_scale).unsqueeze(0)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, deterministic=False):  # fmt: skip
        self.calls.append(
            ("varlen", q.shape[0], k.shape[0], cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q,
             max_seqlen_k, causal, dropout_p)
        )  # fmt: skip
        return reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=softmax_scale)


@pytest.fixture
def fake_flash(monkeypatch):
    fake = _FakeFlash()
    monkeypatch.setitem(sys.modules, "flash_attn", fake.mod)
    monkeypatch.setattr(kernels, "_CP_FLASH_LONG_SEGMENT_WARNED", False)
    return fake


def test_guard_peels_the_straddling_first_segment(fake_flash):
    q = torch.randn(6, 4, 8)
    k = torch.randn(11, 2, 8)
    v = torch.randn(11, 2, 8)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11], dtype=torch.int32)
    meta = {"first_q": 2, "first_k": 7, "max_tail": 4}
    out = kernels._flash_varlen_with_long_prefix_guard(
        q, k, v, cu_q=cu_q, cu_k=cu_k, max_q=4, max_k=7, local_query_len=8, scale=None, dropout_p=0.25, meta=meta
    )
    assert fake_flash.calls == [
        ("fixed", (1, 2, 4, 8), (1, 7, 2, 8), True, 0.25, False),
        ("varlen", 4, 4, [0, 4], [0, 4], 4, 4, True, 0.25),
    ]
    assert kernels._CP_FLASH_LONG_SEGMENT_WARNED
    ref = reference_varlen_attention(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # fp32, summation order only


def test_guard_single_straddling_segment_makes_one_fixed_call(fake_flash):
    q, k, v = torch.randn(3, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    out = kernels._flash_varlen_with_long_prefix_guard(
        q, k, v, cu_q=cu_q, cu_k=cu_k, max_q=3, max_k=9, local_query_len=3, scale=0.5, dropout_p=0.0,
        meta={"first_q": 3, "first_k": 9, "max_tail": 0},
    )  # fmt: skip
    assert [c[0] for c in fake_flash.calls] == ["fixed"] and out.shape == (3, 2, 8)


def test_guard_normal_path_returns_kernel_object_unchanged(monkeypatch):
    sentinel = object()
    calls = []
    mod = types.ModuleType("flash_attn")
    mod.flash_attn_func = lambda *a, **kw: pytest.fail("no fixed-length call on the normal path")

    def varlen(q, k, v, **kw):
        calls.append(kw)
        return sentinel

    mod.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setattr(kernels, "_CP_FLASH_DETERMINISTIC", True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    res = kernels._flash_varlen_with_long_prefix_guard(
        torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8), cu_q=cu, cu_k=cu, max_q=4, max_k=4,
        local_query_len=6, scale=0.3, dropout_p=0.1, meta={"first_q": 2, "first_k": 2, "max_tail": 4},
    )  # fmt: skip
    assert res is sentinel and len(calls) == 1
    kw = calls[0]
    assert kw["cu_seqlens_q"] is cu and kw["max_seqlen_q"] == 4 and kw["max_seqlen_k"] == 4
    assert kw["causal"] is True and kw["dropout_p"] == 0.1 and kw["softmax_scale"] == 0.3
    assert kw["deterministic"] is True


def test_driver_flash_through_fake_matches_reference_and_forwards_dropout(fake_flash):
    ids = ids_from_lengths([11, 3, 1, 6], 3)  # 24 tokens, W=3
    local = 8
    for off in (0, 8, 16):
        meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cpu")
        q, k, v, _ = _inputs(4, 2, local, 24, 16, torch.bfloat16)
        got = kernels._cp_blockdiag_varlen(q, k, v, ids, off, backend="flash", meta=meta)
        want = kernels._cp_blockdiag_varlen(q, k, v, ids, off, backend="reference", meta=meta)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # same math on the same bf16 inputs
    fake_flash.calls.clear()
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 8, local, "cpu")
    kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="flash", dropout_p=0.25, meta=meta)
    assert fake_flash.calls and all(0.25 in c for c in fake_flash.calls)


# ---- TransformerEngine with a fake module -----------------------------------------------------------------


@pytest.fixture
def fake_te(monkeypatch):
    built = []

    class DotProductAttention:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.device = None
            built.append(self)

        def to(self, device):
            self.device = device
            return self

        def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
            out = reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, scale=self.kwargs["softmax_scale"])
            return out.reshape(out.shape[0], -1)  # TE returns [T, H*D]

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.DotProductAttention = DotProductAttention
    te.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    monkeypatch.setattr(kernels, "_TE_DPA_CACHE", {})
    return built


def test_te_module_construction_and_cache(fake_te):
    a = kernels._te_varlen_dpa(8, 2, 64, 0.125, torch.device("cpu"), torch.bfloat16)
    b = kernels._te_varlen_dpa(8, 2, 64, 0.125, torch.device("cpu"), torch.bfloat16)
    c = kernels._te_varlen_dpa(8, 2, 64, 0.25, torch.device("cpu"), torch.bfloat16)
    assert a is b and a is not c and len(fake_te) == 2 and len(kernels._TE_DPA_CACHE) == 2
    assert a.kwargs == {
        "num_attention_heads": 8,
        "kv_channels": 64,
        "num_gqa_groups": 2,
        "attn_mask_type": "padding_causal_bottom_right",
        "qkv_format": "thd",
        "softmax_scale": 0.125,
    }
    assert a.device == torch.device("cpu")


def test_driver_te_matches_reference_and_refuses_dropout(fake_te, monkeypatch):
    monkeypatch.setattr(kernels, "_CP_TE_DROPOUT_WARNED", False)
    ids = ids_from_lengths([9, 2, 7], 6)
    meta = kernels.precompute_blockdiag_varlen_meta(ids, 8, 8, "cpu")
    q, k, v, _ = _inputs(4, 2, 8, 24, 16, torch.bfloat16)
    got = kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="te", meta=meta)
    want = kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="reference", meta=meta)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same math on the same bf16 inputs
    assert fake_te[0].kwargs["softmax_scale"] == pytest.approx(16**-0.5)  # None resolved to D**-0.5
    assert kernels._cp_blockdiag_varlen(q, k, v, ids, 8, backend="te", dropout_p=0.1, meta=meta) is None
    assert kernels._CP_TE_DROPOUT_WARNED


def test_engaged_flag_and_lazy_probes():
    assert kernels._TE_DPA_CACHE is not None
    assert isinstance(kernels.HAS_FLASH_VARLEN, bool) and isinstance(kernels.HAS_TE, bool)
    for name in ("_CP_FLASH_DETERMINISTIC", "_CP_FLASH_ENGAGED", "_CP_FLASH_LONG_SEGMENT_WARNED", "_CP_FLASH_WARNED",
                 "_CP_TE_DROPOUT_WARNED", "_CP_VARLEN_SHAPE_LOGGED"):  # fmt: skip
        assert isinstance(getattr(kernels, name), bool)
    assert kernels.logger.name == "longtrain.blockdiag_cp.kernels"


def _call_guard():
    q, k = torch.randn(6, 2, 8), torch.randn(11, 2, 8)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 7, 11], dtype=torch.int32)
    kernels._flash_varlen_with_long_prefix_guard(
        q, k, k, cu_q, cu_k, 4, 7, 6, None, 0.0, {"first_q": 2, "first_k": 7, "max_tail": 4}
    )


def _call_te():
    kernels._te_varlen_dpa(8, 2, 64, 0.125, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize(
    "modules,call,match",
    [
        (("flash_attn",), _call_guard, "flash-attn long-prefix guard is unavailable because"),
        (("transformer_engine", "transformer_engine.pytorch"), _call_te, "DotProductAttention is unavailable because"),
    ],
    ids=["guard-without-flash-attn", "te-dpa-without-transformer-engine"],
)
def test_kernel_entry_points_without_their_package_say_why(monkeypatch, modules, call, match):
    """The two documented kernel helpers import their package at call time; without it they raise an ImportError
    (the same type as the bare import) whose message says what is unavailable and why."""
    from longtrain import _optional

    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import name` raises
    monkeypatch.setattr(kernels, "_TE_DPA_CACHE", {})
    monkeypatch.setattr(kernels, "_CP_FLASH_LONG_SEGMENT_WARNED", True)
    _optional.reset_probe_cache()  # the reason comes from the cached probe: probe the hidden package, then forget
    try:
        with pytest.raises(ImportError, match=match) as info:
            call()
        assert isinstance(info.value.__cause__, ImportError)
        assert kernels._TE_DPA_CACHE == {}  # nothing cached for a module that was never built
    finally:
        monkeypatch.undo()
        _optional.reset_probe_cache()


def test_checkpoint_early_stop_signal_passes_through(monkeypatch):
    """Non-reentrant checkpoint stops recomputation by raising inside the region; the driver must not turn that
    control-flow signal into a dense fallback."""
    import torch.utils.checkpoint as checkpoint

    def stop(*args, **kwargs):
        raise checkpoint._StopRecomputationError()

    patch_provider(monkeypatch, "reference", stop)
    ids = torch.tensor([1, 1, 1, 2, 2, 0])
    q = torch.randn(1, 2, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    with pytest.raises(checkpoint._StopRecomputationError):
        kernels._cp_blockdiag_varlen(q, kv, kv, ids, 0, backend="reference")
