"""The FP8 indexer (``fp8=True``): E4M3 codes with power-of-two scales, the exact selection of their scores on every
route that takes it (Triton under the interpreter, torch), a clear error where it cannot run, and its plumbing
through the layer (the HF integration's: tests/integrations/test_hf_dsa.py; the warm-up's: test_dsa_triton.py)."""

from __future__ import annotations

import pytest
import torch

from longtrain.dsa import ops, routes
from longtrain.dsa import reference as ref
from longtrain.dsa.triton import IndexerConfig
from longtrain.dsa.triton import _common as triton_common
from tests.dsa.test_dsa_triton import _doc_layout

CPU = torch.device("cpu")
_ICFG = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)


def _inputs(T, H_I, D_I, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H_I, D_I, generator=g) * 2.0
    k = torch.randn(T, D_I, generator=g) * 0.3
    w = torch.randn(T, H_I, generator=g)
    return q, k, w


def _fp8_reference(q, k, w, starts, lengths, K):
    """The selection of the FP8 scores, from the dequantized codes in float64."""
    q8, k8, wf, ks = ref.indexer_fp8_operands(q, k, w)
    return ref.indexer_topk_reference(q8.double(), k8.double() * ks.double()[:, None], wf.double(), starts, lengths, K)


def _overlap(a, b):
    used = a >= 0
    return float(((a.unsqueeze(2) == b.unsqueeze(1)) & used.unsqueeze(2)).any(2).sum()) / float(used.sum())


# --------------------------------------------------------------------------------------------- the codes


def test_fp8_rows_are_power_of_two_scaled_e4m3_within_half_an_ulp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 64, generator=g) * torch.logspace(-6, 6, 6)[:, None, None]
    x[2, 3] = 0.0  # an all-zero row: scale 1, codes 0
    x[4, 1, 7] = 1e30  # one huge value: the row's scale follows it, the rest underflows toward 0 (never NaN)
    codes, scale = ref.fp8_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    assert scale[2, 3] == 1.0 and torch.all(codes[2, 3].float() == 0)
    c = codes.float()
    assert torch.isfinite(c).all() and c.abs().max() <= ref.FP8_E4M3_MAX
    deq = c * scale[..., None]
    # Round to nearest with 3 mantissa bits: relative error <= 2**-4 for normal codes (|code| >= 2**-6).
    normal = c.abs() >= 2.0**-6
    rel = ((deq - x).abs() / x.abs().clamp_min(1e-38))[normal]
    assert rel.max() <= 2.0**-4
    # The row maximum uses the top binade of E4M3: its code is at least 224 (half of 448).
    amax = c.abs().amax(-1)
    assert torch.all((amax >= 224) | (amax == 0))
    # Dequantized values are exact in bf16 (3 mantissa bits of 7, power-of-two scale).
    nonzero = scale[..., None].expand_as(c) < 1e20
    assert torch.equal(deq[nonzero].to(torch.bfloat16).float(), deq[nonzero])


def test_fp8_operands_fold_the_query_scales_into_the_weights():
    q, k, w = _inputs(12, 3, 32, seed=1)
    q8, k8, wf, ks = ref.indexer_fp8_operands(q, k, w)
    _, q_scale = ref.fp8_rows(q)
    _, k_scale = ref.fp8_rows(k)
    assert torch.equal(wf, w * q_scale) and torch.equal(ks, k_scale) and wf.dtype == torch.float32
    # relu passes positive scales through: the FP8 scores are the dequantized inputs' scores.
    dq, dk = q8.double() * q_scale.double()[..., None], k8.double() * k_scale.double()[:, None]
    eligible = torch.ones(12, 12, dtype=torch.bool)
    lhs = ref.indexer_scores(dq, dk, w.double(), eligible)
    rhs = ref.indexer_scores(q8.double(), k8.double() * ks.double()[:, None], wf.double(), eligible)
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------- the kernels


