"""Provider availability reasons, ``resolve_backend``, doctor rows, the flex block mask and the reference backend."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from longtrain.blockdiag_cp import kernels, providers
from longtrain.blockdiag_cp.meta import meta_from_dict, resolve_device, validate_meta_dict
from longtrain.blockdiag_cp.providers import flash, flex
from longtrain.blockdiag_cp.providers.reference import reference_varlen_attention
from tests.blockdiag._kernels_util import ids_from_lengths

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def test_reason_order_for_flash_and_te():
    r = kernels._varlen_backend_unavailable_reason
    assert r("flash", torch.float32, CUDA) == "varlen CP attention needs fp16/bf16, got torch.float32"
    assert r("te", torch.float32, CPU) == "varlen CP attention needs fp16/bf16, got torch.float32"
    assert r("flash", torch.bfloat16, CPU) == "varlen CP attention requires CUDA, got device=cpu"
    assert r("te", torch.float16, CPU) == "varlen CP attention requires CUDA, got device=cpu"
    assert r("nope", torch.bfloat16, CUDA).startswith("unsupported varlen backend=nope (valid: ")


@pytest.mark.parametrize(
    "dtype,device,reason",
    [
        (torch.float32, CUDA, "varlen CP attention needs fp16/bf16, got torch.float32"),
        (torch.float32, CPU, "varlen CP attention needs fp16/bf16, got torch.float32"),
        (torch.bfloat16, CPU, "varlen CP attention requires CUDA, got device=cpu"),
        (torch.float16, CUDA, "unsupported varlen backend=nope (valid: "),
    ],
    ids=["fp32-cuda", "fp32-cpu", "bf16-cpu", "fp16-cuda"],
)
def test_unknown_backend_name_is_checked_after_dtype_and_device(dtype, device, reason):
    """The documented order (dtype, CUDA, then the backend) holds for an unknown name too."""
    assert kernels._varlen_backend_unavailable_reason("nope", dtype, device).startswith(reason)


def test_reason_for_libraries_on_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the no-library answers; a CUDA machine may have them")
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(flash, "flash_attn_module", lambda: None)
    assert "flash_attn varlen kernel is unavailable" in kernels._varlen_backend_unavailable_reason(
        "flash", torch.bfloat16, CUDA
    )
    monkeypatch.setattr(flash, "flash_attn_module", lambda: types.ModuleType("flash_attn"))
    assert kernels._varlen_backend_unavailable_reason("flash", torch.bfloat16, CUDA) is None
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.setattr(
        providers.te._optional, "transformer_engine", lambda: (False, "transformer_engine not installed")
    )
    assert "TransformerEngine varlen kernel is unavailable" in kernels._varlen_backend_unavailable_reason(
        "te", torch.bfloat16, CUDA
    )


def test_reason_for_reference_flex_dense():
    r = kernels._varlen_backend_unavailable_reason
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert r("reference", dtype, CPU) is None
    assert "floating" in r("reference", torch.int32, CPU)
    assert (
        r("flex", torch.bfloat16, CPU)
        == f"FlexAttention on CPU in torch {torch.__version__} runs forward only (no backward)"
    )
    assert "fp16/bf16/fp32" in r("flex", torch.float64, CUDA)
    assert "not a varlen backend" in r("dense", torch.bfloat16, CPU)
    assert r("auto", torch.float32, CPU) is None


def test_resolve_backend():
    r = providers.resolve_backend
    assert r("auto", torch.bfloat16, CPU) == "reference"
    assert r(None, torch.bfloat16, CPU) == "reference"  # None is the default: auto
    assert r("flex", torch.bfloat16, CPU) == "flex"
    assert r("sdpa") == "dense" and r("FA2") == "flash" and r("Flash-Attn-4") == "fa4"
    with pytest.raises(ValueError, match="expected one of auto, flash, te, cudnn, fa4"):
        r("flash_attention_3", torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="dtype and device"):
        r("auto")
    assert set(providers.PROVIDERS) >= {"cudnn", "fa4", "flash", "te", "flex", "reference", "dense"}
    assert "auto" not in providers.PROVIDERS


def test_auto_table_rows_and_layout_class():
    assert {cls for cls, _ in providers.AUTO_TABLE} == {"short", "long"}
    assert all(order and set(order) <= set(providers.PROVIDERS) for order in providers.AUTO_TABLE.values())
    assert all(providers.get(n).dropout for (_, drop), order in providers.AUTO_TABLE.items() if drop for n in order)
    short = kernels.precompute_blockdiag_varlen_meta(torch.repeat_interleave(torch.arange(1, 9), 64), 0, 512, CPU)
    long = kernels.precompute_blockdiag_varlen_meta(torch.ones(4096, dtype=torch.int64), 0, 4096, CPU)
    for meta, cls in ((short, "short"), (long, "long")):
        assert validate_meta_dict(meta, meta["n_real"], meta["real_end"], CPU) is None
        assert providers.layout_class(meta_from_dict(meta)) == cls
    assert providers.layout_class(None) == "long"


def test_backend_status_rows_for_doctor():
    rows = providers.backend_status()
    names = [name for name, _ in rows]
    assert [n for n in names if n in providers.PROVIDERS] == list(providers.PROVIDERS)
    status = dict(rows)
    assert status["reference"] is None and status["dense"] is None
    if not torch.cuda.is_available():
        assert "needs CUDA" in status["flash"] and "SM80+" in status["flash"]
        assert "no backward" in status["flex"]


def test_resolve_device_normalises_index():
    assert resolve_device("cpu:0") == resolve_device(torch.device("cpu"))
    assert resolve_device("cuda").index is not None


@pytest.mark.parametrize(
    "lengths,pad,world",
    [([130, 1, 1, 300, 90], 250, 4), ([1024], 0, 2), ([200] * 5, 24, 4), ([1] * 70 + [440], 2, 2)],
    ids=["mixed", "one_doc", "equal", "one_token_docs"],
)
def test_flex_block_mask_structure_covers_the_dense_mask(lengths, pad, world):
    """Every block with an allowed pair is listed; every 'full' block is fully allowed; mask_mod is exact."""
    ids = ids_from_lengths(lengths, pad)
    total = ids.numel() - ids.numel() % world
    ids = ids[:total]
    local, bs = total // world, 128
    for rank in range(world):
        off = rank * local
        meta = kernels.precompute_blockdiag_varlen_meta(ids, off, local, "cpu")
        if meta["n_real"] == 0:
            continue
        assert validate_meta_dict(meta, local, total, CPU) is None
        typed = meta_from_dict(meta)
        bm = flex.flex_block_mask(typed, local, total, CPU)
        assert flex.flex_block_mask(typed, local, total, CPU) is bm  # cached in the meta
        real = ids[off : off + local] > 0
        dense = kernels._cp_blockdiag_mask(ids, off, local, total, 1)[0, 0] & real[:, None]
        q_idx, k_idx = torch.arange(local)[:, None], torch.arange(total)[None, :]
        assert torch.equal(bm.mask_mod(0, 0, q_idx, k_idx), dense)
        nq, nk = -(-local // bs), -(-total // bs)
        blocks = torch.nn.functional.pad(dense, (0, nk * bs - total, 0, nq * bs - local)).view(nq, bs, nk, bs)
        any_blk, all_blk = blocks.any(3).any(1), blocks.all(3).all(1)
        listed = torch.zeros(nq, nk, dtype=torch.bool)
        full = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            listed[i, bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]]] = True
            full[i, bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]]] = True
        assert not (listed & full).any()
        assert ((listed | full) | ~any_blk).all(), "a block with allowed pairs is missing"
        assert (~full | all_blk).all(), "a block marked full has masked pairs"


def test_reference_gqa_equals_repeated_heads():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(10, 8, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(13, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(13, 2, 16, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor([0, 4, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 8, 13], dtype=torch.int32)
    out = reference_varlen_attention(q, k, v, cu_q, cu_k)
    rep = reference_varlen_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), cu_q, cu_k)
    torch.testing.assert_close(out, rep, rtol=0, atol=0)  # identical computation
    # first segment (4 queries over 7 keys) by hand: bottom-right causal, query i sees keys j <= i + 3
    kk, vv = k[:7].repeat_interleave(4, 1), v[:7].repeat_interleave(4, 1)
    scores = torch.einsum("qhd,khd->hqk", q[:4], kk) * 16**-0.5
    allowed = torch.arange(7)[None, :] <= torch.arange(4)[:, None] + 3
    manual = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out[:4], manual, rtol=1e-12, atol=1e-12)  # float64, summation order only
    with pytest.raises(ValueError, match="multiple"):
        reference_varlen_attention(q[:, :6], k[:, :1].expand(-1, 4, -1), v[:, :1].expand(-1, 4, -1), cu_q, cu_k)


def test_explicit_import_flags_override_the_probes(monkeypatch):
    r = kernels._varlen_backend_unavailable_reason
    monkeypatch.setitem(vars(kernels), "HAS_FLASH_VARLEN", True)
    monkeypatch.setitem(vars(kernels), "HAS_TE", True)
    assert r("flash", torch.bfloat16, CUDA) is None and r("te", torch.float16, CUDA) is None
    assert r("flash", torch.float32, CUDA).startswith("varlen CP attention needs fp16/bf16")
    assert r("te", torch.bfloat16, CPU).startswith("varlen CP attention requires CUDA")
    monkeypatch.setitem(vars(kernels), "HAS_TE", False)
    assert r("te", torch.bfloat16, CUDA) == "TransformerEngine varlen kernel is unavailable"
    if not torch.cuda.is_available():
        monkeypatch.setitem(vars(kernels), "HAS_FLASH_VARLEN", False)
        assert r("flash", torch.bfloat16, CUDA) == "flash_attn varlen kernel is unavailable"


def test_split_provider_runs_one_forward_and_another_backward(monkeypatch):
    """The split provider's wiring with torch parts: forward from one part (out, lse), backward from the other."""
    from longtrain.blockdiag_cp.providers import split
    from tests.blockdiag._kernels_util import meta_from_lengths

    calls = []

    def forward(q, k, v, meta, *, scale, causal):
        calls.append("fwd")
        out = reference_varlen_attention(q, k, v, meta.cu_q, meta.cu_k, scale=scale, causal=causal)
        return out, torch.zeros(q.shape[1], q.shape[0])

    def backward(dout, q, k, v, out, lse, meta, *, scale, causal, deterministic):
        calls.append(("bwd", lse.shape, deterministic))
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            o = reference_varlen_attention(qq, kk, vv, meta.cu_q, meta.cu_k, scale=scale, causal=causal)
            return torch.autograd.grad(o, (qq, kk, vv), dout)

    monkeypatch.setitem(split.PARTS, "cudnn", (forward, None, None))
    monkeypatch.setitem(split.PARTS, "fa4", (None, backward, None))
    meta = meta_from_lengths([3, 4], [6, 4])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(10, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    out = providers.get("cudnn_fa4").attention(q, k, v, meta, deterministic=True)
    want = reference_varlen_attention(q, k, v, meta.cu_q, meta.cu_k)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the forward part ran the same math
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert calls == ["fwd", ("bwd", (4, 7), True)]
    with pytest.raises(ValueError, match="no attention dropout"):
        providers.get("fa4_cudnn").attention(q, k, v, meta, dropout_p=0.1)
    assert "CUDA" in providers.unavailable_reason("cudnn_fa4", torch.bfloat16, CPU)
