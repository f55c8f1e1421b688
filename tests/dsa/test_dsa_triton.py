"""Triton DSA kernels under TRITON_INTERPRET=1 against the float64 references (tiny shapes, forced configs)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from longtrain.dsa.reference import indexer_scores, indexer_topk_reference, sparse_mla_reference
from longtrain.dsa.triton import IndexerConfig, KernelConfig, SparseMLAConfig, availability

pytestmark = pytest.mark.interpret

# Small tiles so several slot blocks / key blocks / head blocks are exercised on tiny shapes.
_CFG = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1)
_ICFG = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)


def _mla_inputs(T, H, D, T_k, K, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype).requires_grad_(True)
    kv = torch.randn(T_k, 1, D, generator=g).to(dtype).requires_grad_(True)
    idx = torch.randint(0, T_k, (T, K), generator=g, dtype=torch.int32)
    return q, kv, idx


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _check_against_reference(q, kv, idx, scale, *, d_v, topk_length=None, sink=None, config=_CFG, det=False):
    from longtrain.dsa.triton import sparse_mla_triton

    out = sparse_mla_triton(
        q, kv, idx, scale, d_v=d_v, topk_length=topk_length, attn_sink=sink, config=config, deterministic=det
    )
    assert out.shape == (q.shape[0], q.shape[1], d_v) and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    sink64 = sink.detach().double().requires_grad_(True) if sink is not None else None
    q64 = q.detach().double().requires_grad_(True)
    kv64 = kv.detach().double().requires_grad_(True)
    ref, _ = sparse_mla_reference(q64, kv64, idx, scale, d_v=d_v, topk_length=topk_length, attn_sink=sink64)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    inputs = [q, kv] + ([sink] if sink is not None else [])
    inputs64 = [q64, kv64] + ([sink64] if sink is not None else [])
    grads = _grads(out, inputs, dout.to(out.dtype))
    grads64 = _grads(ref, inputs64, dout)
    # fp32 kernels against a float64 oracle: fp32 rounding of K-long dot products, far below 1e-4.
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip(("dq", "dkv", "dsink"), grads, grads64):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return out, grads


@pytest.mark.parametrize(
    "T,H,D,d_v,T_k,K,with_len,with_sink",
    [
        (5, 4, 48, 32, 23, 40, True, True),  # rope tail, ragged lengths, sink, 3 slot blocks
        (4, 3, 32, 32, 9, 16, False, False),  # K = V (d_v == D_qk), odd head count
        (3, 20, 32, 16, 7, 24, True, False),  # two head blocks of 16 (the second one partial)
        (1, 1, 48, 48, 1, 5, False, True),  # T = T_k = 1, K not a multiple of 16
    ],
    ids=["rope-len-sink", "kv-equal-oddH", "two-head-blocks", "single"],
)
def test_sparse_mla_matches_reference(triton_interpret, T, H, D, d_v, T_k, K, with_len, with_sink):
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=T * 100 + H)
    g = torch.Generator().manual_seed(1)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    length = torch.randint(0, K + 3, (T,), generator=g) if with_len else None
    sink = torch.randn(H, generator=g).requires_grad_(True) if with_sink else None
    _check_against_reference(q, kv, idx, 0.37, d_v=d_v, topk_length=length, sink=sink)


@pytest.mark.parametrize(
    "D,d_v,col_groups,det",
    [
        (96, 64, 2, False),  # two value groups + the rope tail's own launch
        (96, 64, 4, False),  # four groups of 16 columns
        (80, 48, 2, True),  # d_v not a power of two (masked columns), deterministic scratch
        (64, 64, 2, False),  # K = V: no rope tail, no second launch
    ],
    ids=["rope-2", "rope-4", "d48-det", "kv-equal"],
)
def test_sparse_mla_dkv_column_groups(triton_interpret, D, d_v, col_groups, det):
    """The dkv kernel split over value-column groups gives the reference's dkv, as the single-program kernel does."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    q, kv, idx = _mla_inputs(5, 4, D, 13, 24, seed=D + col_groups)
    g = torch.Generator().manual_seed(2)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    idx[0, :6] = 3  # one key from many slots
    length = torch.tensor([24, 5, 0, 17, 24])
    dkv_cfg = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1, col_groups=col_groups)
    cfg = SparseMLAConfig(fwd=_CFG, bwd=_CFG, bwd_dkv=dkv_cfg)
    _check_against_reference(q, kv, idx, 0.3, d_v=d_v, topk_length=length, config=cfg, det=det)


@pytest.mark.parametrize(
    "T,H,D,d_v,T_k,K,block_h,det",
    [
        (5, 4, 48, 32, 23, 40, 16, False),  # rope tail, heads padded to the block
        (4, 3, 32, 32, 9, 16, 16, False),  # K = V: no rope part
        (3, 20, 32, 16, 7, 24, 16, True),  # two head blocks (the second partial), deterministic dkv
        (2, 8, 80, 48, 11, 20, 16, False),  # d_v not a power of two, fewer heads than the block
    ],
    ids=["rope", "kv-equal", "two-head-blocks-det", "d48"],
)
def test_sparse_mla_stacked_probabilities_kernel(triton_interpret, T, H, D, d_v, T_k, K, block_h, det):
    """``layout="stacked"`` (logits and dO V^T as one matmul of stacked rows) gives the reference's gradients."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=T * 10 + H)
    g = torch.Generator().manual_seed(3)
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    length = torch.randint(0, K + 3, (T,), generator=g)
    length[0] = 0  # a row without keys
    sink = torch.randn(H, generator=g).requires_grad_(True)
    stacked = KernelConfig(block_k=16, block_h=block_h, num_warps=4, num_stages=1, layout="stacked")
    config = SparseMLAConfig(fwd=_CFG, bwd=stacked, bwd_dq=_CFG, bwd_dkv=_CFG)
    _check_against_reference(q, kv, idx, 0.37, d_v=d_v, topk_length=length, sink=sink, config=config, det=det)


def test_stacked_layout_is_the_backwards_only():
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    with pytest.raises(ValueError, match="layout='stacked' is the backward's probabilities kernel's"):
        SparseMLAConfig(fwd=KernelConfig(layout="stacked"))
    SparseMLAConfig(bwd=KernelConfig(layout="stacked"))
    with pytest.raises(ValueError, match="bwd: layout='keys' is the forward's"):
        SparseMLAConfig(bwd=KernelConfig(layout="keys"))
    with pytest.raises(ValueError, match=r"bwd_dkv: the dkv kernel has one layout .* impl='sm90'"):
        SparseMLAConfig(bwd_dkv=KernelConfig(impl="sm90"))
    with pytest.raises(ValueError, match="bwd_dq: the dq kernel has one layout .* layout='stacked'"):
        SparseMLAConfig(bwd_dq=KernelConfig(layout="stacked"))


def test_a_bare_kernel_config_keeps_its_layout_for_the_forward(triton_interpret):
    """A bare KernelConfig forces every kernel; its layout is the forward's, the backward runs the portable kernels."""
    q, kv, idx = _mla_inputs(3, 4, 48, 10, 16, seed=21)
    bare = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1, layout="keys")
    _check_against_reference(q, kv, idx, 0.3, d_v=32, config=bare)


