"""The split cuDNN-frontend + FlashMLA DSA path on a real SM90+ GPU.

What runs depends on what is installed (each skip says why):

- cuDNN frontend DSA (``nvidia-cudnn-frontend[cutedsl]``) alone: the indexer top-k
  (:func:`cudnn_indexer_topk`, which uses no FlashMLA kernel), the raw cuDNN sparse-attention backward, and our
  autograd adapter's backward (head padding, row compaction, the dummy row) with a plain-torch stand-in for
  the FlashMLA forward.
- plus FlashMLA (``flash_mla.flash_mla_sparse_fwd``, built from source): the whole split path.
- ``backend="auto"``: the route table's choice (our Triton forward + cuDNN's backward) against float64.

Accuracy: attention values and gradients follow the flash-attention rule (the kernel's max error against the
float64 reference is at most twice that of a same-dtype bf16 torch implementation, plus one bf16 rounding step
at the reference's magnitude); top-k sets are compared by overlap with the float32 torch backend (>= 0.97 mean:
near-ties may fall either way under a different fp32 summation order), after checking the canonical form
exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from longtrain import _optional
from longtrain.dsa import cudnn_dsa as cd
from longtrain.dsa import ops, routes
from longtrain.dsa import reference as ref
from longtrain.dsa.metadata import prepare_dsa_metadata
from tests.gpu._tolerance import assert_flash_rule

_SM90 = _optional.cuda_sm(9, 0)
_CUDNN = _optional.cudnn_dsa()
_FLASH_MLA = _optional.flash_mla()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _SM90[0], reason=_SM90[1] or "needs CUDA SM90+"),
    pytest.mark.skipif(not _CUDNN[0], reason=_CUDNN[1] or "cuDNN frontend DSA unavailable"),
]
needs_flash_mla = pytest.mark.skipif(not _FLASH_MLA[0], reason=_FLASH_MLA[1] or "FlashMLA unavailable")

DEV = "cuda"


@pytest.fixture
def cudnn_only(monkeypatch):
    """Run the indexer/backward pieces without FlashMLA: they never call it, but the seed's availability check
    requires both libraries, so the FlashMLA flag is set for the duration of the test."""
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", True)


def _assert_flash_rule(name, actual, same_dtype, exact):
    assert_flash_rule(name, actual, same_dtype, exact)


def _canonical_and_overlap(out, want, meta, k):
    lengths = meta.causal_lengths.long()
    count = lengths.clamp(max=k)
    slot = torch.arange(k, device=out.device)
    prefix = slot[None, :] < count[:, None]
    assert ((out >= 0) == prefix).all(), "valid prefix length must be exactly min(K, causal_length)"
    starts = meta.starts.long()[:, None]
    assert ((out.long() >= starts) & (out.long() < starts + lengths[:, None]) | ~prefix).all()
    ascending = out[:, 1:] > out[:, :-1]
    assert (ascending | ~prefix[:, 1:]).all(), "prefix must be strictly ascending"
    total = meta.total_key_tokens

    def selected(indices):  # [rows, T_k] membership; column 0 absorbs the -1 slots
        mask = torch.zeros(indices.shape[0], total + 1, dtype=torch.bool, device=indices.device)
        return mask.scatter_(1, indices.long() + 1, True)[:, 1:]

    rows = count > 0
    overlap = (selected(out) & selected(want)).sum(1)[rows].double() / count[rows].double()
    assert overlap.mean().item() >= 0.97, f"mean top-k overlap {overlap.mean().item():.4f}"


@pytest.mark.parametrize(
    "real,padded,window,k",
    [
        ([700, 400, 1], None, None, 256),
        ([700, 400, 1], [768, 512, 64], None, 256),
        ([700, 400, 1], [768, 512, 64], (384, 1024), 128),
        ([3000], [3072], (1536, 3072), 2048),
    ],
    ids=["cp1", "padded", "cp_window", "glm_topk"],
)
@pytest.mark.parametrize("heads", [32, 64])
def test_indexer_topk_against_torch_backend(cudnn_only, real, padded, window, k, heads):
    gen = torch.Generator(device=DEV).manual_seed(heads + k)
    cu = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_p = None
    if padded is not None:
        cu_p = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    total = sum(padded or real)
    query = None if window is None else torch.arange(*window, device=DEV)
    rows = total if window is None else window[1] - window[0]
    q = torch.randn(rows, heads, 128, generator=gen, device=DEV).bfloat16()
    keys = torch.randn(total, 128, generator=gen, device=DEV).bfloat16()
    w = torch.randn(rows, heads, generator=gen, device=DEV) * (heads**-0.5 * 128**-0.5)
    meta = prepare_dsa_metadata(cu, total, query_indices=query, cu_seqlens_padded=cu_p)
    out = cd.cudnn_indexer_topk(q, keys, w, cu, k, query_indices=query, cu_seqlens_padded=cu_p)
    assert out.shape == (rows, 1, k) and out.dtype == torch.int32 and out.is_contiguous()
    reused = cd.cudnn_indexer_topk(q, keys, w, cu, k, packed_metadata=meta)
    assert torch.equal(reused, out)
    # The adapter rounds head weights to bf16; the torch backend gets the same rounded weights.
    want = ops.indexer_topk(q, keys, w.bfloat16().float(), cu, k, packed_metadata=meta, backend="torch")
    _canonical_and_overlap(out[:, 0], want, meta, k)
    via_ops = ops.indexer_topk(q, keys, w, cu, k, packed_metadata=meta, backend="cudnn")
    assert torch.equal(via_ops, out[:, 0])


def _inputs(rows, heads, keys, k, seed, lengths_mode="ragged"):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(rows, heads, 576, generator=gen, device=DEV) / 4).bfloat16()
    kv = (torch.randn(keys, 1, 576, generator=gen, device=DEV) / 4).bfloat16()
    scores = torch.rand(rows, keys, generator=gen, device=DEV)
    idx = scores.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    if lengths_mode == "full":
        lengths = torch.full((rows,), k, dtype=torch.int32, device=DEV)
    else:
        lengths = torch.randint(1, k + 1, (rows,), generator=gen, device=DEV, dtype=torch.int32)
        if lengths_mode == "with_empty":
            lengths[::5] = 0
    slot = torch.arange(k, device=DEV)
    idx = torch.where(slot[None, :] < lengths[:, None], idx, -1).to(torch.int32).contiguous()
    return q, kv, idx, lengths


def _bf16_torch(q, kv, idx, scale, lengths):
    """Same-dtype implementation: bf16 gathered matmuls (fp32 accumulate, bf16 result), fp32 softmax."""
    valid = (idx >= 0) & (torch.arange(idx.shape[1], device=DEV)[None, :] < lengths[:, None])
    keys = kv[:, 0][idx.long().clamp_min(0)]
    logits = torch.einsum("thd,tkd->thk", q, keys).float() * scale
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    top = logits.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(logits - top)
    denom = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("thk,tkd->thd", probs.to(q.dtype), keys[..., :512])


def _grads(fn, q, kv, grad):
    q = q.detach().requires_grad_()
    kv = kv.detach().requires_grad_()
    out = fn(q, kv)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad.to(out.dtype))
    return out.detach(), dq, dkv


def _exact_grads(q, kv, idx, scale, lengths, grad):
    """float64 reference output and gradients (leaves promoted to float64 so the gradients stay exact)."""

    def fn(a, b):
        return ref.sparse_mla_reference(a, b, idx, scale, d_v=512, topk_length=lengths)[0]

    return _grads(fn, q.double(), kv.double(), grad.double())


def test_raw_cudnn_backward_against_float64(cudnn_only):
    rows, heads, keys, k, scale = 96, 64, 1024, 512, 0.0589
    q, kv, idx, lengths = _inputs(rows, heads, keys, k, seed=1, lengths_mode="full")
    grad = (torch.randn(rows, heads, 512, device=DEV) / 4).bfloat16()
    out64, dq64, dkv64 = _exact_grads(q, kv, idx, scale, lengths, grad)
    _, dq_bf, dkv_bf = _grads(lambda a, b: _bf16_torch(a, b, idx, scale, lengths), q, kv, grad)
    lse = ref.sparse_mla_reference(q.float(), kv.float(), idx, scale, d_v=512, topk_length=lengths)[1]
    result = cd._cudnn_dsa().sparse_attention_backward_wrapper(
        q.contiguous(),
        kv[:, 0].contiguous(),
        out64.bfloat16().contiguous(),
        grad.contiguous(),
        lse.float().contiguous(),
        torch.full((heads,), -math.inf, device=DEV),
        idx,
        softmax_scale=scale,
        topk_length=lengths,
    )
    _assert_flash_rule("dq", result["dq"], dq_bf, dq64)
    _assert_flash_rule("dkv", result["dkv"][:, None], dkv_bf, dkv64)


class _TorchForward:
    """Stand-in for flash_mla_sparse_fwd (natural-log KV-only LSE, +inf and zero output on empty rows)."""

    def __init__(self):
        self.heads = []

    def __call__(self, q, kv, indices, sm_scale, *, d_v, attn_sink, topk_length, indexer_topk):
        self.heads.append(q.shape[1])
        out, lse = ref.sparse_mla_reference(
            q.float(), kv.float(), indices, sm_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink
        )
        lse = torch.where(torch.isneginf(lse), math.inf, lse)
        return out.bfloat16(), lse.clone(), lse.float()


@pytest.mark.parametrize(
    "heads,mode", [(64, "full"), (4, "full"), (16, "with_empty"), (128, "with_empty")], ids=lambda v: str(v)
)
@pytest.mark.parametrize("cached_rows", [False, True], ids=["scan_rows", "cached_rows"])
def test_adapter_backward_with_torch_forward(cudnn_only, monkeypatch, heads, mode, cached_rows):
    forward = _TorchForward()
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", forward)
    rows, keys, k, scale = 80, 700, 96, 0.0417
    q, kv, idx, lengths = _inputs(rows, heads, keys, k, seed=heads, lengths_mode=mode)
    nonempty = bool((lengths > 0).all())
    kwargs = dict(topk_length=lengths, all_rows_nonempty=nonempty)
    if cached_rows and not nonempty:
        kwargs["valid_row_indices"] = (lengths > 0).nonzero().flatten()
    grad = (torch.randn(rows, heads, 512, device=DEV) / 4).bfloat16()
    out, dq, dkv = _grads(lambda a, b: cd.cudnn_sparse_attention(a, b, idx[:, None], scale, **kwargs), q, kv, grad)
    _, dq64, dkv64 = _exact_grads(q, kv, idx, scale, lengths, grad)
    _, dq_bf, dkv_bf = _grads(lambda a, b: _bf16_torch(a, b, idx, scale, lengths), q, kv, grad)
    assert forward.heads == [cd._padded_head_count(heads, torch.cuda.get_device_capability()[0])]
    _assert_flash_rule("dq", dq, dq_bf, dq64)
    _assert_flash_rule("dkv", dkv, dkv_bf, dkv64)
    empty = lengths == 0
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()


def test_adapter_backward_dummy_row_when_every_row_is_empty(cudnn_only, monkeypatch):
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", _TorchForward())
    q, kv, idx, _ = _inputs(8, 64, 64, 16, seed=5)
    empty = torch.full_like(idx, -1)
    q.requires_grad_()
    kv.requires_grad_()
    out = cd.cudnn_sparse_attention(q, kv, empty[:, None], 0.1)
    out.backward(torch.ones_like(out))
    assert (out == 0).all() and (q.grad == 0).all() and (kv.grad == 0).all()


@needs_flash_mla
@pytest.mark.parametrize("heads,mode", [(64, "full"), (16, "with_empty"), (128, "ragged")], ids=lambda v: str(v))
def test_split_path_against_float64(heads, mode):
    rows, keys, k, scale = 256, 2048, 512, 0.0589
    q, kv, idx, lengths = _inputs(rows, heads, keys, k, seed=7, lengths_mode=mode)
    grad = (torch.randn(rows, heads, 512, device=DEV) / 4).bfloat16()
    out, dq, dkv = _grads(lambda a, b: cd.cudnn_sparse_attention(a, b, idx[:, None], scale), q, kv, grad)
    out64, dq64, dkv64 = _exact_grads(q, kv, idx, scale, lengths, grad)
    out_bf, dq_bf, dkv_bf = _grads(lambda a, b: _bf16_torch(a, b, idx, scale, lengths), q, kv, grad)
    _assert_flash_rule("out", out, out_bf, out64)
    _assert_flash_rule("dq", dq, dq_bf, dq64)
    _assert_flash_rule("dkv", dkv, dkv_bf, dkv64)
    via_ops = ops.sparse_mla_attention(q, kv, idx, scale, topk_length=lengths, backend="cudnn")
    assert torch.equal(via_ops, out)


@pytest.mark.skipif(_FLASH_MLA[0], reason="FlashMLA is installed: backend='cudnn' runs the split path instead")
@pytest.mark.parametrize("heads,mode", [(64, "full"), (16, "with_empty"), (128, "ragged")], ids=lambda v: str(v))
def test_cudnn_backend_with_our_triton_forward_against_float64(heads, mode):
    """Without FlashMLA, ``sparse_mla_attention(backend="cudnn")`` = our Triton forward + cuDNN's backward."""
    rows, keys, k, scale = 256, 2048, 512, 0.0589
    q, kv, idx, lengths = _inputs(rows, heads, keys, k, seed=heads + 7, lengths_mode=mode)
    grad = (torch.randn(rows, heads, 512, device=DEV) / 4).bfloat16()
    out, dq, dkv = _grads(lambda a, b: ops.sparse_mla_attention(a, b, idx, scale, backend="cudnn"), q, kv, grad)
    out64, dq64, dkv64 = _exact_grads(q, kv, idx, scale, lengths, grad)
    out_bf, dq_bf, dkv_bf = _grads(lambda a, b: _bf16_torch(a, b, idx, scale, lengths), q, kv, grad)
    _assert_flash_rule("out", out, out_bf, out64)
    _assert_flash_rule("dq", dq, dq_bf, dq64)
    _assert_flash_rule("dkv", dkv, dkv_bf, dkv64)
    empty = lengths == 0
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()