@pytest.mark.interpret
@pytest.mark.parametrize("docs,pad,H_I,D_I,K", [((30, 17), 3, 2, 32, 6), ((40,), 0, 3, 48, 16)])
def test_triton_fp8_is_the_exact_selection_of_the_fp8_scores(triton_interpret, docs, pad, H_I, D_I, K):
    from longtrain.dsa.triton import indexer_topk_triton

    starts, lengths = _doc_layout(docs, pad)
    q, k, w = _inputs(starts.shape[0], H_I, D_I, seed=sum(docs))
    out = indexer_topk_triton(q, k, w, starts, lengths, K, config=_ICFG, fp8=True)
    assert torch.equal(out, _fp8_reference(q, k, w, starts, lengths, K))
    exact = indexer_topk_triton(q, k, w, starts, lengths, K, config=_ICFG)
    assert torch.equal(exact, ref.indexer_topk_reference(q.double(), k.double(), w.double(), starts, lengths, K))
    # FP8 changes some choices where scores are close, never the canonical form.
    assert 0.5 < _overlap(out, exact) <= 1.0


@pytest.mark.interpret
def test_triton_fp8_with_the_sampled_select(triton_interpret):
    """Rows wider than ``select_cand`` go through the sampled bracket on FP8 scores as on exact ones."""
    from longtrain.dsa.triton import indexer_topk_triton

    starts, lengths = _doc_layout((300,))
    q, k, w = _inputs(300, 2, 16, seed=4)
    rows = slice(232, 300)  # rows of 233..300 keys: both paths, a quarter of the interpreter's time
    q, w, starts, lengths = q[rows], w[rows], starts[rows], lengths[rows]
    cfg = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256, select_sample=64,
                        select_cand=256)  # fmt: skip
    out = indexer_topk_triton(q, k, w, starts, lengths, 20, config=cfg, fp8=True)
    assert torch.equal(out, _fp8_reference(q, k, w, starts, lengths, 20))


def test_torch_route_fp8_equals_the_reference_and_auto_on_cpu_takes_it():
    cu = torch.tensor([0, 20, 21, 32], dtype=torch.int32)
    q, k, w = _inputs(32, 2, 32, seed=7)
    meta = ops.prepare_dsa_metadata(cu, 32)
    want = _fp8_reference(q, k, w, meta.starts, meta.causal_lengths, 8)
    assert torch.equal(ops.indexer_topk(q, k, w, cu, 8, backend="torch", fp8=True), want)
    assert torch.equal(ops.indexer_topk(q, k, w, cu, 8, fp8=True), want)  # auto on CPU: torch
    # bf16 inputs: the codes come from the same values.
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    got = ops.indexer_topk(qb, kb, w, cu, 8, backend="torch", fp8=True)
    assert torch.equal(got, _fp8_reference(qb.float(), kb.float(), w, meta.starts, meta.causal_lengths, 8))


@pytest.mark.interpret
def test_triton_route_fp8_through_ops_matches_torch(triton_interpret):
    pytest.importorskip("triton")
    cu = torch.tensor([0, 20, 21, 32], dtype=torch.int32)
    q, k, w = _inputs(32, 2, 32, seed=9)
    got = ops.indexer_topk(q, k, w, cu, 8, backend="triton", fp8=True)
    assert torch.equal(got, ops.indexer_topk(q, k, w, cu, 8, backend="torch", fp8=True))


# --------------------------------------------------------------------------------------------- where it cannot run


def test_fp8_refuses_cudnn_and_non_bools():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q, k, w = _inputs(8, 2, 16, seed=0)
    with pytest.raises(ValueError, match="fp8=True has no cudnn route"):
        ops.indexer_topk(q, k, w, cu, 4, backend="cudnn", fp8=True)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        ops.indexer_topk(q, k, w, cu, 4, fp8=1)


