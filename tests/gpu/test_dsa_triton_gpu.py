"""Triton DSA kernels on CUDA in bf16 at GLM-5.2 shapes, by the flash-attention tolerance rule.

Rule: the kernel's max error against the float64 reference is at most twice the max error of a same-dtype
(bf16) torch implementation plus one bf16 rounding step at the reference's magnitude.
"""

from __future__ import annotations

import pytest
import torch

from longtrain.dsa.reference import indexer_topk_reference, sparse_mla_reference
from longtrain.dsa.triton import IndexerConfig
from tests.gpu._tolerance import assert_flash_rule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _configs(fwd=None, ds=None, dq=None):
    """Forced configs: the portable forward (pipelined, 3 stages) or ``fwd = (impl, block_k, num_stages)``; the
    portable backward kernels at 32 slots, 8 warps, 1 stage, except the probabilities kernel with ``ds="stacked"``
    (the portable kernel's stacked layout: logits and dO V^T in one matmul) or ``ds="sm90"`` (the SM90 stacked
    kernel, at the forward's block_k) or ``ds="fused"`` (the SM90 kernel that also computes dkv: no dkv kernel) or
    ``ds="ws"`` (its warp-specialized twin);
    with an SM90 forward the dkv kernel runs over two value-column groups; ``dq = (block_k, num_buf)`` forces the SM90
    dq kernel (``(block_k, num_buf, 128)``: its 128-heads-per-program layout); ``impl="sm90ws"`` is the
    warp-specialized SM90 forward, ``impl="sm90pp"`` the ping-pong one."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    impl, block_k, stages = fwd or ("triton", 32, 3)
    fwd_cfg = (
        None
        if impl in ("sm90ws", "sm90pp")
        else KernelConfig(impl=impl, block_k=block_k, num_warps=8, num_stages=stages)
    )
    if impl == "sm90ws":
        impl = "sm90"
        fwd_cfg = KernelConfig(impl="sm90", layout="warp_specialized", block_k=block_k, num_warps=4, num_stages=stages)
    if impl == "sm90pp":
        impl = "sm90"
        fwd_cfg = KernelConfig(impl="sm90", layout="ping_pong", block_k=64, num_warps=4, num_stages=2)
    portable = KernelConfig(block_k=32, num_warps=8, num_stages=1)
    probabilities = {
        None: portable,
        "stacked": KernelConfig(block_k=32, num_warps=8, num_stages=1, layout="stacked"),
        "sm90": KernelConfig(impl="sm90", block_k=block_k, num_stages=2 if block_k == 64 else 3),
        "fused": KernelConfig(impl="sm90", layout="fused", block_k=64, num_stages=1),
        "ws": KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1),
    }[ds]
    dkv = KernelConfig(block_k=32, num_warps=8, num_stages=1, col_groups=2 if impl == "sm90" else 1)
    dq_h = dq[2] if dq is not None and len(dq) > 2 else 64
    return SparseMLAConfig(
        fwd=fwd_cfg,
        bwd=probabilities,
        bwd_dq=portable if dq is None else KernelConfig(impl="sm90", block_k=dq[0], num_stages=dq[1], block_h=dq_h),
        bwd_dkv=None if ds in ("fused", "ws") else dkv,
    )


def _index_sets(T, T_k, K, gen, dev, ragged=True):
    scores = torch.rand((T, T_k), generator=gen, device=dev)
    idx = scores.topk(K, dim=1).indices.sort(dim=1).values.to(torch.int32)
    length = torch.full((T,), K, dtype=torch.int32, device=dev)
    if ragged:
        length = torch.randint(0, K + 1, (T,), generator=gen, device=dev, dtype=torch.int32)
        length[:4] = torch.tensor([0, 1, K, 63], dtype=torch.int32)
        slot = torch.arange(K, device=dev)
        idx = torch.where(slot[None, :] < length[:, None], idx, -1).to(torch.int32)
    return idx, length


def _bwd_case(T, T_k, H, K, seed, bad_row=None):
    """bf16 GLM-5.2 widths (D_qk 576, d_v 512), ragged index sets: ``(q, kv, idx, length, dout)``; ``bad_row`` gets
    invalid and repeated indices in its first seven slots."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn((T, H, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    kv = torch.randn((T_k, 1, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    idx, length = _index_sets(T, T_k, K, gen, dev)
    if bad_row is not None:
        idx[bad_row, :7] = torch.tensor([-1, T_k, 2**30, 3, 3, 3, -5], dtype=torch.int32, device=dev)
    dout = torch.randn((T, H, 512), generator=gen, device=dev).to(torch.bfloat16)
    return q, kv, idx, length, dout


def _torch_bf16(q, kv, idx, scale, d_v, length, sink):
    """Same-dtype implementation: bf16 gathered matmuls (fp32 accumulation, bf16 results), fp32 softmax."""
    T_k = kv.shape[0]
    valid = (idx >= 0) & (idx < T_k)
    if length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < length[:, None]
    keys = kv[:, 0][idx.long().clamp(0, T_k - 1)]
    logits = torch.einsum("thd,tkd->thk", q, keys).float() * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    top = logits.amax(-1, keepdim=True).detach()
    if sink is not None:
        top = torch.maximum(top, sink.detach()[None, :, None])
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(logits - top)
    denom = weights.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink[None, :, None] - top)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("thk,tkd->thd", probs.to(q.dtype), keys[..., :d_v])


def _max_err(x, ref):
    return (x.double() - ref).abs().max().item()


def _check_rule(name, got, same_dtype, ref):
    assert_flash_rule(name, got, same_dtype, ref)


_SM90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an SM90 GPU"
)


