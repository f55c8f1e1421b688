"""Triton varlen attention backward (``providers.triton_varlen_bwd``) on CPU under ``TRITON_INTERPRET=1``.

Gradients are checked against autograd through the float64 per-document reference
(``reference_varlen_attention``), with the kernel fed the reference's own output and log-sum-exp.
Tolerance: fp32 kernel arithmetic (exact-fp32 dots in the interpreter) over a few hundred keys lands far under
1e-4 relative to the float64 reference; rtol/atol 2e-4 leaves a margin of rounding only.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention

tv = pytest.importorskip(
    "longtrain.blockdiag_cp.providers.triton_varlen_bwd", reason="triton not installed (pip install triton)"
)

# fp32 kernel vs float64 oracle: rounding of fp32 dot products only (see the module docstring)
RTOL = ATOL = 2e-4


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def _reference(q, k, v, dout, cu_q, cu_k, scale):
    """float64 ``(out, lse [T_q, Hq] with -inf for rows without keys, dq, dk, dv)``; rows outside docs: 0."""
    q64, k64, v64 = (t.double().detach().requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    lo_q, hi_q = int(cu_q[0]), int(cu_q[-1])
    seg = reference_varlen_attention(q64[lo_q:hi_q], k64, v64, cu_q - lo_q, cu_k, scale=scale)
    grads = torch.autograd.grad(seg, (q64, k64, v64), dout[lo_q:hi_q].double(), allow_unused=True)
    out[lo_q:hi_q] = seg.detach()
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (q64, k64, v64))]
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if b == a or e == c:
            continue
        s = torch.einsum("qhd,khd->hqk", q.double()[a:b], k.double()[c:e].repeat_interleave(rep, 1)) * scale
        rows = torch.arange(b - a)[:, None]
        cols = torch.arange(e - c)[None, :]
        s = s.masked_fill(~(cols <= rows + (e - c) - (b - a)), float("-inf"))
        lse[a:b] = torch.logsumexp(s, -1).t()
    return out, lse, *grads


def _inputs(lengths_q, lengths_k, hq, hkv, d, dtype, *, pad_q=0, pad_k=0, lead_q=0, lead_k=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q = _cu(lengths_q) + lead_q
    cu_k = _cu(lengths_k) + lead_k
    t_q = int(cu_q[-1]) + pad_q
    t_k = int(cu_k[-1]) + pad_k
    q = torch.randn(t_q, hq, d, generator=gen).to(dtype)
    k = torch.randn(t_k, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t_k, hkv, d, generator=gen).to(dtype)
    dout = torch.randn(t_q, hq, d, generator=gen).to(dtype)
    return q, k, v, dout, cu_q, cu_k


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write starts as NaN, so an unwritten element fails the comparison."""
    monkeypatch.setattr(tv, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                             device=device))  # fmt: skip
    tv._TABLES.clear()
    return True


_SMALL_M = tv.TritonVarlenBwdConfig(
    dkv_block_m=32, dkv_block_n=16, dkv_warps=1, dkv_stages=1, dq_block_m=16, dq_block_n=32, dq_warps=1, dq_stages=1
)
_ATOMIC = tv.TritonVarlenBwdConfig(dkv_block_m=16, dkv_block_n=32, dkv_warps=1, dkv_stages=1, dq_mode="atomic")

_EVERY_Q = [20 + (13 * i) % 50 for i in range(20)]
_EVERY_K = [n + (5 * i) % 34 for i, n in enumerate(_EVERY_Q)]

# name -> (q lengths, k lengths, (Hq, Hkv), D, extra layout kwargs, config)
CASES = {
    # the first document's start lives on a lower CP rank: 5 queries over 37 keys
    "straddle_gqa4": ([5, 20, 1, 14], [37, 20, 1, 14], (8, 2), 32, {}, None),
    "one_token_docs_mha": ([1, 1, 1, 20, 1, 1, 33, 1], [1, 1, 1, 20, 1, 1, 33, 1], (4, 4), 32, {}, None),
    # a document with keys but no queries, one with queries but no keys, and a padding tail on both sides
    "zero_query_doc_and_tails": ([10, 0, 20, 6], [10, 7, 20, 0], (8, 2), 32, {"pad_q": 5, "pad_k": 3}, None),
    # T not a multiple of any block; blocks wider in m than n (dK/dV) and in n than m (dQ)
    "odd_T_swapped_blocks": ([50, 33], [50, 33], (8, 2), 16, {}, _SMALL_M),
    # head dim 48 pads to a 64-wide tile; rows before cu[0]; 3 queries over 2 keys (one row sees no key)
    "d48_lead_rows_few_keys": ([17, 3, 9], [17, 2, 9], (4, 2), 48, {"lead_q": 4, "lead_k": 2}, None),
    # every query/key offset modulo the block sizes: diagonal and full-block boundaries at all alignments
    "every_offset": (_EVERY_Q, _EVERY_K, (2, 1), 16, {}, None),
    "straddle_atomic_dq": ([7, 25, 1, 12], [40, 25, 1, 12], (8, 2), 32, {"pad_q": 2}, _ATOMIC),
}