def test_fp8_needs_sm89_on_cuda(monkeypatch):
    monkeypatch.setattr(triton_common, "_FP8_UNFIT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    exc, msg = triton_common.indexer_fp8_unfit(torch.device("cuda:0"))
    assert exc is RuntimeError and "SM89+" in msg and "SM80" in msg and "fp8=False" in msg
    monkeypatch.setattr(triton_common, "_FP8_UNFIT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert triton_common.indexer_fp8_unfit(torch.device("cuda:0")) is None
    assert triton_common.indexer_fp8_unfit(CPU) is None  # the interpreter


def test_auto_with_fp8_skips_cudnn_and_an_sm80_triton(monkeypatch):
    monkeypatch.setattr(routes, "triton_absent", lambda device: None)
    monkeypatch.setattr(routes, "cudnn_absent", lambda device: None)
    monkeypatch.setattr(routes, "device_major", lambda device: 9)
    shape = dict(routes.GLM52_INDEXER)
    cuda = torch.device("cuda:0")
    monkeypatch.setattr(triton_common, "_FP8_UNFIT", {"cuda:0": None})
    assert routes.auto_plan(routes.CallShape("indexer_topk", cuda, **shape, fp8=True)).fwd == "triton"
    monkeypatch.setattr(routes, "triton_absent", lambda device: "no triton here")
    # cuDNN's indexer has no FP8 option: without triton, FP8 runs on torch.
    assert routes.auto_plan(routes.CallShape("indexer_topk", cuda, **shape)).fwd == "cudnn"
    assert routes.auto_plan(routes.CallShape("indexer_topk", cuda, **shape, fp8=True)).fwd == "torch"
    monkeypatch.setattr(routes, "triton_absent", lambda device: None)
    monkeypatch.setattr(triton_common, "_FP8_UNFIT", {"cuda:0": (RuntimeError, "needs SM89+")})
    assert routes.auto_plan(routes.CallShape("indexer_topk", cuda, **shape, fp8=True)).fwd == "torch"


# --------------------------------------------------------------------------------------------- plumbing


def test_layer_and_hf_pass_fp8_to_the_indexer(monkeypatch):
    from longtrain.dsa.layer import DSAConfig

    with pytest.raises(ValueError, match="indexer_fp8 must be a bool"):
        DSAConfig(indexer_fp8="yes")
    with pytest.raises(ValueError, match="no cudnn route"):  # at construction, not at the first forward
        DSAConfig(indexer_fp8=True, backend="cudnn")
    assert DSAConfig().indexer_fp8 is False
    seen = []
    real = ops.indexer_topk

    def spy(*args, fp8=False, **kwargs):
        seen.append(fp8)
        return real(*args, fp8=fp8, **kwargs)

    monkeypatch.setattr(ops, "indexer_topk", spy)
    from longtrain.dsa.layer import DSAAttention
    from tests.dsa.test_layer import CU, POS, small_config

    torch.manual_seed(0)
    layer = DSAAttention(small_config(indexer_fp8=True))
    x = torch.randn(15, 64)
    out, topk = layer(x, POS, CU, return_topk=True)
    assert torch.isfinite(out).all() and seen == [True]
    layer.config.indexer_fp8 = False
    layer(x, POS, CU)
    assert seen[1:] == [False]


@pytest.mark.interpret
def test_benchmark_fp8_row_times_it_and_reports_both_overlaps(triton_interpret, monkeypatch):
    """``benchmarks/dsa.py --indexer-case`` adds the FP8 row; its logic here on CPU (timing stubbed)."""
    from longtrain.bench_suites import dsa as suite
    from longtrain.dsa.triton import indexer_topk_triton

    monkeypatch.setattr(suite, "TOPK", 8)
    monkeypatch.setattr(suite, "bench", lambda fn, rep_ms=100: (fn(), (1.0, 0.9, 1.1))[1])
    monkeypatch.setattr(suite, "peak_mib", lambda fn: 0.0)
    starts, lengths = _doc_layout((40,))
    q, k, w = _inputs(40, 16, 32, seed=2)  # 16 heads: no key scores exactly 0 on all of them (no ties)
    exact = indexer_topk_triton(q, k, w, starts, lengths, 8, config=_ICFG)
    rows = []
    suite._fp8_row(lambda **r: rows.append(r), q, k, w, starts, lengths, _ICFG, exact, "shape", 2e9, True)
    (row,) = rows
    assert row["impl"] == "triton (ours, fused; FP8 E4M3 scores, fp8=True)" and row["tflops"] == 2.0
    assert "with the torch selection of the FP8 scores 1.00000" in row["note"]
    wide = lengths > 8
    fp8 = indexer_topk_triton(q, k, w, starts, lengths, 8, config=_ICFG, fp8=True)
    assert f"bf16 selection {suite.selection_overlap(fp8[wide], exact[wide]):.5f}" in row["note"]


# --------------------------------------------------------------------------------------------- the codes kernel

try:  # a module-level kernel: Triton resolves a kernel's names in its module's globals
    import triton
    import triton.language as tl

    from longtrain.dsa.triton.indexer_topk import _e4m3_bits

    @triton.jit
    def _convert(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + offs, _e4m3_bits(x), mask=offs < n)

except ImportError:  # no triton: the interpreter tests skip
    _convert = None


@pytest.mark.interpret
def test_e4m3_rounding_is_torchs_on_every_code_and_every_midpoint(triton_interpret):
    """The codes kernel rounds in integer arithmetic (the interpreter's own float -> fp8 conversion does not carry a
    rounded-up mantissa into the exponent): every E4M3 value, every midpoint between neighbours (ties to even), the
    values just off them, the subnormal range and random values give torch's bytes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique()  # 0 .. 448, subnormals included
    mids = (values[1:] + values[:-1]) / 2
    off = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    g = torch.Generator().manual_seed(0)
    rand = (torch.rand(4000, generator=g) * 2 - 1) * torch.logspace(-12, 2.65, 4000)
    x = torch.cat([values, mids, off, rand, torch.tensor([0.0, 2.0**-6, 2.0**-6 * (1 - 2.0**-10), 2.0**-10])])
    x = torch.cat([x, -x]).clamp(-448, 448).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    _convert[((x.numel() + 1023) // 1024,)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.interpret
@pytest.mark.parametrize("D", [128, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_kernel_equals_the_reference_operands_bit_for_bit(triton_interpret, D, dtype):
    from longtrain.dsa.triton.indexer_topk import indexer_fp8_operands_triton

    g = torch.Generator().manual_seed(D)
    q = torch.randn(37, 3, D, generator=g) * torch.logspace(-20, 4, 37)[:, None, None]
    q[5] = 0.0  # an all-zero row and head: scale 1
    q[6, 1, 3] = 6e4  # one large value sets its row's scale
    k = torch.randn(29, D, generator=g) * 3
    k[2] = 0.0
    k[3] = 448.0  # exactly the E4M3 maximum: scale 1
    k[4, 0] = 450.0  # just above it (in every dtype): scale 2
    w = torch.randn(37, 3, generator=g)
    q, k = q.to(dtype), k.to(dtype)
    got = indexer_fp8_operands_triton(q.contiguous(), k.contiguous(), w.contiguous())
    want = ref.indexer_fp8_operands(q, k, w)
    for a, b in zip(got, want):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)
    assert float(want[3][3]) == 1.0 and float(want[3][4]) == 2.0 and float(want[3][2]) == 1.0


@pytest.mark.interpret
# numpy (the interpreter) warns on the inf / NaN arithmetic of the subnormal branch, which the result never takes
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_non_finite_values_give_nan_codes_never_finite_ones(triton_interpret):
    """A NaN or infinity in a query or key row becomes a NaN code (so that row's scores are NaN, as without FP8),
    not a finite byte; the row's other values keep finite codes."""
    from longtrain.dsa.triton.indexer_topk import indexer_fp8_operands_triton

    x = torch.tensor([0.5, -2.0, 300.0, 448.0, 449.0, 1e-3, 0.0, -0.0] * 2)
    y = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.0e38, -1.0e-45] * 2)
    out = torch.empty(y.shape, dtype=torch.uint8)
    _convert[(1,)](y.contiguous(), out, y.numel(), BLOCK=16)
    codes = out.view(torch.float8_e4m3fn).float()
    assert torch.isnan(codes[:3]).all() and torch.isnan(codes[3])  # 3e38 is far beyond 448: NaN, not wrapped
    assert codes[4] == 0.0  # a float32 subnormal rounds to (negative) zero
    out_x = torch.empty(x.shape, dtype=torch.uint8)
    _convert[(1,)](x.contiguous(), out_x, x.numel(), BLOCK=16)
    assert torch.equal(out_x[:4], x[:4].to(torch.float8_e4m3fn).view(torch.uint8))
    q = torch.randn(4, 2, 16)
    q[1, 0, 3] = float("nan")
    k = torch.randn(6, 16)
    k[2, 5] = float("inf")
    q8, k8, wf, ks = indexer_fp8_operands_triton(q, k, torch.rand(4, 2))
    assert torch.isnan(q8[1, 0, 3].float()) and torch.isnan(k8[2, 5].float())
    assert torch.isfinite(q8[0].float()).all() and torch.isfinite(k8[[0, 1, 3, 4, 5]].float()).all()