def test_sparse_mla_backward_kernels_with_their_own_head_blocks(triton_interpret):
    """ds, dq and dkv each split the heads by their own config's block_h (here 16, 64 and 32 of 40 heads)."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    q, kv, idx = _mla_inputs(4, 40, 48, 11, 20, seed=4)
    idx[1, :5] = -1

    def cfg(block_h, groups=1):
        return KernelConfig(block_k=16, block_h=block_h, num_warps=4, num_stages=1, col_groups=groups)

    config = SparseMLAConfig(fwd=_CFG, bwd=cfg(16), bwd_dq=cfg(64), bwd_dkv=cfg(32, groups=2))
    _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=torch.tensor([20, 9, 0, 13]), config=config)


def test_sparse_mla_empty_rows_give_exact_zeros(triton_interpret):
    T, H, D, T_k, K = 5, 4, 48, 12, 20
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=3)
    idx[1] = -1  # every slot invalid
    idx[3, :] = T_k + 5  # every slot out of range
    length = torch.tensor([K, K, K, K, 0])  # row 4: zero length
    idx[4] = torch.arange(K) % T_k  # its (ignored) slots point at real keys
    # Keys used by the empty rows only must get exactly zero gradient: row 4's keys are shared, so test
    # a key nobody valid selects.
    idx[[0, 2]] = torch.where(idx[[0, 2]] == 11, 10, idx[[0, 2]])
    sink = torch.full((H,), 0.5).requires_grad_(True)
    out, (dq, dkv, dsink) = _check_against_reference(q, kv, idx, 0.2, d_v=32, topk_length=length, sink=sink)
    for row in (1, 3, 4):
        assert torch.equal(out[row], torch.zeros_like(out[row]))
        assert torch.equal(dq[row], torch.zeros_like(dq[row]))
    assert torch.equal(dkv[11], torch.zeros_like(dkv[11]))


def test_sparse_mla_duplicates_and_invalid_slots(triton_interpret):
    T, H, D, T_k, K = 4, 2, 32, 6, 32
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=5)
    idx[0] = 2  # one key 32 times
    idx[1, ::2] = 4  # half the slots on one key, the other half random
    idx[2, :8] = torch.tensor([-1, -7, T_k, 2**30, 0, 0, 5, -1], dtype=torch.int32)
    _check_against_reference(q, kv, idx, 0.5, d_v=16)
    # int64 indices beyond int32 stay invalid instead of wrapping into a real row.
    big = idx.to(torch.int64)
    big[3, :4] = torch.tensor([2**32 + 1, 2**40, -(2**33), 2**32 + 3])
    _check_against_reference(q, kv, big, 0.5, d_v=16)


def test_sparse_mla_deterministic_is_bitwise_reproducible(triton_interpret):
    T, H, D, T_k, K = 6, 4, 48, 9, 32
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=9)
    idx[:, 5:9] = 3  # many contributions to one key, from every row
    length = torch.tensor([32, 7, 0, 20, 32, 1])
    _, grads_a = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, det=True)
    _, grads_b = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, det=True)
    assert torch.equal(grads_a[1], grads_b[1])


@pytest.mark.parametrize("groups", [1, 2])
def test_sparse_mla_deterministic_with_several_head_blocks(triton_interpret, groups):
    """Deterministic dkv with the heads split over programs (H = 40 in blocks of 16): every head block's per-slot
    pieces are kept and summed, none overwrites another's (regression: before 2026-12-01 they shared one scratch row
    per slot, so any H above the dkv kernel's block_h, e.g. H = 128 at the default 64, lost head blocks)."""
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    q, kv, idx = _mla_inputs(4, 40, 48, 9, 24, seed=12)
    idx[:, 3:7] = 2  # many contributions to one key
    cfg = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1, col_groups=groups)
    config = SparseMLAConfig(fwd=_CFG, bwd=cfg)
    length = torch.tensor([24, 7, 0, 20])
    _, grads_a = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, config=config, det=True)
    _, grads_b = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, config=config, det=True)
    assert torch.equal(grads_a[1], grads_b[1])