def _check(got, want, what):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{what} {name}: non-finite (unwritten or NaN) elements"
        torch.testing.assert_close(g.double(), w, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_float64_reference(triton_interpret, poisoned, case):
    lq, lk, (hq, hkv), d, extra, cfg = CASES[case]
    q, k, v, dout, cu_q, cu_k = _inputs(lq, lk, hq, hkv, d, torch.float32, **extra)
    scale = d**-0.5
    out, lse, *want = _reference(q, k, v, dout, cu_q, cu_k, scale)
    got = tv.triton_varlen_bwd(dout, q, k, v, out.float(), lse.float(), cu_q, cu_k, max(lq), max(lk), scale, config=cfg)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.float32 for g in got)
    _check(got, want, case)
    lead_q, lead_k = extra.get("lead_q", 0), extra.get("lead_k", 0)
    outside_q = torch.ones(q.shape[0], dtype=torch.bool)
    outside_q[lead_q : int(cu_q[-1])] = False
    outside_k = torch.ones(k.shape[0], dtype=torch.bool)
    outside_k[lead_k : int(cu_k[-1])] = False
    assert torch.all(got[0][outside_q] == 0) and torch.all(got[1][outside_k] == 0) and torch.all(got[2][outside_k] == 0)


def test_strided_inputs_flash_lse_layout_and_positive_inf_rows(triton_interpret, poisoned):
    """lse as FlashAttention's ``[Hq, T].t()`` view, q/out/dout head-strided views, +inf lse on keyless rows."""
    lq, lk = [6, 30, 4], [40, 30, 0]
    q, k, v, dout, cu_q, cu_k = _inputs(lq, lk, 4, 2, 32, torch.float32, seed=3)
    scale = 0.2
    out, lse, *want = _reference(q, k, v, dout, cu_q, cu_k, scale)
    lse_flash = lse.float().t().contiguous()  # [Hq, T_q]
    lse_flash[torch.isinf(lse_flash)] = float("inf")  # FlashAttention marks rows without keys with +inf
    wide = torch.zeros(q.shape[0], 8, 32)
    wide[:, ::2] = q
    q_view = wide[:, ::2]
    assert q_view.stride(1) == 64
    got = tv.triton_varlen_bwd(dout, q_view, k, v, out.float(), lse_flash.t(), cu_q, cu_k, 30, 40, scale)
    _check(got, want, "strided")
    assert got[0][-4:].abs().max().item() == 0.0  # the last document has no keys


def test_fp16_inputs(triton_interpret, poisoned):
    """fp16 operands, fp32 accumulation: compare with the float64 gradients of the fp16-rounded inputs."""
    q, k, v, dout, cu_q, cu_k = _inputs([9, 23], [30, 23], 4, 2, 32, torch.float16, seed=5)
    scale = 32**-0.5
    out, lse, *want = _reference(q, k, v, dout, cu_q, cu_k, scale)
    got = tv.triton_varlen_bwd(dout, q, k, v, out.half(), lse.float(), cu_q, cu_k, 23, 30, scale)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float16
        # fp16 P / dS operands and an fp16 output: a few fp16 rounding steps (2**-11) of the gradient's scale
        err = (g.double() - w).abs().max().item()
        assert err <= 8 * 2**-11 * max(1.0, w.abs().max().item()), f"{name}: {err}"


def test_empty_and_all_outside(triton_interpret, poisoned):
    q, k, v, dout, cu_q, cu_k = _inputs([], [], 2, 1, 16, torch.float32, pad_q=5, pad_k=4)
    lse = torch.full((5, 2), float("-inf"))
    dq, dk, dv = tv.triton_varlen_bwd(dout, q, k, v, torch.zeros_like(q), lse, cu_q, cu_k, 0, 0, None)
    assert dq.abs().max().item() == 0.0 and dk.abs().max().item() == 0.0 and dv.abs().max().item() == 0.0
    q0 = q[:0]
    dq, dk, dv = tv.triton_varlen_bwd(
        dout[:0],
        q0,
        k,
        v,
        q0,
        lse[:0],
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        0,
        0,
        None,
    )
    assert dq.shape == (0, 2, 16) and dk.abs().max().item() == 0.0