@pytest.mark.parametrize(
    "T,T_k,H,D,d_v,K,with_sink,forced,dtype",
    [
        (192, 4096, 64, 576, 512, 2048, False, False, torch.bfloat16),  # GLM-5.2, autotuned path (SM90 kernel)
        (128, 3000, 64, 576, 512, 2048, True, False, torch.bfloat16),  # with a sink
        (96, 2048, 128, 576, 512, 512, False, True, torch.bfloat16),  # DeepSeek-V3.2 head count
        (96, 1024, 16, 512, 512, 512, True, True, torch.bfloat16),  # K = V (DSv4-style), few heads
        (96, 1024, 32, 512, 512, 256, False, True, torch.bfloat16),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90", 32, 4), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1024, False, ("sm90", 32, 3), torch.bfloat16, marks=_SM90),
        pytest.param(96, 1024, 64, 512, 512, 512, True, ("sm90", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 64, 576, 512, 1024, True, ("sm90", 64, 2), torch.float16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, False, ("sm90", 64, 2), torch.bfloat16, marks=_SM90),
        (96, 2048, 128, 576, 512, 512, True, ("triton", 32, 3, "stacked"), torch.bfloat16),
        (96, 1024, 16, 512, 512, 512, False, ("triton", 32, 3, "stacked"), torch.bfloat16),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90", 64, 2, "sm90"), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1024, False, ("sm90", 32, 3, "sm90"), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, False, ("sm90", 64, 2, "sm90"), torch.float16, marks=_SM90),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90", 64, 2, "fused"), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1024, False, ("sm90", 32, 3, "fused"), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, False, ("sm90", 64, 2, "fused"), torch.float16, marks=_SM90),
        pytest.param(96, 1024, 64, 512, 512, 512, True, ("sm90", 64, 2, "fused"), torch.bfloat16, marks=_SM90),
        pytest.param(
            160, 4096, 64, 576, 512, 2048, True, ("sm90", 64, 2, "fused", (32, 4)), torch.bfloat16, marks=_SM90
        ),
        pytest.param(
            96, 2048, 128, 576, 512, 1024, False, ("sm90", 64, 2, "sm90", (64, 2)), torch.float16, marks=_SM90
        ),
        pytest.param(96, 1024, 96, 512, 512, 300, True, ("sm90", 64, 2, "fused", (32, 3)), torch.bfloat16, marks=_SM90),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90ws", 64, 2, "fused"), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1024, False, ("sm90ws", 32, 4), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, True, ("sm90ws", 64, 2), torch.float16, marks=_SM90),
        pytest.param(96, 1024, 64, 512, 512, 512, True, ("sm90ws", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 64, 320, 256, 200, False, ("sm90ws", 32, 3), torch.bfloat16, marks=_SM90),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90", 64, 2, "ws"), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1024, False, ("sm90", 32, 3, "ws", (64, 2)), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, False, ("sm90", 64, 2, "ws"), torch.float16, marks=_SM90),
        pytest.param(96, 1024, 64, 512, 512, 512, True, ("sm90", 64, 2, "ws"), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 64, 320, 256, 200, False, ("sm90ws", 32, 3, "ws"), torch.bfloat16, marks=_SM90),
        (96, 2048, 128, 576, 512, 512, True, False, torch.bfloat16),  # 128 heads, the defaults (wide dq on SM90)
        pytest.param(
            96, 2048, 128, 576, 512, 1024, True, ("sm90", 64, 2, "ws", (64, 4, 128)), torch.bfloat16, marks=_SM90
        ),
        pytest.param(
            96, 1024, 128, 512, 512, 512, False, ("sm90", 64, 2, "ws", (64, 3, 128)), torch.float16, marks=_SM90
        ),
        pytest.param(
            64, 1024, 256, 576, 512, 300, False, ("sm90", 64, 2, "fused", (32, 2, 128)), torch.bfloat16, marks=_SM90
        ),
        pytest.param(
            64, 1024, 128, 320, 256, 200, True, ("sm90ws", 32, 3, "ws", (64, 2, 128)), torch.bfloat16, marks=_SM90
        ),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90pp", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(96, 2048, 128, 576, 512, 1000, False, ("sm90pp", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 96, 576, 512, 300, True, ("sm90pp", 64, 2), torch.float16, marks=_SM90),
        pytest.param(96, 1024, 64, 512, 512, 512, True, ("sm90pp", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 64, 320, 256, 200, False, ("sm90pp", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(64, 1024, 64, 544, 512, 300, False, ("sm90pp", 64, 2), torch.bfloat16, marks=_SM90),
        pytest.param(160, 4096, 64, 576, 512, 2048, True, ("sm90pp", 64, 2, "ws"), torch.bfloat16, marks=_SM90),
    ],
    ids=[
        "glm",
        "glm-sink",
        "H128",
        "H16-D512",
        "H32-D512",
        "sm90-32x4-sink",
        "sm90-H128-32x3",
        "sm90-D512",
        "sm90-fp16",
        "sm90-H96-K300",
        "stacked-H128-sink",
        "stacked-H16-D512",
        "sm90-ds-sink",
        "sm90-ds-H128-32x3",
        "sm90-ds-H96-fp16",
        "fused-sink",
        "fused-H128",
        "fused-H96-fp16",
        "fused-D512",
        "sm90-dq-32x4-sink",
        "sm90-dq-H128-fp16",
        "sm90-dq-H96-D512",
        "sm90ws-sink-fused",
        "sm90ws-H128-32x4",
        "sm90ws-H96-fp16",
        "sm90ws-D512-sink",
        "sm90ws-dv256-32x3",
        "bwd_ws-sink",
        "bwd_ws-H128-dq64x2",
        "bwd_ws-H96-fp16",
        "bwd_ws-D512-sink",
        "bwd_ws-dv256",
        "H128-defaults-sink",
        "dq128-64x4-sink",
        "dq128-D512-fp16",
        "dq128-H256-32x2",
        "dq128-dv256-sink",
        "sm90pp-sink",
        "sm90pp-H128-K1000",
        "sm90pp-H96-fp16",
        "sm90pp-D512-sink",
        "sm90pp-dv256",
        "sm90pp-D544-K300",
        "sm90pp-bwd_ws-sink",
    ],  # fmt: skip
)
def test_sparse_mla_bf16(T, T_k, H, D, d_v, K, with_sink, forced, dtype):
    from longtrain.dsa.triton import sparse_mla_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T + H)
    q = torch.randn((T, H, D), generator=gen, device=dev).to(dtype).requires_grad_(True)
    kv = torch.randn((T_k, 1, D), generator=gen, device=dev).to(dtype).requires_grad_(True)
    idx, length = _index_sets(T, T_k, K, gen, dev)
    idx[5, :7] = torch.tensor([-1, T_k, 2**30, 3, 3, 3, -5], dtype=torch.int32, device=dev)  # invalid + duplicates
    sink = torch.randn(H, generator=gen, device=dev).requires_grad_(True) if with_sink else None
    scale = 192**-0.5
    if forced is False or forced is True:
        config = None if forced is False else _configs()
    else:
        config = _configs(forced[:3], forced[3] if len(forced) > 3 else None, forced[4] if len(forced) > 4 else None)
    out = sparse_mla_triton(q, kv, idx, scale, d_v=d_v, topk_length=length, attn_sink=sink, config=config)
    dout = torch.randn(out.shape, generator=gen, device=dev).to(dtype)
    inputs = [q, kv] + ([sink] if with_sink else [])
    grads = torch.autograd.grad(out, inputs, dout)

    same = _torch_bf16(q, kv, idx, scale, d_v, length, sink)
    same_grads = torch.autograd.grad(same, inputs, dout)
    leaves64 = [t.detach().double().requires_grad_(True) for t in inputs]
    ref, _ = sparse_mla_reference(leaves64[0], leaves64[1], idx, scale, d_v=d_v, topk_length=length,
                                  attn_sink=leaves64[2] if with_sink else None)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves64, dout.double())

    _check_rule("out", out, same, ref)
    for name, g, s, r in zip(("dq", "dkv", "dsink"), grads, same_grads, ref_grads):
        _check_rule(name, g, s, r)
    empty = length == 0
    assert empty.any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(grads[0][empty], torch.zeros_like(grads[0][empty]))


def _ws_forward_case(T, H, K, with_sink, seed):
    """bf16 GLM-5.2 widths, ``max(2K, 64)`` keys, ragged index sets with one row of invalid, out-of-range and repeated
    slots, an optional sink: ``(q [T, H, 576], kv2d [T_k, 576], idx, length, sink)``."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    T_k = max(2 * K, 64)
    q = torch.randn((T, H, 576), generator=gen, device=dev).to(torch.bfloat16)
    kv2d = torch.randn((T_k, 576), generator=gen, device=dev).to(torch.bfloat16)
    idx, length = _index_sets(T, T_k, K, gen, dev)
    idx[min(3, T - 1), :7] = torch.tensor([-1, T_k, 2**30, 3, 3, 3, -5], dtype=torch.int32, device=dev)
    sink = torch.randn(H, generator=gen, device=dev) if with_sink else None
    return q, kv2d, idx, length, sink


@_SM90
@pytest.mark.parametrize(
    "T,H,K,deterministic,overlap,chunks,reduce",
    [(600, 64, 2048, False, "high", 4, False), (600, 64, 700, True, "high", 8, False),
     (600, 64, 700, True, "high", 8, True), (300, 128, 520, False, "same", 3, False),
     (300, 128, 520, True, "high", 5, True), (5, 64, 64, False, "high", 4, False),
     (600, 64, 2048, False, "partition", 4, False), (600, 64, 700, True, "partition", 8, False),
     (300, 128, 520, True, "partition", 5, False)],
    ids=["64", "64-det", "64-det-reduce", "H128-same", "H128-det-reduce", "fewer-rows-than-chunks", "64-partition",
         "64-det-partition", "H128-det-partition"],
)  # fmt: skip
def test_backward_dq_overlap_equals_one_stream(monkeypatch, T, H, K, deterministic, overlap, chunks, reduce):
    """Each row chunk's dq kernel on a second stream beside the next chunk's probabilities + dkv kernel
    (``DQ_OVERLAP``, two dS buffers taking turns; with ``DET_REDUCE_OVERLAP`` the deterministic reduction after it
    there, two piece buffers; with ``"partition"`` the probabilities + dkv kernel on a stream of its own as one
    program per SM on all SMs but ``DQ_PARTITION_SMS``, dq and the reductions on the caller's stream) gives dq equal
    bit for bit to one stream, and dkv equal up to its atomics' order (bit
    for bit in deterministic mode), over rows without slots, ragged lengths and invalid and repeated indices; the
    result is ready on the caller's stream (read there at once), and more chunks than the two buffers are exercised
    (a buffer is written again only after the second stream's work of its earlier chunk has read it). A bad mode is
    a ValueError."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(T, 2048, H, K, T + H + K + 47, bad_row=min(3, T - 1))
    # Chunks of a few SM waves' rows at most, so that several chunks run even at these sizes.
    monkeypatch.setattr(smb, "PDS_SCRATCH_BYTES", 4 * H * K * 2)
    grads = []
    for mode in (None, overlap):
        monkeypatch.setattr(smb, "DQ_OVERLAP", mode)
        monkeypatch.setattr(smb, "DQ_OVERLAP_MIN_CHUNKS", chunks)
        monkeypatch.setattr(smb, "DET_REDUCE_OVERLAP", reduce and mode is not None)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, deterministic=deterministic)
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        grads.append((dq.clone(), dkv.clone()))  # copied on the caller's stream, at once
    assert torch.isfinite(grads[1][0]).all() and torch.isfinite(grads[1][1]).all()
    assert torch.equal(grads[0][0], grads[1][0])
    if deterministic:
        assert torch.equal(grads[0][1], grads[1][1])
    else:  # fp32 atomics in another order, then one bf16 rounding: at most one bf16 step apart
        torch.testing.assert_close(grads[1][1].float(), grads[0][1].float(), rtol=2**-7, atol=2**-7)
    monkeypatch.setattr(smb, "DQ_OVERLAP", "fast")
    with pytest.raises(ValueError, match="DQ_OVERLAP"):
        sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length).sum().backward()