@pytest.mark.parametrize("heads,block_h", [(4, None), (40, 16)], ids=["one-head-block", "three-head-blocks"])
def test_sparse_mla_deterministic_does_not_depend_on_the_scratch_size(triton_interpret, monkeypatch, heads, block_h):
    """Each row chunk's reduction continues the running dkv, so every key's pieces are summed in one global (row,
    slot) order whatever the row chunk: one-row chunks (the smallest scratch) and one chunk of every row give the
    same gradients bit for bit, and the scratch size only trades memory for speed."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb
    from longtrain.dsa.triton import KernelConfig, SparseMLAConfig

    T, K = 6, 24
    config = _CFG
    if block_h is not None:
        bwd = KernelConfig(block_k=16, block_h=block_h, num_warps=4, num_stages=1)
        config = SparseMLAConfig(fwd=_CFG, bwd=bwd)
    q, kv, idx = _mla_inputs(T, heads, 48, 9, K, seed=13)
    idx[:, 3:9] = 4  # many contributions to one key, from every row
    length = torch.tensor([24, 7, 0, 20, 24, 1])
    _, whole = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, config=config, det=True)
    monkeypatch.setattr(smb, "DETERMINISTIC_SCRATCH_ELEMENTS", 1)  # one row per chunk
    _, per_row = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, config=config, det=True)
    for name, a, b in zip(("dq", "dkv"), whole, per_row):
        assert torch.equal(a, b), name


def test_sparse_mla_dq_overlap_is_checked_and_leaves_other_routes_alone(triton_interpret, monkeypatch):
    """``DQ_OVERLAP`` (the SM90 route's dq on a second stream) is validated at every backward, listing its modes, and
    where it does not apply (here the interpreter's portable kernels, several row chunks) the gradients are those of
    one stream, bit for bit."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb

    T, K = 6, 24
    q, kv, idx = _mla_inputs(T, 4, 48, 9, K, seed=17)
    monkeypatch.setattr(smb, "PDS_SCRATCH_BYTES", 4 * 4 * K * 2)  # two-row chunks
    _, one = _check_against_reference(q, kv, idx, 0.3, d_v=32, config=_CFG, det=True)
    for mode in ("high", "partition"):
        monkeypatch.setattr(smb, "DQ_OVERLAP", mode)
        _, overlap = _check_against_reference(q, kv, idx, 0.3, d_v=32, config=_CFG, det=True)
        for name, a, b in zip(("dq", "dkv"), one, overlap):
            assert torch.equal(a, b), (mode, name)
    monkeypatch.setattr(smb, "DQ_OVERLAP", "fast")
    modes = r"\(None, 'high', 'same', 'partition'\)"
    with pytest.raises(ValueError, match=rf"DQ_OVERLAP must be one of {modes}, got 'fast'"):
        _check_against_reference(q, kv, idx, 0.3, d_v=32, config=_CFG, det=True)


@pytest.mark.parametrize(
    "pieces,heads,chunk_rows",
    [("bf16", 4, None), ("bf16", 4, 1), ("bf16", 16, 2), ("fp16", 4, None), ("fp16", 4, 1), ("fp16", 16, 2)],
    ids=["bf16-one-chunk", "bf16-row-chunks", "bf16-H16", "fp16-one-chunk", "fp16-row-chunks", "fp16-H16"],
)  # fmt: skip
def test_sparse_mla_deterministic_two_byte_pieces(triton_interpret, monkeypatch, pieces, heads, chunk_rows):
    """``DET_PIECES = "bf16"`` / ``"fp16"``: each per-slot dkv piece is rounded to bf16, or scaled by a power of two per
    row and column chunk and rounded to fp16, before the fixed-order fp32 sum. dkv then differs from the float64
    reference by at most one step of the format for every piece it sums (``2**-7`` / ``2**-10`` of ``sum |piece|`` per
    element, plus fp32's tolerance), does differ from the fp32 pieces' dkv (the rounding happened), is the same bit
    for bit on a second run and at any row chunk, and dq is unchanged; a bad mode lists the valid ones."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb
    from longtrain.dsa.reference import selected_rows, sparse_mla_on_keys
    from longtrain.dsa.triton import sparse_mla_triton

    T, D, d_v, T_k, K = 6, 48, 32, 9, 24
    q, kv, idx = _mla_inputs(T, heads, D, T_k, K, seed=19)
    idx[:, 3:9] = 4  # many contributions to one key, from every row
    idx[2, :3] = torch.tensor([-1, T_k, 2**30], dtype=torch.int32)
    length = torch.tensor([24, 7, 0, 20, 24, 1])
    dout = torch.randn(T, heads, d_v, generator=torch.Generator().manual_seed(7))

    def grads(mode, scratch=None):
        monkeypatch.setattr(smb, "DET_PIECES", mode)
        if scratch is not None:
            monkeypatch.setattr(smb, "DETERMINISTIC_SCRATCH_ELEMENTS", scratch)
        out = sparse_mla_triton(q, kv, idx, 0.3, d_v=d_v, topk_length=length, config=_CFG, deterministic=True)
        return torch.autograd.grad(out, (q, kv), dout)

    dq32, dkv32 = grads("fp32")
    dq16, dkv16 = grads(pieces)
    scratch = None if chunk_rows is None else chunk_rows * K * triton_head_blocks(heads) * D
    assert all(torch.equal(a, b) for a, b in zip((dq16, dkv16), grads(pieces, scratch)))
    assert torch.equal(dq16, dq32) and not torch.equal(dkv16, dkv32)
    # The float64 pieces: the gradient of each row's gathered key copy (one head block, block_h = 16 >= heads).
    rows, valid = selected_rows(idx, T_k, length)
    keys = kv.detach().double()[:, 0][rows].requires_grad_(True)  # [T, K, D]
    ref, _ = sparse_mla_on_keys(q.detach().double(), keys, valid, 0.3, d_v=d_v)
    pieces64 = torch.autograd.grad(ref, keys, dout.double())[0]  # [T, K, D]
    want = torch.zeros(T_k, D, dtype=torch.float64).index_add_(0, rows[valid], pieces64[valid])
    abs_sum = torch.zeros(T_k, D, dtype=torch.float64).index_add_(0, rows[valid], pieces64[valid].abs())
    # One step of the format per piece, relative to each element: bf16 2**-7 (the interpreter converts fp32 to bf16 by
    # truncation, a whole step; a GPU rounds to nearest), fp16 2**-10 (every element of these pieces is within fp16's
    # normal range once scaled). Plus fp32's tolerance for the rest of the arithmetic.
    step = 2**-7 if pieces == "bf16" else 2**-10
    bound = step * abs_sum + 1e-5 + 1e-4 * want.abs()
    err = (dkv16[:, 0].double() - want).abs()
    assert (err <= bound).all(), (err - bound).max()
    torch.testing.assert_close(dkv32[:, 0].double(), want, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(smb, "DET_PIECES", "fp8")
    with pytest.raises(
        ValueError,
        match=r"DET_PIECES must be None \(bf16 pieces for bf16 inputs, else fp32\) or one of "
        r"\('fp32', 'bf16', 'fp16'\), got 'fp8'",
    ):
        grads("fp8")
    for bad in (6, 0, True, 8.0):
        monkeypatch.setattr(smb, "DKV_REDUCE_BATCH", bad)
        with pytest.raises(ValueError, match=r"DKV_REDUCE_BATCH must be None \(the measured choice\) or a power"):
            grads(pieces)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sparse_mla_deterministic_pieces_default_by_input_dtype(triton_interpret, monkeypatch, dtype):
    """``DET_PIECES = None`` (the default) stores bf16 pieces for bf16 keys (``_piece_dtype``; the interpreter's bf16
    dots are wrong, so bf16 inputs run on the GPU, ``tests/gpu``) and fp32 pieces for fp32 and fp16 keys: here bit
    for bit the gradients of ``DET_PIECES = "fp32"``.
    ``DETERMINISTIC_SCRATCH_ELEMENTS = None`` is ``DETERMINISTIC_SCRATCH_BYTES`` of pieces; the gradients do not
    depend on it, and a bad size is a ValueError naming the knob."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    assert smb.DET_PIECES is None and smb.DETERMINISTIC_SCRATCH_ELEMENTS is None
    assert smb._piece_dtype(torch.bfloat16) == torch.bfloat16 and smb._piece_dtype(torch.float16) == torch.float32
    assert smb._piece_dtype(torch.float32) == torch.float32
    assert smb._scratch_elements(torch.bfloat16) == smb.DETERMINISTIC_SCRATCH_BYTES // 2 == 1 << 30
    assert smb._scratch_elements(torch.float32) == 1 << 29
    T, H, D, d_v, T_k, K = 6, 4, 48, 32, 9, 24
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, dtype=dtype, seed=29)
    idx[:, 3:9] = 4
    length = torch.tensor([24, 7, 0, 20, 24, 1])
    dout = torch.randn(T, H, d_v, generator=torch.Generator().manual_seed(3)).to(dtype)

    def grads(**settings):
        for name, value in settings.items():
            monkeypatch.setattr(smb, name, value)
        out = sparse_mla_triton(q, kv, idx, 0.3, d_v=d_v, topk_length=length, config=_CFG, deterministic=True)
        return torch.autograd.grad(out, (q, kv), dout)

    default = grads()
    named = grads(DET_PIECES="fp32")
    small = grads(DET_PIECES=None, DETERMINISTIC_SCRATCH_ELEMENTS=K * D)  # one row per chunk
    for a, b, c in zip(default, named, small):
        assert torch.equal(a, b) and torch.equal(a, c)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"DETERMINISTIC_SCRATCH_ELEMENTS must be an int >= 1"):
            grads(DET_PIECES=None, DETERMINISTIC_SCRATCH_ELEMENTS=bad)
    with pytest.raises(ValueError, match=r"DETERMINISTIC_SCRATCH_BYTES // 4 must be an int >= 1"):
        grads(DET_PIECES="fp32", DETERMINISTIC_SCRATCH_ELEMENTS=None, DETERMINISTIC_SCRATCH_BYTES=3)