def test_work_list_cache_follows_the_metadata_objects(triton_interpret):
    tv._TABLES.clear()
    cu = _cu([30, 10])
    a = tv._work_lists(cu, cu, 40, 40, 16, 32)
    assert tv._work_lists(cu, cu, 40, 40, 16, 32)[0] is a[0]
    cu2 = cu.clone()
    assert tv._work_lists(cu2, cu2, 40, 40, 16, 32)[0] is not a[0]
    cu[1] = 20  # in-place edit bumps the version counter: rebuilt
    b = tv._work_lists(cu, cu, 40, 40, 16, 32)
    assert b[0] is not a[0] and not torch.equal(b[0], a[0])


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=0, max_size=8),
    pads=st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
    block=st.sampled_from([16, 32, 64]),
)
def test_work_lists_cover_every_block_once_heaviest_first(lens, pads, block):
    lead_q, lead_k, pad_q, pad_k = pads
    cu_q = _cu([a for a, _ in lens]) + lead_q
    cu_k = _cu([b for _, b in lens]) + lead_k
    t_q, t_k = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    docs = tv._documents(cu_q, cu_k, t_q, t_k)
    n_docs = docs[0].numel()
    for by_keys, total in ((True, t_k), (False, t_q)):
        table = tv._work_list(docs, block, by_keys, math.ceil(total / block) + n_docs)
        live = table[table[:, 3 if by_keys else 1] > 0]
        # every row of [0, T) is covered by exactly one live block (pseudo-documents cover the outside rows)
        covered = torch.zeros(total, dtype=torch.long)
        for q0, lq, k0, lk, start, *_ in live.tolist():
            base, length = (k0, lk) if by_keys else (q0, lq)
            covered[base + start : base + min(start + block, length)] += 1
        assert torch.equal(covered, torch.ones(total, dtype=torch.long))
        # heaviest first
        lq, lk, start = live[:, 1], live[:, 3], live[:, 4]
        off = lk - lq
        work = (lq - (start - off).clamp(min=0)) if by_keys else torch.minimum(lk, start + block + off)
        work = work.clamp(min=0)
        assert torch.all(work[:-1] >= work[1:])


def test_config_validation():
    with pytest.raises(ValueError, match="dkv_block_n must be a power of two"):
        tv.TritonVarlenBwdConfig(dkv_block_n=48)
    with pytest.raises(ValueError, match="dq_mode must be one of kernel, atomic"):
        tv.TritonVarlenBwdConfig(dq_mode="fast")
    with pytest.raises(ValueError, match="dq_stages"):
        tv.TritonVarlenBwdConfig(dq_stages=0)
    with pytest.raises(ValueError, match="unknown TritonVarlenBwdConfig fields"):
        tv.config_from_dict({"block": 3})
    assert tv.config_from_dict({"dq_mode": "atomic"}).short().endswith("dq-atomic")


def test_input_validation(triton_interpret):
    q, k, v, dout, cu_q, cu_k = _inputs([8], [8], 4, 2, 16, torch.float32)
    lse = torch.zeros(8, 4)
    args = [dout, q, k, v, q, lse, cu_q, cu_k, 8, 8, None]

    def call(i, value, exc, match, **more):
        bad = list(args)
        bad[i] = value
        for j, other in more.items():
            bad[int(j[1:])] = other
        with pytest.raises(exc, match=match):
            tv.triton_varlen_bwd(*bad)

    call(2, torch.zeros(8, 3, 16), ValueError, "multiple of key/value heads", a3=torch.zeros(8, 3, 16))
    call(1, torch.zeros(8, 4, 24), ValueError, "must have shape|head dim")
    call(5, torch.zeros(4, 8), ValueError, r"lse must be \[T_q, Hq\]")
    call(5, torch.zeros(8, 4, dtype=torch.float64), ValueError, "fp32")
    call(3, v.double(), TypeError, "q's dtype")
    call(7, torch.tensor([0, 8, 8], dtype=torch.int32), ValueError, "both be")
    call(6, torch.tensor([[0, 8]], dtype=torch.int32), ValueError, "1-D int32")
    call(8, -1, ValueError, "max_q")
    call(10, 0.0, ValueError, "scale")
    with pytest.raises(TypeError, match="TritonVarlenBwdConfig"):
        tv.triton_varlen_bwd(*args, config={"dq_mode": "atomic"})
    bf = [t.bfloat16() if isinstance(t, torch.Tensor) and t.is_floating_point() and t is not lse else t for t in args]
    with pytest.raises(RuntimeError, match="interpreter"):
        tv.triton_varlen_bwd(*bf)


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET=1" in tv.triton_varlen_unavailable_reason(torch.float32, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tv.triton_varlen_unavailable_reason(torch.float32, "cpu") is None
    assert "fp32/fp16" in tv.triton_varlen_unavailable_reason(torch.bfloat16, "cpu")
    assert "not on meta" in tv.triton_varlen_unavailable_reason(torch.float16, "meta")