@pytest.mark.parametrize("heads,mode", [(64, "full"), (16, "with_empty"), (128, "ragged")], ids=lambda v: str(v))
def test_auto_runs_the_route_table_choice_against_float64(heads, mode):
    """``backend="auto"`` with the cuDNN frontend installed runs ROUTE_TABLE's fastest pair: our Triton forward and
    cuDNN's backward (FlashMLA's forward only where Triton cannot run), exact by the flash-attention rule."""
    rows, keys, k, scale = 256, 2048, 512, 0.0589
    q, kv, idx, lengths = _inputs(rows, heads, keys, k, seed=heads + 11, lengths_mode=mode)
    plan = routes.auto_plan(routes.CallShape("sparse_mla", q.device, q.dtype, heads, 576, k, 512))
    forward = "triton" if routes.triton_reason(q.device) is None else "flash_mla"
    assert (plan.fwd, plan.bwd) == (forward, "cudnn"), plan
    grad = (torch.randn(rows, heads, 512, device=DEV) / 4).bfloat16()
    out, dq, dkv = _grads(lambda a, b: ops.sparse_mla_attention(a, b, idx, scale, topk_length=lengths), q, kv, grad)
    out64, dq64, dkv64 = _exact_grads(q, kv, idx, scale, lengths, grad)
    out_bf, dq_bf, dkv_bf = _grads(lambda a, b: _bf16_torch(a, b, idx, scale, lengths), q, kv, grad)
    _assert_flash_rule("out", out, out_bf, out64)
    _assert_flash_rule("dq", dq, dq_bf, dq64)
    _assert_flash_rule("dkv", dkv, dkv_bf, dkv64)
    empty = lengths == 0
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    if forward == "triton" and not _FLASH_MLA[0]:
        # backend="cudnn" runs the same forward kernel here: the outputs are the same bits.
        assert torch.equal(out, ops.sparse_mla_attention(q, kv, idx, scale, topk_length=lengths, backend="cudnn"))