@pytest.mark.parametrize("col_groups", [1, 2], ids=["one-program-per-row", "two-column-groups"])
def test_sparse_mla_deterministic_fp16_pieces_scale_with_the_gradient(triton_interpret, monkeypatch, col_groups):
    """Scaled fp16 pieces follow the gradient's magnitude exactly: with ``dout`` times ``2**-40`` (below fp16's range)
    or ``2**40`` (above it) dkv is the same bits times that power of two, since every piece's scale moves with it; at
    ordinary magnitudes the fp16 pieces' dkv is closer to the fp32 pieces' than the bf16 pieces' is. An infinite
    ``dout`` element gives infinities and NaN exactly where the fp32 pieces give them, and no other element changes."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb
    from longtrain.dsa.triton import sparse_mla_triton

    T, H, D, d_v, T_k, K = 6, 4, 48, 32, 9, 24
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=23)
    idx[:, 3:9] = 4
    length = torch.tensor([24, 7, 0, 20, 24, 1])
    dout = torch.randn(T, H, d_v, generator=torch.Generator().manual_seed(5))
    config = KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1, col_groups=col_groups)

    def dkv(mode, grad):
        monkeypatch.setattr(smb, "DET_PIECES", mode)
        out = sparse_mla_triton(q, kv, idx, 0.3, d_v=d_v, topk_length=length, config=config, deterministic=True)
        return torch.autograd.grad(out, (kv,), grad)[0]

    base = dkv("fp16", dout)
    for power in (-40, 40):
        assert torch.equal(dkv("fp16", dout * 2.0**power), base * 2.0**power), power
    exact = dkv("fp32", dout)
    assert (base - exact).abs().max() < (dkv("bf16", dout) - exact).abs().max() / 4
    bad = dout.clone()
    bad[3, 1, 5] = float("inf")
    want, got = dkv("fp32", bad), dkv("fp16", bad)
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.isinf(), got.isinf())
    assert want.isnan().any()
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=2**-10, atol=1e-5)


def triton_head_blocks(heads: int) -> int:
    """Head blocks of the interpreter tests' dkv kernel (block_h = 16)."""
    return -(-heads // 16)


@pytest.mark.parametrize(
    "num_hb,row0,with_len,num_keys,batch,pieces",
    [(1, 0, False, 7, 1, torch.float32), (2, 3, True, 7, 1, torch.float32), (3, 1, True, 7, 1, torch.float32),
     (1, 2, True, 40000, 1, torch.float32), (1, 0, False, 7, 8, torch.float32), (2, 3, True, 7, 4, torch.bfloat16),
     (1, 1, True, 7, 1, torch.bfloat16), (2, 3, True, 7, 8, torch.float16), (1, 1, False, 7, 1, torch.float16)],
    ids=["hb1", "hb2-row3-len", "hb3-row1-len", "hb1-int32-keys", "hb1-batch8", "hb2-batch4-bf16", "bf16",
         "hb2-batch8-fp16", "fp16"],
)  # fmt: skip
def test_deterministic_reduce_sums_each_key_in_row_slot_order(
    triton_interpret, monkeypatch, num_hb, row0, with_len, num_keys, batch, pieces
):
    """The deterministic mode's reduction of one row chunk equals, bit for bit, a sequential fp32 sum per key over
    the chunk's valid slots in ascending (row, slot) order, each slot's head-block pieces in order, onto the running
    dkv, with int16 sort keys up to 32767 keys and int32 past them, whatever the slots read at a time
    (``DKV_REDUCE_BATCH``; runs longer and shorter than the batch) and with bf16 pieces (each added as its fp32
    value), or scaled fp16 pieces (each column's value times its piece row's scale of the column's group of 8 columns
    here); slots past the length, negative or past the last key add nothing,
    and unselected keys keep their value."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb
    from longtrain.dsa.triton.sparse_mla_bwd import _reduce_batch
    from longtrain.dsa.triton.sparse_mla_bwd_reduce import (
        ChunkRuns,
        dkv_reduce_chunk,
        dkv_reduce_keys,
        piece_group_cols,
    )

    monkeypatch.setattr(smb, "DKV_REDUCE_BATCH", batch)
    assert _reduce_batch(pieces) == batch

    g = torch.Generator().manual_seed(21)
    T, K, d_qk, rows = 9, 12, 40, 5
    idx = torch.randint(0, num_keys, (T, K), generator=g, dtype=torch.int32)
    idx[row0, :4] = torch.tensor([-1, num_keys, 2**30, -5], dtype=torch.int32)  # invalid slots
    idx[row0 + 1, :] = 2  # one key from every slot of a row
    idx[:, -1] = num_keys - 1
    length = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32) if with_len else None
    # Magnitudes over many binades, so a different order or grouping would change the fp32 bits.
    n_pieces = rows * K * num_hb
    scales = torch.exp2(torch.randint(-20, 20, (n_pieces, 1), generator=g).float())
    contrib = (torch.randn(n_pieces, d_qk, generator=g) * scales).to(pieces)
    if pieces == torch.float16:  # fp16 pieces of their own magnitude, the magnitudes in the scales
        contrib = (torch.randn(n_pieces, d_qk, generator=g) * 2**13).to(pieces)
        group_cols = piece_group_cols(32, d_qk - 32, 16, 8)  # tiles of 16 value and 8 rope columns: groups of 8
        assert group_cols == 8 and piece_group_cols(512, 64, 256, 64) == 64 and piece_group_cols(40, 8, 16, 8) == 8
        piece_scales = torch.exp2(torch.randint(-60, 20, (n_pieces, d_qk // 8), generator=g).float())
        values = contrib.float() * piece_scales.repeat_interleave(8, dim=1)
    else:
        piece_scales, group_cols = None, 0
        values = contrib.float()
    dkv = torch.randn(num_keys, d_qk, generator=g)
    expected = dkv.clone()
    for t in range(rows):
        for s in range(K):
            key = int(idx[row0 + t, s])
            if not 0 <= key < num_keys or (length is not None and s >= int(length[row0 + t])):
                continue
            for hb in range(num_hb):
                expected[key] += values[(t * K + s) * num_hb + hb]
    assert dkv_reduce_keys(idx, length, num_keys)[0].dtype == (torch.int16 if num_keys <= 32767 else torch.int32)
    runs = ChunkRuns(idx, length, num_keys, K, [(0, row0), (row0, rows), (row0 + rows, T - row0 - rows)]).take(1)
    dkv_reduce_chunk(runs, K, contrib, dkv, rows, d_qk, num_hb, _reduce_batch(pieces), 4, piece_scales, group_cols)
    assert torch.equal(dkv, expected)


def test_deterministic_reduce_warps_keep_every_bit(triton_interpret, monkeypatch):
    """``DKV_REDUCE_NUM_WARPS``: the reduction's warps per program (4 by default) leave the gradients the same bit for
    bit; a value that is not a power of two from 1 to 16 is a ValueError naming the knob."""
    import longtrain.dsa.triton.sparse_mla_bwd as smb

    assert smb.DKV_REDUCE_NUM_WARPS == 4
    q, kv, idx = _mla_inputs(6, 4, 48, 9, 24, seed=29)
    idx[:, 3:9] = 4  # many contributions to one key, from every row
    length = torch.tensor([24, 7, 0, 20, 24, 1])
    _, four = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, det=True)
    monkeypatch.setattr(smb, "DKV_REDUCE_NUM_WARPS", 8)
    _, eight = _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, det=True)
    assert torch.equal(four[0], eight[0]) and torch.equal(four[1], eight[1])
    for bad in (3, 0, 32, True, 4.0):
        monkeypatch.setattr(smb, "DKV_REDUCE_NUM_WARPS", bad)
        with pytest.raises(ValueError, match="DKV_REDUCE_NUM_WARPS must be a power of two from 1 to 16"):
            _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, det=True)


def test_deterministic_reduce_batch_default_follows_the_pieces(monkeypatch):
    """``DKV_REDUCE_BATCH = None`` (the default) is the measured choice: with bf16 pieces 8 slots at a time where a slot
    has one head block's piece and 16 where it has more, one with fp32 pieces; a value given is used as it is."""
    from longtrain.dsa.triton import sparse_mla_bwd as smb

    assert smb.DKV_REDUCE_BATCH is None
    assert smb._reduce_batch(torch.bfloat16) == 8 and smb._reduce_batch(torch.float32) == 1
    assert smb._reduce_batch(torch.bfloat16, 2) == 16 and smb._reduce_batch(torch.float32, 2) == 1
    assert smb._reduce_batch(torch.float16) == 8 and smb._reduce_batch(torch.float16, 2) == 16
    monkeypatch.setattr(smb, "DKV_REDUCE_BATCH", 2)
    assert smb._reduce_batch(torch.bfloat16) == 2 and smb._reduce_batch(torch.float32, 3) == 2


def test_chunk_runs_sort_each_chunks_slots_by_key_in_row_slot_order():
    """``ChunkRuns.take(i)``: chunk i's slots (flat positions within the chunk) grouped by key, each key's run in
    ascending (row, slot) order, key j's run ``order[run_start[j] : run_start[j + 1]]``, invalid slots after the last
    run; on the current stream without a side stream (the CPU path), in any order of chunks."""
    from longtrain.dsa.triton.sparse_mla_bwd_reduce import ChunkRuns

    g = torch.Generator().manual_seed(5)
    T, K, num_keys = 7, 6, 9
    idx = torch.randint(-2, num_keys + 2, (T, K), generator=g, dtype=torch.int32)
    length = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
    chunks = [(0, 3), (3, 3), (6, 1)]
    runs = ChunkRuns(idx, length, num_keys, K, chunks)
    for i in (2, 0, 1):
        row0, rows = chunks[i]
        order, run_start = runs.take(i)
        assert run_start.numel() == num_keys + 1
        for key in range(num_keys):
            expected = [t * K + s for t in range(rows) for s in range(K)
                        if int(idx[row0 + t, s]) == key and s < int(length[row0 + t])]  # fmt: skip
            assert order[run_start[key] : run_start[key + 1]].tolist() == expected
        assert int(run_start[-1]) == sum(
            1
            for t in range(rows)
            for s in range(K)
            if 0 <= int(idx[row0 + t, s]) < num_keys and s < int(length[row0 + t])
        )


@pytest.mark.parametrize("num_keys,dtype", [(32767, torch.int16), (32768, torch.int32)], ids=["int16-max", "int32"])
def test_deterministic_reduce_keys_dtype_boundary(num_keys, dtype):
    """The sort keys are int16 while the invalid marker (``num_keys``) still fits, int32 from 32768 keys; every valid
    key keeps its value and every invalid slot (negative, too large, past the length) becomes the marker."""
    from longtrain.dsa.triton.sparse_mla_bwd_reduce import dkv_reduce_keys

    idx = torch.tensor([[num_keys - 1, 0, -1, num_keys], [5, 2**30, num_keys - 2, 7]], dtype=torch.int32)
    length = torch.tensor([4, 3], dtype=torch.int32)
    keys, key_ids = dkv_reduce_keys(idx, length, num_keys)
    assert keys.dtype == dtype and key_ids.dtype == dtype
    assert keys.tolist() == [num_keys - 1, 0, num_keys, num_keys, 5, num_keys, num_keys - 2, num_keys]
    assert key_ids[0] == 0 and key_ids[-1] == num_keys and key_ids.numel() == num_keys + 1


def test_sparse_mla_fp16_flash_attention_rule(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    T, H, D, T_k, K = 4, 4, 48, 20, 32
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, dtype=torch.float16, seed=11)
    out = sparse_mla_triton(q, kv, idx, 0.25, d_v=32, config=_CFG)
    ref64, _ = sparse_mla_reference(q.double(), kv.double(), idx, 0.25, d_v=32)
    same_dtype, _ = sparse_mla_reference(q, kv, idx, 0.25, d_v=32)
    # Flash-attention rule: at most twice the same-dtype reference's error plus one fp16 rounding step.
    bound = 2 * (same_dtype.double() - ref64).abs().max() + ref64.abs().max() * 2.0**-11
    assert (out.double() - ref64).abs().max() <= bound


def test_sparse_mla_config_forms_and_kv_2d(triton_interpret):
    from longtrain.dsa.triton import sparse_mla_triton

    T, H, D, T_k, K = 3, 4, 32, 8, 16
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=13)
    a = sparse_mla_triton(q, kv, idx, 0.3, d_v=32, config=SparseMLAConfig(fwd=_CFG, bwd=_CFG))
    b = sparse_mla_triton(q, kv[:, 0], idx[:, None, :], 0.3, d_v=32, config=KernelConfig(block_k=32, block_h=16))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # two tilings of the same fp32 sums
    c = sparse_mla_triton(q, kv, idx, 0.3, d_v=32)  # default (interpreter) config
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["keys", "keys_logits"])
def test_sparse_mla_forward_layouts(triton_interpret, layout):
    T, H, D, T_k, K = 4, 5, 48, 11, 40
    q, kv, idx = _mla_inputs(T, H, D, T_k, K, seed=17)
    idx[1] = -1
    length = torch.tensor([40, 40, 9, 0])
    sink = torch.randn(H).requires_grad_(True)
    cfg = SparseMLAConfig(fwd=KernelConfig(block_k=16, block_h=16, num_warps=4, num_stages=1, layout=layout), bwd=_CFG)
    _check_against_reference(q, kv, idx, 0.3, d_v=32, topk_length=length, sink=sink, config=cfg)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(softmax_scale=float("nan")), TypeError, "softmax_scale"),
        (dict(softmax_scale=-1.0), TypeError, "softmax_scale"),
        (dict(d_v=40), ValueError, "d_v"),
        (dict(d_v=64), ValueError, "d_v"),
        (dict(kv_shape=(8, 2, 32)), ValueError, "one latent head"),
        (dict(kv_dtype=torch.float16), TypeError, "share a dtype"),
        (dict(idx_shape=(2, 16)), ValueError, "topk_indices"),
        (dict(idx_dtype=torch.float32), TypeError, "topk_indices"),
        (dict(topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, "topk_length"),
        (dict(attn_sink=torch.zeros(3)), ValueError, "attn_sink"),
        (dict(config="fast"), TypeError, "config"),
    ],
    ids=lambda v: str(v)[:20],
)
def test_sparse_mla_validation(triton_interpret, kwargs, exc, match):
    from longtrain.dsa.triton import sparse_mla_triton

    q = torch.randn(3, 4, 32)
    kv = torch.randn(kwargs.pop("kv_shape", (8, 1, 32)), dtype=kwargs.pop("kv_dtype", torch.float32))
    idx = torch.zeros(kwargs.pop("idx_shape", (3, 16)), dtype=kwargs.pop("idx_dtype", torch.int32))
    args = dict(softmax_scale=0.1, d_v=32)
    args.update(kwargs)
    scale = args.pop("softmax_scale")
    with pytest.raises(exc, match=match):
        sparse_mla_triton(q, kv, idx, scale, **args)


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="block_k"):
        KernelConfig(block_k=48)
    with pytest.raises(ValueError, match="num_stages"):
        KernelConfig(num_stages=0)
    with pytest.raises(ValueError, match="layout"):
        KernelConfig(layout="rows")
    with pytest.raises(ValueError, match="col_groups must be 1, 2 or 4, got 3"):
        KernelConfig(col_groups=3)
    with pytest.raises(ValueError, match="select_block"):
        IndexerConfig(select_block=100)
    with pytest.raises(TypeError, match="fwd"):
        SparseMLAConfig(fwd="x")