@pytest.mark.parametrize(
    "T,T_k,H,K,forced,overlap",
    [pytest.param(192, 4096, 64, 2048, False, None, marks=_SM90), pytest.param(300, 2048, 64, 700, False, "high",
     marks=_SM90), pytest.param(160, 2048, 128, 512, "fused", None, marks=_SM90), (96, 2048, 128, 512, True, None)],
    ids=["glm-ws", "ws-reduce-overlap", "H128-fused", "H128-triton"],
)  # fmt: skip
def test_sparse_mla_deterministic_two_byte_pieces(monkeypatch, T, T_k, H, K, forced, overlap):
    """``DET_PIECES = "bf16"`` and ``"fp16"``: the deterministic mode's per-slot dkv pieces stored in bf16, or as fp16
    rows scaled by powers of two, and summed in fp32 in the same fixed order. dkv passes the flash-attention rule
    against float64, two runs are equal bit for bit, dq equals the fp32 pieces' dq bit for bit (the pieces do not
    feed it), the scaled fp16 pieces' dkv is closer to the fp32 pieces' than the bf16 pieces' is and follows the
    gradient's magnitude bit for bit, over ragged lengths and invalid and repeated indices; on SM90 through the
    warp-specialized kernel (with the reduction on the second stream, ``DET_REDUCE_OVERLAP``) and the two-warpgroup
    fused kernel, elsewhere the portable
    dkv kernel with two head blocks. The default (``None``) gives these bf16 keys the bf16 pieces' gradients bit for
    bit. A bad mode is a ValueError."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(T, T_k, H, K, T + H + K + 53, bad_row=5)
    scale = 192**-0.5
    config = _configs(ds="fused") if forced == "fused" else _configs() if forced else None
    if overlap is not None:  # several row chunks, the reduction after each chunk's dq on the second stream
        monkeypatch.setattr(smb, "PDS_SCRATCH_BYTES", 4 * H * K * 2)
        monkeypatch.setattr(smb, "DQ_OVERLAP", overlap)
        monkeypatch.setattr(smb, "DET_REDUCE_OVERLAP", True)
    runs = {}
    for pieces in ("fp32", "bf16", "bf16", "fp16", "fp16", None):
        monkeypatch.setattr(smb, "DET_PIECES", pieces)
        out = sparse_mla_triton(q, kv, idx, scale, d_v=512, topk_length=length, deterministic=True, config=config)
        runs.setdefault(pieces, []).append(torch.autograd.grad(out, (q, kv), dout))
    dq32, dkv32 = runs["fp32"][0]
    same = _torch_bf16(q, kv, idx, scale, 512, length, None)
    same_dkv = torch.autograd.grad(same, (kv,), dout)[0]
    leaves64 = [q.detach().double().requires_grad_(True), kv.detach().double().requires_grad_(True)]
    ref, _ = sparse_mla_reference(leaves64[0], leaves64[1], idx, scale, d_v=512, topk_length=length)
    ref_dkv = torch.autograd.grad(ref, leaves64, dout.double())[1]
    _check_rule("dkv (fp32 pieces)", dkv32, same_dkv, ref_dkv)
    for pieces in ("bf16", "fp16"):
        (dq, dkv), (dq_b, dkv_b) = runs[pieces]
        assert torch.equal(dkv, dkv_b) and torch.equal(dq, dq_b), pieces
        assert torch.equal(dq, dq32), pieces
        _check_rule(f"dkv ({pieces} pieces)", dkv, same_dkv, ref_dkv)
    # The default (None) stores bf16 pieces for these bf16 keys: the bf16 pieces' gradients bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(runs[None][0], runs["bf16"][0]))
    off = {p: (runs[p][0][1].float() - dkv32.float()).abs().sum().item() for p in ("bf16", "fp16")}
    assert off["fp16"] < off["bf16"] / 2, off
    # The fp16 pieces' scales follow the gradient's magnitude: dout times 2**-40 gives dkv times 2**-40, bit for bit.
    monkeypatch.setattr(smb, "DET_PIECES", "fp16")
    out = sparse_mla_triton(q, kv, idx, scale, d_v=512, topk_length=length, deterministic=True, config=config)
    tiny = torch.autograd.grad(out, (kv,), dout * 2.0**-40)[0]
    assert torch.equal(tiny, runs["fp16"][0][1] * 2.0**-40)
    monkeypatch.setattr(smb, "DET_PIECES", "fp8")
    with pytest.raises(
        ValueError,
        match=r"DET_PIECES must be None \(bf16 pieces for bf16 inputs, else fp32\) or one of "
        r"\('fp32', 'bf16', 'fp16'\), got 'fp8'",
    ):
        out = sparse_mla_triton(q, kv, idx, scale, d_v=512, topk_length=length, deterministic=True, config=config)
        out.sum().backward()


@_SM90
@pytest.mark.parametrize(
    "T,H,K,ring,with_sink",
    [(1000, 64, 2048, (64, 2), True), (600, 128, 1000, (64, 2), False), (700, 96, 300, (32, 4), True),
     (500, 64, 520, (32, 3), False), (5, 128, 64, (64, 2), True)],
    ids=["64x2-sink", "H128-K1000", "H96-32x4-sink", "32x3", "fewer-items-than-SMs"],
)  # fmt: skip
def test_ws_forward_schedules_equal_one_program_per_item(monkeypatch, T, H, K, ring, with_sink):
    """The warp-specialized forward run persistent (``WS_SCHEDULE = "persistent"``: one program per SM, each taking
    every G-th item and carrying its ring, handovers and query buffer from item to item), dynamic (one program per
    SM, each taking its next item from the launch's counter), or in runs of ``WS_RUN`` consecutive items per program
    (3: the last run shorter; 4), with and without the queries' L2 prefetch, gives out and lse equal bit for bit to
    one program per item (the same arithmetic per item), over rows without slots, ragged lengths, invalid and
    repeated indices, and more items than SMs."""
    from longtrain.dsa.triton import KernelConfig
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    dev = torch.device("cuda")
    q, kv2d, idx, length, sink = _ws_forward_case(T, H, K, with_sink, T + H + K)
    config = KernelConfig(impl="sm90", layout="warp_specialized", block_k=ring[0], num_warps=4, num_stages=ring[1])
    items = T * -(-H // 64)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    runs = {}
    for schedule, run, prefetch_q in (("runs", 1, False), ("persistent", 1, False), ("persistent", 1, True),
                                      ("runs", 3, False), ("runs", 3, True), ("runs", 4, False),
                                      ("dynamic", 1, False), ("dynamic", 1, True)):  # fmt: skip
        monkeypatch.setattr(ws, "WS_SCHEDULE", schedule)
        monkeypatch.setattr(ws, "WS_RUN", run)
        monkeypatch.setattr(ws, "WS_PREFETCH_Q", prefetch_q)
        programs, kernel_run = ws.ws_schedule(items, dev)
        assert programs == (min(items, sms) if schedule != "runs" else -(-items // run))
        assert kernel_run == {"runs": run, "persistent": 0, "dynamic": -1}[schedule]
        runs[schedule, run, prefetch_q] = sparse_mla_fwd(q, kv2d, idx, 192**-0.5, 512, length, sink, config)
    out, lse = runs["runs", 1, False]
    for key, (o, l) in runs.items():  # every schedule, and the queries' L2 prefetch, change no result
        assert torch.equal(out, o), key
        assert torch.equal(lse, l), key
    assert (length == 0).any()
    ref, ref_lse = sparse_mla_reference(q.double(), kv2d[:, None].double(), idx, 192**-0.5, d_v=512,
                                        topk_length=length, attn_sink=sink.double() if with_sink else None)  # fmt: skip
    _check_rule("out", out, _torch_bf16(q, kv2d[:, None], idx, 192**-0.5, 512, length, sink), ref)
    # lse: fp32 sums of exactly representable bf16 products against float64.
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@_SM90
@pytest.mark.parametrize(
    "H,K,dq",
    [(64, 512, (64, 2)), (128, 1000, (64, 2)), (128, 1000, (64, 3, 128)), (64, 1024, (32, 4))],
    ids=["64x2", "H128-K1000", "128heads-64x3", "32x4"],
)
def test_sm90_dq_ds_ring_equals_ds_in_registers(monkeypatch, H, K, dq):
    """The SM90 dq kernel with dS staged through its cp.async ring (``SM90_DQ_DS_SMEM``, K a multiple of 8; K = 1000
    ends in a partial tile) gives dq equal bit for bit to dS loaded into registers (the same wgmma operands), and
    dkv is untouched; both pass the flash-attention rule in ``test_sparse_mla_bf16``."""
    from longtrain.dsa.triton import sparse_mla_bwd_plan as bwd_plan
    from longtrain.dsa.triton import sparse_mla_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(H + K)
    q = torch.randn((96, H, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    kv = torch.randn((2048, 1, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    idx, length = _index_sets(96, 2048, K, gen, dev)
    dout = torch.randn((96, H, 512), generator=gen, device=dev).to(torch.bfloat16)
    config = _configs(("sm90", 64, 2), "ws", dq)
    grads = []
    for ring in (False, True):
        monkeypatch.setattr(bwd_plan, "SM90_DQ_DS_SMEM", ring)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, config=config)
        grads.append(torch.autograd.grad(out, (q, kv), dout))
    assert torch.isfinite(grads[1][0]).all()
    assert torch.equal(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1].float(), grads[1][1].float(), rtol=2**-7, atol=2**-7)  # atomics' order


@_SM90
@pytest.mark.parametrize("H,K", [(64, 512), (128, 1000), (96, 300)], ids=["64", "H128-K1000", "H96-K300"])
def test_sm90_dq_deeper_rings_equal_64x2(H, K):
    """The SM90 dq kernel with a deeper ring of gathered tiles gives dq equal bit for bit to the shallower ring of the
    same tile (64 x 3, 224 KiB with dS in registers, against 64 x 2; 32 x 6 against 32 x 4, which the parity tests
    check against float64): the same wgmmas, their tiles fetched earlier; dkv is untouched."""
    from longtrain.dsa.triton import sparse_mla_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(H + K + 13)
    q = torch.randn((96, H, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    kv = torch.randn((2048, 1, 576), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    idx, length = _index_sets(96, 2048, K, gen, dev)
    dout = torch.randn((96, H, 512), generator=gen, device=dev).to(torch.bfloat16)
    grads = {}
    for ring in ((64, 2), (64, 3), (32, 4), (32, 6)):
        config = _configs(("sm90", 64, 2), "ws", ring)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, config=config)
        grads[ring] = torch.autograd.grad(out, (q, kv), dout)
    for deep, shallow in (((64, 3), (64, 2)), ((32, 6), (32, 4))):
        assert torch.isfinite(grads[deep][0]).all()
        assert torch.equal(grads[deep][0], grads[shallow][0])
        torch.testing.assert_close(grads[deep][1].float(), grads[shallow][1].float(), rtol=2**-7, atol=2**-7)


@_SM90
@pytest.mark.parametrize(
    "T,H,K,ring",
    [(96, 64, 512, None), (70, 96, 300, None), (5, 64, 64, None), (96, 128, 1000, (64, 2, 128)),
     (40, 64, 256, (32, 4))],
    ids=["64", "H96-K300", "T5", "128-heads-per-program", "32x4"],
)  # fmt: skip
def test_sm90_dq_staged_store_equals_direct(monkeypatch, T, H, K, ring):
    """dq stored through the ring (``SM90_DQ_STAGED_STORE``) equals dq stored straight from the accumulator, bit for
    bit (the same values, another path), at the defaults and forced rings: heads past H masked, a row without slots
    stored as zeros, every element written (the output starts as NaN)."""
    from longtrain.dsa.triton import sparse_mla_bwd_plan as bwd_plan
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(T, 2048, H, K, T + H + K + 23)
    config = None if ring is None else _configs(("sm90", 64, 2), "ws", ring)
    grads = []
    for staged in (False, True):
        monkeypatch.setattr(bwd_plan, "SM90_DQ_STAGED_STORE", staged)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, config=config)
        grads.append(torch.autograd.grad(out, (q, kv), dout))
    assert torch.isfinite(grads[1][0]).all()
    assert torch.equal(grads[1][0][0], torch.zeros_like(grads[1][0][0]))  # row 0 has no slots
    assert torch.equal(grads[0][0], grads[1][0])


@_SM90
@pytest.mark.parametrize(
    "T,H,K,deterministic", [(96, 64, 512, False), (70, 96, 300, True), (5, 128, 64, False)], ids=["64", "H96-det", "T5"]
)
def test_ws_backward_staged_ds_equals_direct(monkeypatch, T, H, K, deterministic):
    """dS stored from the handed-over ``[dS; P]`` tile (``WS_BWD_STAGED_DS``) equals dS stored straight from the
    accumulator: dq equal bit for bit (the dq kernel reads it), dkv equal up to its atomics' order (bit for bit in
    deterministic mode), over ragged rows, a head count that is not a multiple of 64 and a partial last tile."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(T, 2048, H, K, T + H + K + 29)
    grads = []
    for staged in (False, True):
        monkeypatch.setattr(ws, "WS_BWD_STAGED_DS", staged)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, deterministic=deterministic)
        grads.append(torch.autograd.grad(out, (q, kv), dout))
    assert torch.isfinite(grads[1][0]).all() and torch.isfinite(grads[1][1]).all()
    assert torch.equal(grads[0][0], grads[1][0])
    if deterministic:
        assert torch.equal(grads[0][1], grads[1][1])
    else:
        torch.testing.assert_close(grads[0][1].float(), grads[1][1].float(), rtol=2**-7, atol=2**-7)


