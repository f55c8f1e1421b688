"""GPU parity of the Triton varlen backward (``providers.triton_varlen_bwd``) with the float64 reference.

The kernel gets ``out``/``lse`` from torch's bundled FA2 forward (or cuDNN's, where the frontend is installed).
Tolerance (tests/gpu/_tolerance.py): the kernel's max error against the float64 reference may be at
most 2x the error of the same-dtype torch reference (per-document math SDPA run in bf16, autograd) plus one
bf16 rounding step of the reference values.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention
from tests.gpu._tolerance import assert_flash_rule_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tv():
    tv = pytest.importorskip("longtrain.blockdiag_cp.providers.triton_varlen_bwd", reason="triton not installed")
    reason = tv.triton_varlen_unavailable_reason(torch.bfloat16, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    return tv


def _lengths_u(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """The benchmark's document lengths (``benchmarks/blockdiag_attention.py``'s ``doc_lengths``)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "blockdiag_attention.py"
    spec = importlib.util.spec_from_file_location("_blockdiag_attention_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.doc_lengths(total, lo, hi, seed)


def _many_short() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    lengths, total = [], 0
    for n in torch.randint(1, 31, (1000,), generator=gen).tolist():  # ~512 documents in 8192 tokens
        n = min(n, 8192 - total)
        lengths.append(n)
        total += n
        if total == 8192:
            break
    return lengths


# name -> (query lengths, key lengths, (Hq, Hkv, D))
LAYOUTS = {
    # the first document starts on a lower CP rank: 300 local queries over 1500 keys
    "straddle": ([300, 211, 1, 1, 90, 600, 5], [1500, 211, 1, 1, 90, 600, 5], (32, 8, 128)),
    "one_token_docs_d64": ([1] * 60 + [70, 1, 1, 700], [1] * 60 + [70, 1, 1, 700], (8, 2, 64)),
    "512_docs": (_many_short(), _many_short(), (32, 8, 128)),
    "32k_u512_8192": (_lengths_u(32768, 512, 8192, 1), _lengths_u(32768, 512, 8192, 1), (32, 8, 128)),
}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _inputs(name: str, seed: int = 0):
    lq, lk, (hq, hkv, d) = LAYOUTS[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t_q, t_k = sum(lq), sum(lk)
    q = torch.randn(t_q, hq, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(t_k, hkv, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(t_k, hkv, d, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(t_q, hq, d, device="cuda", generator=gen).bfloat16()
    return q, k, v, dout, _cu(lq), _cu(lk), max(lq), max(lk), d**-0.5


def _reference_grads(q, k, v, dout, cu_q, cu_k, scale, dtype):
    """Autograd through per-document math SDPA in ``dtype``, one K/V head (and its query heads) at a time."""
    group = q.shape[1] // k.shape[1]
    grads = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
    for h in range(k.shape[1]):
        qs = q[:, h * group : (h + 1) * group].to(dtype).requires_grad_()
        ks = k[:, h : h + 1].to(dtype).requires_grad_()
        vs = v[:, h : h + 1].to(dtype).requires_grad_()
        out = reference_varlen_attention(qs, ks, vs, cu_q, cu_k, scale=scale)
        gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), dout[:, h * group : (h + 1) * group].to(dtype))
        grads[0][:, h * group : (h + 1) * group] = gq
        grads[1][:, h : h + 1] = gk
        grads[2][:, h : h + 1] = gv
    return grads


def _fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    from longtrain.blockdiag_cp.providers.flash import torch_flash_reason

    if torch_flash_reason() is not None:
        pytest.skip(f"torch's FA2 forward (source of out/lse) unavailable: {torch_flash_reason()}")
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
    return res[0], res[1].t()  # lse [Hq, T_q] -> [T_q, Hq] view


def _assert_flash_rule(kernel, same_dtype_ref, ref64, what):
    assert_flash_rule_all(what, ("dq", "dk", "dv"), kernel, same_dtype_ref, ref64)


@pytest.fixture
def poisoned(monkeypatch):
    tv = _tv()
    monkeypatch.setattr(tv, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                             device=device))  # fmt: skip
    return tv


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_float64_reference(poisoned, layout):
    """Separate dQ kernel on every layout; atomic dQ on the straddling and the 32K layouts (same references)."""
    tv = poisoned
    q, k, v, dout, cu_q, cu_k, max_q, max_k, scale = _inputs(layout)
    out, lse = _fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    ref64 = _reference_grads(q, k, v, dout, cu_q, cu_k, scale, torch.float64)
    ref16 = _reference_grads(q, k, v, dout, cu_q, cu_k, scale, torch.bfloat16)
    modes = ["kernel", "atomic"] if layout in ("straddle", "32k_u512_8192") else ["kernel"]
    for dq_mode in modes:
        cfg = tv.TritonVarlenBwdConfig(dq_mode=dq_mode)
        got = tv.triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config=cfg)
        assert [g.dtype for g in got] == [torch.bfloat16] * 3
        _assert_flash_rule(got, ref16, ref64, f"{layout} dq_mode={dq_mode}")


def test_kernel_mode_is_deterministic_and_syncs_nothing():
    tv = _tv()
    q, k, v, dout, cu_q, cu_k, max_q, max_k, scale = _inputs("straddle", seed=1)
    out, lse = _fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    cfg = tv.TritonVarlenBwdConfig()
    first = tv.triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config=cfg)
    torch.cuda.synchronize()
    fresh_q, fresh_k = cu_q.clone(), cu_k.clone()  # new metadata objects: the work lists are rebuilt on device
    overlap = tv.TritonVarlenBwdConfig(overlap=True)
    tv.triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config=overlap)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = tv.triton_varlen_bwd(dout, q, k, v, out, lse, fresh_q, fresh_k, max_q, max_k, scale, config=cfg)
        side = tv.triton_varlen_bwd(dout, q, k, v, out, lse, fresh_q, fresh_k, max_q, max_k, scale, config=overlap)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b, c in zip(first, again, side):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_cudnn_stats_as_input(poisoned):
    """cuDNN's forward output and ``stats[:, :, 0]`` (the integration path) give the same quality."""
    tv = poisoned
    from longtrain.blockdiag_cp.providers import cudnn_graph as cv

    reason = cv.cudnn_unavailable_reason(torch.bfloat16, torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    q, k, v, dout, cu_q, cu_k, max_q, max_k, scale = _inputs("straddle", seed=2)
    lay = cv._layout(cu_q, cu_k, max_q, max_k, q.shape[1], k.shape[1], q.shape[2], None)
    p = cv._params(q, k, lay, scale, False, q.shape[0], k.shape[0])
    out, stats = cv.cudnn_varlen_fwd(q, k, v, lay, p)
    got = tv.triton_varlen_bwd(dout, q, k, v, out, stats[:, :, 0], cu_q, cu_k, max_q, max_k, scale)
    ref64 = _reference_grads(q, k, v, dout, cu_q, cu_k, scale, torch.float64)
    ref16 = _reference_grads(q, k, v, dout, cu_q, cu_k, scale, torch.bfloat16)
    _assert_flash_rule(got, ref16, ref64, "cuDNN stats")


def test_autotune_picks_a_candidate_once():
    tv = _tv()
    q, k, v, dout, cu_q, cu_k, max_q, max_k, scale = _inputs("512_docs", seed=4)
    out, lse = _fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    got = tv.triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale)
    chosen = tv.tuned_configs()[(q.shape[2], q.shape[1], k.shape[1], q.dtype, str(q.device))]
    assert chosen in tv.CANDIDATES
    forced = tv.triton_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, config=chosen)
    if chosen.dq_mode == "kernel":
        for a, b in zip(got, forced):
            assert torch.equal(a, b)