# ---------------------------------------------------------------------------------------------- indexer


def _doc_layout(doc_lengths, pad=0, key_offset=0):
    """starts / causal_lengths of packed causal documents (+ ``pad`` empty rows), keys shifted by key_offset."""
    starts, lengths, pos = [], [], key_offset
    for n in doc_lengths:
        starts += [pos] * n
        lengths += list(range(1, n + 1))
        pos += n
    starts += [0] * pad
    lengths += [0] * pad
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)


def _indexer_inputs(T_q, T_k, H_I, D_I, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T_q, H_I, D_I, generator=g).to(dtype)
    k = torch.randn(T_k, D_I, generator=g).to(dtype)
    w = torch.randn(T_q, H_I, generator=g)
    return q, k, w


def _assert_canonical_and_maximal(out, scores, starts, lengths, K, tol):
    """Canonical form and a maximal-score selection (against float64 scores, up to ``tol`` for near-ties)."""
    T_q = out.shape[0]
    assert out.shape == (T_q, K) and out.dtype == torch.int32
    for t in range(T_q):
        n = min(K, int(lengths[t]))
        row = out[t]
        assert torch.all(row[n:] == -1), t
        sel = row[:n].long()
        assert torch.all(sel[1:] > sel[:-1]), t  # strictly ascending
        lo, hi = int(starts[t]), int(starts[t]) + int(lengths[t])
        assert torch.all((sel >= lo) & (sel < hi)), t
        if n < int(lengths[t]):
            window = scores[t, lo:hi]
            chosen = torch.zeros(hi - lo, dtype=torch.bool)
            chosen[sel - lo] = True
            assert window[chosen].min() >= window[~chosen].max() - tol, t