@_SM90
@pytest.mark.parametrize(
    "T,H,K,deterministic",
    [(300, 64, 2048, False), (200, 128, 520, True), (150, 96, 300, False), (5, 128, 64, True), (250, 64, 700, True)],
    ids=["64", "H128-det", "H96", "fewer-items-than-SMs-det", "64-det"],
)  # fmt: skip
def test_ws_backward_item_runs_equal_one_program_per_item(monkeypatch, T, H, K, deterministic):
    """The warp-specialized backward over runs of ``WS_BWD_RUN`` items per program (3: the last run shorter; 4; the
    default, 2 at up to 64 heads and 1 in deterministic mode, checked on the launches) or one program per SM (0), the
    next item's first tile, delta and ``[Q_v; dO]`` loading under the current item's last tile, gives dq equal bit for
    bit to one program per item (the same arithmetic per item) and dkv equal up to its atomics' order (bit for bit in
    deterministic mode), over rows without slots, ragged lengths, invalid and repeated indices, head counts that are
    not a multiple of 64, and fewer items than SMs."""
    from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(T, 2048, H, K, T + H + K + 31, bad_row=min(3, T - 1))
    dev = q.device
    items = T * -(-H // 64)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grads = {}
    schedule, used = ws.ws_bwd_schedule, []  # the runs the backward's launches take
    monkeypatch.setattr(ws, "ws_bwd_schedule", lambda *a, **kw: used.append(schedule(*a, **kw)) or used[-1])
    for run in (1, 3, 4, 0, None):
        monkeypatch.setattr(ws, "WS_BWD_RUN", run)
        eff = (2 if H <= 64 else ws._multi_block_run(dev)) if run is None else run  # None: the measured default
        assert schedule(items, -(-H // 64), dev) == ((min(items, sms), 0) if eff == 0 else
                                                     (-(-items // eff), eff))  # fmt: skip
        used.clear()
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, deterministic=deterministic)
        grads[run] = torch.autograd.grad(out, (q, kv), dout)
        if run is None:  # deterministic mode: one item per program (its row chunks are whole waves of them)
            assert used and {r for _, r in used} == {1 if deterministic else eff}, used
    for run in (3, 4, 0, None):
        assert torch.isfinite(grads[run][0]).all() and torch.isfinite(grads[run][1]).all()
        assert torch.equal(grads[1][0], grads[run][0]), run
        if deterministic:
            assert torch.equal(grads[1][1], grads[run][1]), run
        else:  # fp32 atomics in another order, then one bf16 rounding: at most one bf16 step apart
            torch.testing.assert_close(grads[run][1].float(), grads[1][1].float(), rtol=2**-7, atol=2**-7)
    monkeypatch.setattr(ws, "WS_BWD_RUN", -1)
    with pytest.raises(ValueError, match="WS_BWD_RUN"):
        schedule(items, -(-H // 64), dev)


@_SM90
@pytest.mark.parametrize(
    "T,H,K,ring,with_sink",
    [(600, 64, 2048, (64, 2), True), (300, 128, 1000, (64, 2), False), (200, 96, 300, (64, 2), True),
     (300, 64, 520, (32, 4), False), (5, 128, 64, (64, 2), True)],
    ids=["64x2-sink", "H128-K1000", "H96-sink", "32x4-direct", "fewer-items-than-SMs"],
)  # fmt: skip
def test_ws_forward_staged_out_equals_direct(monkeypatch, T, H, K, ring, with_sink):
    """The warp-specialized forward's output stored through the last tile (``WS_STAGED_OUT``) equals the output stored
    straight from the accumulators, bit for bit, with lse, under every schedule (the tile goes back to the producer
    only after the store, while the next item's tiles already stream in), over rows without slots (stored directly),
    ragged lengths, invalid indices and a head count that is not a multiple of 64; a 32-row ring keeps the direct
    store."""
    from longtrain.dsa.triton import KernelConfig
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws
    from longtrain.dsa.triton.sparse_mla_fwd import sparse_mla_fwd

    q, kv2d, idx, length, sink = _ws_forward_case(T, H, K, with_sink, T + H + K + 31)
    config = KernelConfig(impl="sm90", layout="warp_specialized", block_k=ring[0], num_warps=4, num_stages=ring[1])
    monkeypatch.setattr(ws, "WS_STAGED_OUT", False)
    out, lse = sparse_mla_fwd(q, kv2d, idx, 192**-0.5, 512, length, sink, config)
    assert (length == 0).any()
    monkeypatch.setattr(ws, "WS_STAGED_OUT", True)
    for schedule, run in (("runs", 1), ("runs", 4), ("persistent", 1), ("dynamic", 1)):
        monkeypatch.setattr(ws, "WS_SCHEDULE", schedule)
        monkeypatch.setattr(ws, "WS_RUN", run)
        o, l = sparse_mla_fwd(q, kv2d, idx, 192**-0.5, 512, length, sink, config)
        assert torch.equal(out, o), (schedule, run)
        assert torch.equal(lse, l), (schedule, run)


@_SM90
def test_forced_sm90_refuses_unsupported_shapes():
    from longtrain.dsa.triton import KernelConfig, sparse_mla_triton

    dev = torch.device("cuda")
    q = torch.randn((8, 16, 576), device=dev, dtype=torch.bfloat16)
    kv = torch.randn((8, 1, 576), device=dev, dtype=torch.bfloat16)
    idx = torch.zeros((8, 64), device=dev, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="at least 64 heads"):
        sparse_mla_triton(q, kv, idx, 0.1, config=KernelConfig(impl="sm90", num_stages=2))
    q = torch.randn((8, 64, 576), device=dev, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="exceed the 227 KiB"):
        sparse_mla_triton(q, kv, idx, 0.1, config=KernelConfig(impl="sm90", block_k=64, num_stages=3))
    ws = dict(impl="sm90", layout="warp_specialized", num_warps=4)
    with pytest.raises(RuntimeError, match="exceed the 227 KiB"):
        sparse_mla_triton(q, kv, idx, 0.1, config=KernelConfig(**ws, block_k=64, num_stages=3))
    with pytest.raises(RuntimeError, match="d_v in \\[128, 512\\]"):
        sparse_mla_triton(q[..., :128], kv[..., :128], idx, 0.1, d_v=64, config=KernelConfig(**ws, num_stages=2))


@_SM90
def test_forced_sm90_backward_refuses_what_it_cannot_run():
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig, sparse_mla_triton

    dev = torch.device("cuda")
    kv = torch.randn((8, 1, 576), device=dev, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.zeros((8, 64), device=dev, dtype=torch.int32)
    cases = [
        (16, KernelConfig(impl="sm90", num_stages=2), "at least 64 heads"),
        (64, KernelConfig(impl="sm90", block_k=16, num_stages=2), "64 or 32 slots per step"),
        (64, KernelConfig(impl="sm90", num_stages=3), "exceed the 227 KiB"),
    ]
    for heads, bwd, match in cases:
        q = torch.randn((8, heads, 576), device=dev, dtype=torch.bfloat16, requires_grad=True)
        out = sparse_mla_triton(q, kv, idx, 0.1, config=SparseMLAConfig(bwd=bwd, fwd=KernelConfig()))
        with pytest.raises(RuntimeError, match=match):
            out.sum().backward()


def _deterministic_case(T, H, seed):
    """bf16 GLM-5.2 widths (D_qk 576, d_v 512), 512 keys, K = 256 ragged: ``(q, kv, idx, length, dout)``."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    T_k, D, K = 512, 576, 256
    q = torch.randn((T, H, D), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    kv = torch.randn((T_k, 1, D), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    idx, length = _index_sets(T, T_k, K, gen, dev)
    dout = torch.randn((T, H, 512), generator=gen, device=dev).to(torch.bfloat16)
    return q, kv, idx, length, dout


@pytest.mark.parametrize("config", [None, "forced"], ids=["defaults", "forced"])
def test_sparse_mla_deterministic_at_128_heads_matches_the_atomic_sum(monkeypatch, config):
    """H = 128: two dkv head blocks at the default block_h (64). Their per-slot pieces must all be summed (fp32
    pieces, so that dkv is the atomic sum's up to order; the default bf16 pieces: the two-byte pieces' test)."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    monkeypatch.setattr(smb, "DET_PIECES", "fp32")

    q, kv, idx, length, dout = _deterministic_case(48, 128, seed=5)
    cfg = None if config is None else _configs()
    grads = []
    for det in (True, False):
        out = sparse_mla_triton(q, kv, idx, 0.07, d_v=512, topk_length=length, deterministic=det, config=cfg)
        grads.append(torch.autograd.grad(out, (q, kv), dout))
    # Deterministic and atomic dkv sum the same fp32 terms in different orders, then round to bf16.
    torch.testing.assert_close(grads[0][1].float(), grads[1][1].float(), rtol=2**-7, atol=2**-7)
    if config is not None:  # the same probabilities and dq kernels: dq equal bit for bit
        assert torch.equal(grads[0][0], grads[1][0])
    else:  # on SM90 the atomic default is the fused kernel: its dS can round differently to bf16
        torch.testing.assert_close(grads[0][0].float(), grads[1][0].float(), rtol=2**-7, atol=2**-7)


def test_sparse_mla_deterministic_bitwise(monkeypatch):
    """Two deterministic runs equal bit for bit; with fp32 pieces dkv is the atomic sum's up to order."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    monkeypatch.setattr(smb, "DET_PIECES", "fp32")

    q, kv, idx, length, dout = _deterministic_case(64, 64, seed=3)
    for config in (_configs(), None):  # forced (one dkv column group) and the defaults (two groups, autotuned)
        runs = []
        for det in (True, True, False):
            out = sparse_mla_triton(q, kv, idx, 0.07, d_v=512, topk_length=length, deterministic=det, config=config)
            runs.append(torch.autograd.grad(out, (q, kv), dout))
        assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0], runs[1][0])
        # Deterministic and atomic dkv sum the same fp32 terms in different orders, then round to bf16.
        torch.testing.assert_close(runs[0][1].float(), runs[2][1].float(), rtol=2**-7, atol=2**-7)


@_SM90
@pytest.mark.parametrize("H", [64, 128])
def test_sparse_mla_bwd_ws_deterministic_bitwise(monkeypatch, H):
    """The warp-specialized backward in deterministic mode: two runs equal bit for bit, and with fp32 pieces dkv equal
    to the atomic mode's up to the order of its fp32 sums; dq equal bit for bit (the same dS either way)."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig, sparse_mla_triton
    from longtrain.dsa.triton import sparse_mla_bwd as smb

    monkeypatch.setattr(smb, "DET_PIECES", "fp32")

    q, kv, idx, length, dout = _deterministic_case(64, H, seed=9)
    ws = KernelConfig(impl="sm90", layout="warp_specialized", num_warps=4, block_k=64, num_stages=1)
    runs = []
    for det in (True, True, False):
        out = sparse_mla_triton(q, kv, idx, 0.07, d_v=512, topk_length=length, deterministic=det,
                                config=SparseMLAConfig(bwd=ws))  # fmt: skip
        runs.append(torch.autograd.grad(out, (q, kv), dout))
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][0], runs[2][0])
    # Deterministic and atomic dkv sum the same fp32 terms in different orders, then round to bf16.
    torch.testing.assert_close(runs[0][1].float(), runs[2][1].float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(
    "H,K,pieces,overlap", [(64, 700, "fp32", None), (64, 700, "bf16", "high"), (128, 520, "fp16", None)],
    ids=["64-fp32", "64-bf16-reduce-overlap", "H128-fp16"],
)  # fmt: skip
def test_deterministic_runs_ahead_equal_runs_in_line(monkeypatch, H, K, pieces, overlap):
    """``DET_RUNS_AHEAD``: each chunk's sort and search formed a chunk ahead on a side stream give dq and dkv equal bit
    for bit to forming them in line on the caller's stream, over many chunks (more than the two runs alive at a
    time), ragged lengths, invalid and repeated indices, with the reductions on the caller's stream or (with
    ``DQ_OVERLAP``) on the second stream; the result is ready on the caller's stream. A bad value is a ValueError."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    q, kv, idx, length, dout = _bwd_case(600, 2048, H, K, H + K + 11, bad_row=3)
    monkeypatch.setattr(smb, "DETERMINISTIC_SCRATCH_ELEMENTS", 1)  # one SM wave of rows per chunk: several chunks
    monkeypatch.setattr(smb, "DET_PIECES", pieces)
    monkeypatch.setattr(smb, "DQ_OVERLAP", overlap)
    monkeypatch.setattr(smb, "DET_REDUCE_OVERLAP", overlap is not None)
    grads = []
    for ahead in (False, True):
        monkeypatch.setattr(smb, "DET_RUNS_AHEAD", ahead)
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, deterministic=True)
        dq, dkv = torch.autograd.grad(out, (q, kv), dout)
        grads.append((dq.clone(), dkv.clone()))  # copied on the caller's stream, at once
    assert torch.isfinite(grads[1][0]).all() and torch.isfinite(grads[1][1]).all()
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    monkeypatch.setattr(smb, "DET_RUNS_AHEAD", "yes")
    with pytest.raises(ValueError, match="DET_RUNS_AHEAD must be True or False"):
        out = sparse_mla_triton(q, kv, idx, 192**-0.5, d_v=512, topk_length=length, deterministic=True)
        torch.autograd.grad(out, (q, kv), dout)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_sparse_mla_nan_in_one_document_stays_there(deterministic):
    """Two packed documents, each row selecting keys of its own document only; a NaN in one key row of document A.
    At the defaults (on SM90: the fused probabilities + dkv kernel and the SM90 dq kernel) document B's output and
    gradients are finite and equal to a run without the NaN (bit for bit in deterministic mode)."""
    from longtrain.dsa.triton import sparse_mla_triton

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    H, D, d_v, K, len_a, len_b = 64, 576, 512, 256, 300, 200
    T = len_a + len_b
    q = torch.randn((T, H, D), generator=gen, device=dev).to(torch.bfloat16)
    kv = torch.randn((T, 1, D), generator=gen, device=dev).to(torch.bfloat16)
    dout = torch.randn((T, H, d_v), generator=gen, device=dev).to(torch.bfloat16)
    idx = torch.full((T, K), -1, dtype=torch.int32, device=dev)
    for t in range(T):  # causal keys of the row's own document, at most K of them
        start = 0 if t < len_a else len_a
        keys = torch.arange(start, t + 1, device=dev)[-K:]
        idx[t, : keys.numel()] = keys.to(torch.int32)
    bad = kv.clone()
    bad[len_a // 2, 0, 7] = float("nan")
    runs = []
    for kv_in in (kv, bad):
        qg, kvg = q.clone().requires_grad_(True), kv_in.clone().requires_grad_(True)
        out = sparse_mla_triton(qg, kvg, idx, 0.07, d_v=d_v, deterministic=deterministic)
        runs.append((out, *torch.autograd.grad(out, (qg, kvg), dout)))
    b = slice(len_a, T)
    for clean, poisoned in zip(runs[0], runs[1]):
        assert torch.isfinite(poisoned[b]).all()
        if deterministic:
            assert torch.equal(poisoned[b], clean[b])
        else:  # dkv's atomics add in another order from run to run
            torch.testing.assert_close(poisoned[b].float(), clean[b].float(), rtol=2**-7, atol=2**-7)
    assert torch.isnan(runs[1][0][len_a // 2 : len_a]).any()  # rows of A that attend the NaN key carry it


def test_torch_route_bf16_on_cuda():
    """The plain-PyTorch route (``backend="torch"``) on CUDA: its backward sums key gradients with
    ``index_put_(accumulate=True)`` over used slots only; unused (-1) slots, most of them here, change nothing."""
    from longtrain.dsa.ops import sparse_mla_attention

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    T, T_k, H, D, d_v, K = 96, 1500, 64, 576, 512, 2048
    q = torch.randn((T, H, D), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    kv = torch.randn((T_k, 1, D), generator=gen, device=dev).to(torch.bfloat16).requires_grad_(True)
    idx, length = _index_sets(T, T_k, 1024, gen, dev)
    idx = torch.cat([idx, torch.full((T, K - 1024), -1, dtype=torch.int32, device=dev)], 1)  # half the slots unused
    scale = 192**-0.5
    out = sparse_mla_attention(q, kv, idx, scale, d_v=d_v, backend="torch")
    dout = torch.randn(out.shape, generator=gen, device=dev).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (q, kv), dout)
    same = _torch_bf16(q, kv, idx, scale, d_v, None, None)
    same_grads = torch.autograd.grad(same, (q, kv), dout)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, kv)]
    ref, _ = sparse_mla_reference(leaves64[0], leaves64[1], idx, scale, d_v=d_v)
    ref_grads = torch.autograd.grad(ref, leaves64, dout.double())
    _check_rule("out", out, same, ref)
    for name, g, s_, r in zip(("dq", "dkv"), grads, same_grads, ref_grads):
        _check_rule(name, g, s_, r)


@pytest.mark.parametrize("K", [2048, 512])
def test_indexer_sampled_select_equals_whole_row(K):
    """Rows wider than ``select_cand`` (4096 at 10K keys) take the sampled union; zero-weight rows tie throughout
    and take the whole-row fallback. Either way the selection is bit-identical to the whole-row radix select's."""
    import dataclasses

    from longtrain.dsa.triton import IndexerConfig
    from longtrain.dsa.triton.indexer_topk import indexer_topk_fwd

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(K + 1)
    T, H_I, D_I = 10000, 32, 128
    starts = torch.zeros(T, dtype=torch.int32, device=dev)
    causal = torch.arange(1, T + 1, dtype=torch.int32, device=dev)
    q = torch.randn((T, H_I, D_I), generator=gen, device=dev).to(torch.bfloat16)
    k = torch.randn((T, D_I), generator=gen, device=dev).to(torch.bfloat16)
    w = torch.randn((T, H_I), generator=gen, device=dev) * (H_I * D_I) ** -0.5
    w[9000:9100] = 0.0
    cfg = IndexerConfig()
    out = indexer_topk_fwd(q, k, w, starts, causal, K, cfg)
    whole = indexer_topk_fwd(q, k, w, starts, causal, K, dataclasses.replace(cfg, select_sample=0))
    assert torch.equal(out, whole)
    assert torch.equal(out[9000:9100], torch.arange(K, dtype=torch.int32, device=dev).expand(100, K))


def _indexer_layout(dev):
    """Two causal documents (3000 and 1090 tokens) and 6 padding rows: ``(starts, causal_lengths)``."""
    docs = (3000, 1090)
    starts = torch.cat([torch.full((n,), s, dtype=torch.int32) for n, s in zip(docs, (0, docs[0]))] + [
        torch.zeros(6, dtype=torch.int32)]).to(dev)  # fmt: skip
    causal = torch.cat([torch.arange(1, n + 1, dtype=torch.int32) for n in docs] + [
        torch.zeros(6, dtype=torch.int32)]).to(dev)  # fmt: skip
    return starts, causal


def _assert_canonical_and_maximal(out, q, k, w, starts, causal, K, slack, of_abs_terms=False):
    """Canonical rows, and a maximal set: min chosen >= max unchosen float64 score, up to ``slack`` of the row's
    largest |score| (the kernel's accumulation rounding on near-ties), or with ``of_abs_terms`` of the row's largest
    sum of absolute terms ``sum_h |w| sum_d |q k|`` (what an accumulator's relative rounding scales with)."""
    T = out.shape[0]
    dev = out.device
    assert out.shape == (T, K) and out.dtype == torch.int32
    n = torch.clamp(causal.long(), max=K)
    slot = torch.arange(K, device=dev)
    assert torch.all(torch.where(slot[None, :] >= n[:, None], out == -1, out >= 0))
    inside = (out >= starts[:, None]) & (out < (starts + causal)[:, None])
    assert torch.all(torch.where(out >= 0, inside, True))
    step = out[:, 1:] - out[:, :-1]
    assert torch.all(torch.where(slot[None, 1:] < n[:, None], step > 0, True))
    for r0 in range(0, T, 512):
        rows = slice(r0, min(T, r0 + 512))
        logits = torch.einsum("thd,sd->ths", q[rows].double(), k.double()).clamp_min(0)
        scores = torch.einsum("th,ths->ts", w[rows].double(), logits)
        keys = torch.arange(T, device=dev)
        window = (keys[None, :] >= starts[rows, None]) & (keys[None, :] < (starts + causal)[rows, None])
        chosen = torch.zeros_like(window)
        o = out[rows].long()
        chosen.scatter_(1, torch.where(o >= 0, o, T - 1), o >= 0)
        chosen &= window
        if of_abs_terms:
            terms = torch.einsum("thd,sd->ths", q[rows].double().abs(), k.double().abs())
            big = torch.where(window, torch.einsum("th,ths->ts", w[rows].double().abs(), terms), 0.0).amax(1)
        else:
            big = scores.abs().amax(1)
        lo = torch.where(chosen, scores, float("inf")).amin(1)
        hi = torch.where(window & ~chosen, scores, float("-inf")).amax(1)
        assert torch.all(lo >= hi - slack * big), r0


def _indexer_inputs(K, dev):
    gen = torch.Generator(device=dev).manual_seed(K)
    starts, causal = _indexer_layout(dev)
    T, H_I, D_I = starts.shape[0], 32, 128
    q = torch.randn((T, H_I, D_I), generator=gen, device=dev).to(torch.bfloat16)
    k = torch.randn((T, D_I), generator=gen, device=dev).to(torch.bfloat16)
    w = torch.randn((T, H_I), generator=gen, device=dev) * (H_I * D_I) ** -0.5
    return q, k, w, starts, causal


@pytest.mark.parametrize("K", [2048, 512])
def test_indexer_bf16_canonical_and_maximal(K):
    from longtrain.dsa.triton import indexer_topk_triton

    q, k, w, starts, causal = _indexer_inputs(K, torch.device("cuda"))
    out = indexer_topk_triton(q, k, w, starts, causal, K)
    _assert_canonical_and_maximal(out, q, k, w, starts, causal, K, slack=1e-5)  # fp32 near-tie slack
    ref = indexer_topk_reference(q.double(), k.double(), w.double(), starts, causal, K)
    agree = (out == ref).float().mean().item()
    assert agree > 0.999, agree


@pytest.mark.parametrize("K", [2048, 512])
def test_indexer_fp8_selects_a_maximal_set_of_the_fp8_scores(K):
    """``fp8=True`` on the FP8 tensor cores: a maximal set of the FP8 scores (the dequantized codes' scores in
    float64) up to the accumulation's rounding, and nearly the float64 selection of those scores.

    Slack: Hopper's FP8 MMA keeps about 14 bits per accumulation step (DeepSeek-V3 report, section 3.3.2) and a
    D_I = 128 dot is 4 steps of 32, so a score is off by at most about 4 * 2**-14 of its sum of absolute terms
    ``sum_h |w| sum_d |q k|``; a chosen and an unchosen score together by twice that: 2**-10 bounds it. A selection
    has no error to compare, so agreement is a set overlap over the rows with a choice to make (near-ties swap keys,
    which would shift every later slot of an ascending row)."""
    from longtrain.bench_suites.dsa import selection_overlap
    from longtrain.dsa.reference import indexer_fp8_operands
    from longtrain.dsa.triton import indexer_topk_triton

    q, k, w, starts, causal = _indexer_inputs(K, torch.device("cuda"))
    out = indexer_topk_triton(q, k, w, starts, causal, K, fp8=True)
    q8, k8, wf, ks = indexer_fp8_operands(q, k, w)
    k_deq = k8.double() * ks.double()[:, None]
    _assert_canonical_and_maximal(out, q8, k_deq, wf, starts, causal, K, slack=2.0**-10, of_abs_terms=True)
    wide = causal > K
    ref = indexer_topk_reference(q8.double(), k_deq, wf.double(), starts, causal, K)
    assert selection_overlap(out[wide], ref[wide]) > 0.99
    bf16 = indexer_topk_triton(q, k, w, starts, causal, K)
    assert (
        selection_overlap(out[wide], bf16[wide]) > 0.9
    )  # what FP8 itself changes (0.98-0.99 on the CPU at these widths)


def _sm90_or_skip():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the SM90 indexer scoring kernel needs an SM90 GPU")


@pytest.mark.parametrize(
    ("H_I", "D_I", "dtype", "block_n", "num_buf", "K"),
    [
        pytest.param(32, 128, torch.bfloat16, 256, 5, 512, id="glm-64x256-ring5"),
        pytest.param(32, 128, torch.bfloat16, 128, 6, 2048, id="glm-64x128-ring6"),
        pytest.param(32, 128, torch.float16, 256, 3, 512, id="fp16-ring3"),
        pytest.param(3, 64, torch.bfloat16, 256, 8, 512, id="3heads-d64-ring8"),
        pytest.param(1, 256, torch.bfloat16, 128, 4, 300, id="1head-d256"),
        pytest.param(17, 128, torch.bfloat16, 256, 5, 512, id="17heads-group1"),
        pytest.param(24, 128, torch.bfloat16, 256, 4, 512, id="24heads-group8"),
    ],
)
@pytest.mark.parametrize("loader", ["cp_async", "tma"])
def test_indexer_sm90_scores_equal_the_portable_kernel(H_I, D_I, dtype, block_n, num_buf, K, loader):
    """The SM90 scoring kernel writes the portable kernel's score scratch bit for bit (the same entries, the same
    keys; both into a sentinel-filled scratch), whole and as a row chunk starting mid-document, so the selection is
    the same. Two documents, six padding rows, windows ending mid-tile, zero and negative head weights."""
    from longtrain.dsa.triton.indexer_topk import indexer_topk_fwd, indexer_topk_fwd_scores, scores_route

    _sm90_or_skip()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(H_I * 1000 + D_I + K)
    starts, causal = _indexer_layout(dev)
    T = starts.shape[0]
    q = torch.randn((T, H_I, D_I), generator=gen, device=dev).to(dtype)
    k = torch.randn((T, D_I), generator=gen, device=dev).to(dtype)
    w = torch.randn((T, H_I), generator=gen, device=dev) * (H_I * D_I) ** -0.5
    w[100:200, 0] = 0.0
    sm90 = IndexerConfig(scores_impl="sm90", sm90_block_n=block_n, sm90_num_buf=num_buf, sm90_loader=loader)
    portable = IndexerConfig(scores_impl="triton")
    assert scores_route(q, sm90, False) == "sm90"
    for row0, row1 in ((0, T), (1000, 2500)):
        scratch = []
        for cfg in (portable, sm90):
            s = torch.full((row1 - row0, T), 0x5A5A5A5A, dtype=torch.int32, device=dev)
            indexer_topk_fwd_scores(q, k, w, None, starts, causal, s, row0, row1, K, cfg)
            scratch.append(s)
        assert torch.equal(scratch[0], scratch[1]), (row0, row1)
        assert bool((scratch[1] != 0x5A5A5A5A).any())
    assert torch.equal(indexer_topk_fwd(q, k, w, starts, causal, K, sm90),
                       indexer_topk_fwd(q, k, w, starts, causal, K, portable))  # fmt: skip


def test_indexer_auto_picks_the_sm90_scores_for_bf16_only():
    from longtrain.dsa.triton.indexer_topk import scores_route

    _sm90_or_skip()
    q = torch.zeros((4, 32, 128), dtype=torch.bfloat16, device="cuda")
    assert scores_route(q, IndexerConfig(), False) == "sm90"
    assert scores_route(q, IndexerConfig(), True) == "triton"  # FP8 codes: the portable kernel
    assert scores_route(q.float(), IndexerConfig(), False) == "triton"
    with pytest.raises(ValueError, match="shared memory"):
        scores_route(q.new_zeros((4, 32, 256)), IndexerConfig(scores_impl="sm90", sm90_num_buf=8), False)


@pytest.mark.parametrize("group", [8, 16], ids=["group8", "group16"])
def test_indexer_sm90_fp8_scores_equal_the_portable_kernel(group):
    """The SM90 scoring kernel on FP8 codes (TMA loader, key scales after the head sum), launched directly: the
    library routes FP8 codes to the portable kernel until this kernel is measured. Both run the same E4M3 wgmma
    steps in the same order, so the score scratch is expected bit for bit equal, whole and as a row chunk."""
    from longtrain.dsa.triton.indexer_topk import indexer_fp8_operands_triton, indexer_topk_fwd_scores
    from longtrain.dsa.triton.indexer_topk_sm90 import indexer_topk_fwd_sm90_scores

    _sm90_or_skip()
    q, k, w, starts, causal = _indexer_inputs(512, torch.device("cuda"))
    T = q.shape[0]
    q8, k8, w8, ks = indexer_fp8_operands_triton(q, k, w)
    for row0, row1 in ((0, T), (1000, 2500)):
        scratch = []
        for sm90 in (False, True):
            s = torch.full((row1 - row0, T), 0x5A5A5A5A, dtype=torch.int32, device=q.device)
            if sm90:
                cfg = IndexerConfig(sm90_group=group)
                indexer_topk_fwd_sm90_scores(q8, k8, w8, ks, starts, causal, s, row0, row1, 512, cfg)
            else:
                indexer_topk_fwd_scores(q8, k8, w8, ks, starts, causal, s, row0, row1, 512, IndexerConfig())
            scratch.append(s)
        assert torch.equal(scratch[0], scratch[1]), (row0, row1)