@pytest.mark.parametrize(
    "docs,pad,H_I,D_I,K",
    [
        ((10, 17), 3, 2, 32, 5),  # two documents, padding rows, K below most windows
        ((40,), 0, 3, 48, 16),  # D_I not a power of two, odd head count, several key blocks per row
        ((6, 1, 4), 2, 1, 16, 8),  # every window <= K: the fast path only; a document of length 1
    ],
    ids=["two-docs-pad", "D48-H3", "all-fast-path"],
)
def test_indexer_matches_reference_exactly(triton_interpret, docs, pad, H_I, D_I, K):
    from longtrain.dsa.triton import indexer_topk_triton

    starts, lengths = _doc_layout(docs, pad)
    T = starts.shape[0]
    q, k, w = _indexer_inputs(T, T, H_I, D_I, seed=sum(docs))
    out = indexer_topk_triton(q, k, w, starts, lengths, K, config=_ICFG)
    ref = indexer_topk_reference(q.double(), k.double(), w.double(), starts, lengths, K)
    # Continuous random scores have no near-ties at this size, so the selection is the reference's exactly.
    assert torch.equal(out, ref)


def test_indexer_ties_negative_weights_and_chunks(triton_interpret):
    from longtrain.dsa.triton import indexer_topk_triton

    # Keys live at an offset of a larger gathered key tensor (context-parallel layout).
    starts, lengths = _doc_layout((30, 20), pad=2, key_offset=5)
    T_q, T_k, H_I, D_I, K = starts.shape[0], 60, 2, 32, 7
    q, k, w = _indexer_inputs(T_q, T_k, H_I, D_I, seed=21)
    w[::3] = -w[::3].abs()  # negative head weights: scores of both signs
    w[1::5] = 0.0  # all-zero rows: every eligible key ties, the smallest indices must win
    q[2::7] = -q[2::7].abs()
    k[40:] = k[40:].abs()  # with q < 0 on those rows, relu(q.k) = 0 on these keys: more ties
    cfg = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256, scratch_elements=16 * T_k)
    out = indexer_topk_triton(q, k, w, starts, lengths, K, config=cfg)
    eligible = torch.zeros(T_q, T_k, dtype=torch.bool)
    for t in range(T_q):
        eligible[t, starts[t] : starts[t] + lengths[t]] = True
    scores = indexer_scores(q.double(), k.double(), w.double(), eligible)
    _assert_canonical_and_maximal(out, scores, starts, lengths, K, tol=1e-9)
    for t in range(1, T_q, 5):  # zero-weight rows: the first min(K, L) keys of the window
        n = min(K, int(lengths[t]))
        assert torch.equal(out[t, :n].long(), torch.arange(n) + int(starts[t])), t


def test_indexer_sampled_select_is_the_exact_selection(triton_interpret):
    """Rows wider than ``select_cand`` (256 here) are bracketed from a 64-key sample and the radix select runs on the
    bracket's candidates: on a 320-token document with K = 24 the rows of 257..320 keys take that path (their bracket,
    about a quarter of the row, fits the buffer); the result equals the float64 reference and the whole-row select."""
    from longtrain.dsa.triton import indexer_topk_triton

    starts, lengths = _doc_layout((320,))
    T, H_I, D_I, K = 320, 2, 16, 24
    q, k, w = _indexer_inputs(T, T, H_I, D_I, seed=5)
    rows = slice(232, T)  # rows of 233..320 keys: both paths, a quarter of the interpreter's time
    q, w, starts, lengths = q[rows], w[rows], starts[rows], lengths[rows]
    base = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)
    sampled = indexer_topk_triton(q, k, w, starts, lengths, K, config=IndexerConfig(**base, select_sample=64,
                                                                                     select_cand=256))  # fmt: skip
    whole = indexer_topk_triton(q, k, w, starts, lengths, K, config=IndexerConfig(**base, select_sample=0,
                                                                                   select_cand=256))  # fmt: skip
    ref = indexer_topk_reference(q.double(), k.double(), w.double(), starts, lengths, K)
    assert torch.equal(sampled, ref)
    assert torch.equal(whole, ref)


def test_indexer_sampled_select_with_ties_falls_back_exactly(triton_interpret):
    """Ties everywhere: rounded inputs make many equal scores, and all-zero head weights make a whole row tie (its
    bracket is then the whole row, wider than the buffer: the whole-row radix select takes over). Both paths give
    the canonical selection, ties to the smaller index, the same as the whole-row select."""
    from longtrain.dsa.triton import indexer_topk_triton

    starts, lengths = _doc_layout((300,))
    T, H_I, D_I, K = 300, 2, 16, 20
    q, k, w = _indexer_inputs(T, T, H_I, D_I, seed=8)
    q, k, w = torch.round(q), torch.round(k), torch.round(w * 2) / 2
    w[270:285] = 0.0
    first = 232  # rows of 233..300 keys: both paths, a quarter of the interpreter's time
    q, w, starts, lengths = q[first:], w[first:], starts[first:], lengths[first:]
    base = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, select_block=256)
    sampled = indexer_topk_triton(q, k, w, starts, lengths, K, config=IndexerConfig(**base, select_sample=64,
                                                                                     select_cand=256))  # fmt: skip
    whole = indexer_topk_triton(q, k, w, starts, lengths, K, config=IndexerConfig(**base, select_sample=0,
                                                                                   select_cand=256))  # fmt: skip
    assert torch.equal(sampled, whole)
    eligible = torch.zeros(T - first, T, dtype=torch.bool)
    for t in range(first, T):
        eligible[t - first, : t + 1] = True
    scores = indexer_scores(q.double(), k.double(), w.double(), eligible)
    _assert_canonical_and_maximal(sampled, scores, starts, lengths, K, tol=0.0)
    for t in range(270, 285):  # zero-weight rows: the first K keys
        assert torch.equal(sampled[t - first].long(), torch.arange(K)), t


def test_indexer_select_config_is_validated():
    with pytest.raises(ValueError, match="num_stages"):
        IndexerConfig(num_stages=0)
    with pytest.raises(ValueError, match="scratch_elements"):
        IndexerConfig(scratch_elements=0)
    with pytest.raises(ValueError, match="select_sample"):
        IndexerConfig(select_sample=100)
    with pytest.raises(ValueError, match="at most select_cand"):
        IndexerConfig(select_sample=1024, select_cand=512)
    with pytest.raises(ValueError, match="select_cand"):
        IndexerConfig(select_cand=128)
    assert IndexerConfig(select_sample=0).select_sample == 0
    auto = IndexerConfig()
    assert [auto.resolved_select(n) for n in (1, 4096, 4097, 32768, 32769)] == [(0, 4096), (0, 4096), (512, 4096),
                                                                                (512, 4096), (1024, 4096)]  # fmt: skip
    assert IndexerConfig(select_cand=512, select_sample=256).resolved_select(10**6) == (256, 512)
    assert IndexerConfig(select_sample=0).resolved_select(10) == (0, 4096)
    with pytest.raises(ValueError, match="at most select_cand"):
        IndexerConfig(select_sample=4096, select_cand=2048)


def test_indexer_clips_windows_and_validates(triton_interpret):
    from longtrain.dsa.triton import indexer_topk_triton

    q, k, w = _indexer_inputs(4, 6, 2, 16, seed=3)
    starts = torch.tensor([0, 4, -3, 0], dtype=torch.int32)
    lengths = torch.tensor([3, 9, 2, 0], dtype=torch.int32)  # row 1 runs past T_k, row 2 starts before 0
    out = indexer_topk_triton(q, k, w, starts, lengths, 4, config=_ICFG)
    assert out.tolist() == [[0, 1, 2, -1], [4, 5, -1, -1], [-1] * 4, [-1] * 4]
    # int64 windows, one starting past T_k and one far past it: empty, like a window before 0.
    starts64 = torch.tensor([0, 6, 2**40, 5], dtype=torch.int64)
    lengths64 = torch.tensor([3, 2, 1, 2**40], dtype=torch.int64)
    out = indexer_topk_triton(q, k, w, starts64, lengths64, 4, config=_ICFG)
    assert out.tolist() == [[0, 1, 2, -1], [-1] * 4, [-1] * 4, [5, -1, -1, -1]]
    with pytest.raises(ValueError, match="index_topk"):
        indexer_topk_triton(q, k, w, starts, lengths, 4096)
    with pytest.raises(ValueError, match="head_weights"):
        indexer_topk_triton(q, k, w[:, :1], starts, lengths, 4)
    with pytest.raises(TypeError, match="share a dtype"):
        indexer_topk_triton(q, k.half(), w, starts, lengths, 4)
    with pytest.raises(ValueError, match="starts"):
        indexer_topk_triton(q, k, w, starts[:2], lengths, 4)


# ---------------------------------------------------------------------------------------------- plumbing


def test_public_ops_run_the_triton_backend_on_cpu(triton_interpret):
    if importlib.util.find_spec("longtrain.dsa.ops") is None:
        pytest.skip("longtrain.dsa.ops not present")
    from longtrain.dsa import ops

    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    q, k, w = _indexer_inputs(20, 20, 2, 32, seed=4)
    got = ops.indexer_topk(q, k, w, cu, 6, backend="triton")
    want = ops.indexer_topk(q, k, w, cu, 6, backend="torch")
    assert torch.equal(got, want)
    qa, kv, _ = _mla_inputs(20, 4, 48, 20, 6, seed=5)
    out = ops.sparse_mla_attention(qa, kv, got, 0.3, d_v=32, backend="triton")
    ref = ops.sparse_mla_attention(qa.detach(), kv.detach(), got, 0.3, d_v=32, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # fp32 kernels vs fp32 torch path
    dq, dkv = torch.autograd.grad(out.sum(), (qa, kv))
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()


def test_warmup_runs_every_kernel(triton_interpret):
    from longtrain.dsa.triton import warmup

    state = torch.get_rng_state()
    info = warmup(
        num_heads=2, d_qk=48, d_v=32, topk=8, index_heads=2, index_dim=16, dtype=torch.float32, device="cpu",
        num_tokens=20, with_sink=True,
    )  # fmt: skip
    assert info["finite"] and info["num_tokens"] == 20 and info["seconds"] >= 0
    assert "sparse_mla_bwd_kernel_dkv" in info["kernels"]
    assert torch.equal(state, torch.get_rng_state())


def test_warmup_compiles_each_default_selection_setting(triton_interpret, monkeypatch):
    """The selection kernel compiles once per (sample, candidates) pair its defaults pick by key count: the warm-up
    runs each (SELECT_BY_KEYS), so a step with another key count does not compile at step 1."""
    from longtrain.dsa.triton import indexer_topk, warmup

    seen = []
    real = indexer_topk.indexer_topk_triton

    def spy(*args, config=None, fp8=False, **kwargs):
        seen.append((config.select_sample, config.select_cand, fp8))
        return real(*args, config=config, fp8=fp8, **kwargs)

    monkeypatch.setattr(indexer_topk, "indexer_topk_triton", spy)
    info = warmup(num_heads=2, d_qk=48, d_v=32, topk=8, index_heads=2, index_dim=16, dtype=torch.float32,
                  device="cpu", num_tokens=20)  # fmt: skip
    assert seen[:3] == [
        (*IndexerConfig().resolved_select(1), False),
        (*IndexerConfig().resolved_select(8192), False),
        (*IndexerConfig().resolved_select(1 << 40), False),
    ]
    assert seen[:3] == [(0, 4096, False), (512, 4096, False), (1024, 4096, False)]
    # The FP8 scores are another variant of the scoring kernel: warmed too where they run (the interpreter here).
    assert seen[3][2] is True and info["index_fp8"] is True


def test_availability_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, reason = availability("cpu")
    if importlib.util.find_spec("triton") is None:
        assert not ok and "triton" in reason
    else:
        assert not ok and "TRITON_INTERPRET" in reason
    ok, reason = availability("meta")
    assert not ok and reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert availability("cpu") == (importlib.util.find_spec("triton") is not None, availability("cpu")[1])


def test_importing_the_package_does_not_import_triton():
    code = "import sys, longtrain.dsa, longtrain.dsa.triton; assert 'triton' not in sys.modules; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
