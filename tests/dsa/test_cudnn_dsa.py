"""The split cuDNN-frontend + FlashMLA path on CPU: every documented name, the validation rules, and the whole
call contract with fake providers installed in the module globals (head padding, top-k width padding, row
compaction, the dummy backward row, segment mapping of the indexer).

The fakes compute with the float32 reference math, so the adapter's results can also be compared with the
torch backend. The real kernels are exercised in ``tests/gpu/test_dsa_cudnn_gpu.py``.
"""

from __future__ import annotations

import inspect
import math
import types

import pytest
import torch

from longtrain import _optional
from longtrain.dsa import cudnn_dsa as cd
from longtrain.dsa import ops
from longtrain.dsa import reference as ref
from longtrain.dsa.metadata import prepare_dsa_metadata


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# --------------------------------------------------------------------------------------------- fakes


class FakeDSA:
    """Stands in for ``cudnn.DSA``: faithful segmented scores, a stable top-k (returned shuffled), and a
    backward computed by autograd on the reference."""

    def __init__(self):
        self.calls = []
        self.ranker = None  # optional scripted ranker: (values, seq_lens, top_k) -> indices

    def indexer_forward_wrapper(
        self, q, k, w, *, ratio, sm_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets
    ):
        assert q.dtype == k.dtype == w.dtype == torch.bfloat16 and k.dim() == 3 and k.shape[1] == 1
        assert ratio == 1 and sm_scale == 1.0 and q.is_contiguous() and k.is_contiguous() and w.is_contiguous()
        self.calls.append(
            dict(
                op="scores",
                keys=k[:, 0].float().clone(),
                cu_q=cu_seqlens_q.tolist(),
                cu_k=cu_seqlens_k.tolist(),
                max_q=max_seqlen_q,
                max_k=max_seqlen_k,
                offsets=q_causal_offsets.tolist(),
            )
        )
        scores = torch.full((q.shape[0], max_seqlen_k), -math.inf)
        for s in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            k0, k1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            for r in range(q0, q1):
                visible = min(int(q_causal_offsets[s]) + (r - q0) + 1, k1 - k0)
                logits = q[r].float() @ k[k0 : k0 + visible, 0].float().T  # [H, visible]
                scores[r, :visible] = (w[r].float()[:, None] * logits.clamp_min(0)).sum(0) * sm_scale
        return {"scores": scores}

    def indexer_top_k_wrapper(self, values, seq_lens, *, top_k, next_n, return_val):
        assert values.dtype == torch.float32 and seq_lens.dtype == torch.int32 and next_n == 1 and not return_val
        assert values.is_contiguous() and seq_lens.is_contiguous()
        self.calls.append(dict(op="topk", shape=tuple(values.shape), lens=seq_lens.tolist(), top_k=top_k))
        if self.ranker is not None:
            return {"indices": self.ranker(values, seq_lens, top_k), "values": None}
        out = torch.full((values.shape[0], top_k), -1, dtype=torch.int32)
        for r in range(values.shape[0]):
            n = int(seq_lens[r])
            order = torch.sort(values[r, :n], descending=True, stable=True).indices[:top_k]
            out[r, : order.numel()] = order.flip(0).to(torch.int32)  # any order: the adapter canonicalizes
        return {"indices": out, "values": None}

    def sparse_attention_backward_wrapper(self, q, kv, out, dout, lse, sink, topk_idxs, *, softmax_scale, topk_length):
        rows, heads = q.shape[:2]
        assert kv.dim() == 2 and kv.shape[1] == 576 and out.shape == dout.shape == (rows, heads, 512)
        assert lse.shape == (rows, heads) and sink.shape == (heads,) and torch.isneginf(sink).all()
        assert topk_idxs.dtype == torch.int32 and topk_idxs.shape[1] % 512 == 0 and (topk_idxs >= 0).all()
        assert topk_length.shape == (rows,) and topk_length.dtype == torch.int32
        self.calls.append(
            dict(op="backward", rows=rows, heads=heads, width=topk_idxs.shape[1], lens=topk_length.tolist(), q=q)
        )
        with torch.enable_grad():  # autograd runs backward functions with gradients disabled
            qf = q.float().requires_grad_()
            kvf = kv.float()[:, None].requires_grad_()
            o, _ = ref.sparse_mla_reference(qf, kvf, topk_idxs, softmax_scale, d_v=512, topk_length=topk_length)
            dq, dkv = torch.autograd.grad(o, (qf, kvf), dout.float())
        return {"dq": dq.bfloat16(), "dkv": dkv[:, 0].bfloat16(), "d_sink": torch.zeros(heads)}


class FakeFlashMLA:
    """Stands in for ``flash_mla_sparse_fwd``; rows with nothing to attend get NaN (the adapter zero-fills)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, kv, indices, sm_scale, *, d_v, attn_sink, topk_length, indexer_topk):
        assert q.dtype == kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1] == 1
        assert indices.dtype == torch.int32 and indices.dim() == 3 and indices.shape[1] == 1
        assert indices.shape[2] % cd._FLASH_MLA_TOPK_ALIGNMENT == 0 and indices.is_contiguous()
        assert d_v == 512 and indexer_topk == 0 and attn_sink.dtype == torch.float32
        assert attn_sink.shape == (q.shape[1],) and torch.isneginf(attn_sink).all()
        self.calls.append(dict(heads=q.shape[1], width=indices.shape[2], lens=topk_length.tolist(), q=q))
        out, lse = ref.sparse_mla_reference(
            q.float(), kv.float(), indices, sm_scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink
        )
        empty = (topk_length == 0)[:, None]
        out = out.masked_fill(empty[..., None], math.nan)
        lse = torch.where(empty, math.inf, lse)
        return out.bfloat16(), lse.clone(), lse


@pytest.fixture
def fakes(monkeypatch):
    dsa, fwd = FakeDSA(), FakeFlashMLA()
    ns = types.SimpleNamespace(dsa=dsa, fwd=fwd, capability=(9, 0), operations=[])

    def require(operation, *tensors):
        assert operation in ("cuDNN DSA indexer", "cuDNN DSA sparse attention")
        ns.operations.append(operation)
        return ns.capability

    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", True)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", True)
    monkeypatch.setattr(cd, "_CUDNN_DSA", dsa)
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", fwd)
    monkeypatch.setattr(cd, "_require_cuda_tensors", require)
    return ns


# --------------------------------------------------------------------------------------------- names


def test_documented_names_constants_and_signatures():
    assert cd.__all__ == [
        "CudnnDsaPackedMetadata",
        "cudnn_indexer_topk",
        "cudnn_sparse_attention",
        "is_cudnn_dsa_available",
        "prepare_cudnn_dsa_packed_metadata",
    ]
    assert (cd._ATTENTION_HEAD_DIM, cd._VALUE_HEAD_DIM, cd._INDEX_HEAD_DIM, cd._MAX_TOPK) == (576, 512, 128, 2048)
    assert cd._FLASH_MLA_TOPK_ALIGNMENT == cd._TOPK_ROW_ALIGNMENT == 512
    assert cd._TOPK_SCRATCH_INT32_FACTOR == 2 and cd._TOPK_SCRATCH_LIMIT_BYTES == 2 * 1024**3
    params = {
        "prepare_cudnn_dsa_packed_metadata": [
            "cu_seqlens",
            "total_key_tokens",
            "max_seqlen",
            "query_indices",
            "cu_seqlens_padded",
            "padding_mask",
        ],
        "_unpack_packed_metadata": ["packed_metadata", "total_query_tokens", "total_key_tokens", "device"],
        "cudnn_indexer_topk": [
            "index_q",
            "index_k",
            "head_weights",
            "cu_seqlens",
            "index_topk",
            "query_indices",
            "cu_seqlens_padded",
            "packed_metadata",
        ],
        "cudnn_sparse_attention": [
            "q",
            "kv_latent",
            "topk_indices",
            "softmax_scale",
            "topk_length",
            "all_rows_nonempty",
            "valid_row_indices",
        ],
        "_compact_and_sort_indices": ["indices", "key_count"],
        "_pad_attention_heads": ["q", "attn_sink", "padded_heads"],
        "_padded_head_count": ["num_heads", "major"],
        "_topk_wrapper_chunked": ["scores", "seq_lens", "topk"],
        "_validate_topk": ["index_topk"],
        "_require_cuda_tensors": ["operation", "tensors"],
    }
    for name, expected in params.items():
        assert list(inspect.signature(getattr(cd, name)).parameters) == expected, name
    forward = list(inspect.signature(cd._CudnnSparseAttention.forward).parameters)
    assert forward == [
        "ctx",
        "q",
        "kv_latent",
        "topk_indices",
        "softmax_scale",
        "padded_heads",
        "topk_length",
        "all_rows_nonempty",
        "valid_row_indices",
    ]
    assert issubclass(cd._CudnnSparseAttention, torch.autograd.Function)


def test_importing_the_module_imports_no_optional_package():
    import subprocess
    import sys

    code = (
        "import sys; import longtrain.dsa.cudnn_dsa; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cudnn', 'flash_mla', 'triton')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


# --------------------------------------------------------------------------------------------- availability


@pytest.mark.parametrize("has_cudnn,has_mla", [(False, False), (True, False), (False, True), (True, True)])
def test_availability_needs_both_libraries(monkeypatch, has_cudnn, has_mla):
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", has_cudnn)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", has_mla)
    available = cd.is_cudnn_dsa_available()
    assert available is (has_cudnn and has_mla)
    if available:
        cd._require_available()
    else:
        with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
            cd._require_available()


def test_availability_is_probed_lazily_through_longtrain_optional(monkeypatch):
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", None)
    monkeypatch.setattr(cd, "_HAS_FLASH_MLA", None)
    expected = _optional.cudnn_dsa()[0] and _optional.flash_mla()[0]
    assert cd.is_cudnn_dsa_available() is expected
    assert isinstance(cd._HAS_CUDNN_DSA, bool)  # probed and cached


class _LazyDSA:
    """``cudnn.DSA`` as frontend 1.32 builds it: an object whose ``__getattr__`` imports a symbol's module on first
    use. ``missing`` is the module that import fails on (``cutlass.cute`` without the cutedsl extra), or None."""

    def __init__(self, missing: str | None):
        self.missing = missing

    def __getattr__(self, name):
        if name not in _optional.CUDNN_DSA_SYMBOLS:
            raise AttributeError(f"DSA has no attribute {name!r}")
        if self.missing is not None:
            raise ModuleNotFoundError(f"No module named {self.missing!r}")
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("missing", [None, "cutlass.cute"], ids=["cutedsl", "without-cutedsl"])
def test_the_probe_imports_the_symbols_it_calls(monkeypatch, missing):
    """A frontend whose DSA namespace resolves but whose kernels cannot import (the cutedsl extra missing) is
    unavailable: `auto` must not route a backward to it and then fail at call time."""
    import importlib.machinery
    import sys

    fake = types.ModuleType("cudnn")
    fake.__spec__ = importlib.machinery.ModuleSpec("cudnn", None)
    fake.DSA = _LazyDSA(missing)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", None)
    _optional.reset_probe_cache()
    try:
        ok, reason = _optional.cudnn_dsa()
        assert cd._has_cudnn_dsa() is ok
        if missing is None:
            assert ok and reason == ""
        else:
            assert not ok
            assert "cutlass.cute" in reason and "nvidia-cudnn-frontend[cutedsl]" in reason
            from longtrain.dsa import routes

            assert routes.cudnn_absent(torch.device("cuda")) == reason
    finally:
        monkeypatch.undo()
        _optional.reset_probe_cache()


def test_require_available_is_the_first_check_even_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(cd, "_HAS_CUDNN_DSA", False)
    with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
        cd.cudnn_indexer_topk(torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), "bad")
    with pytest.raises(RuntimeError, match="requires both nvidia-cudnn-frontend"):
        cd.cudnn_sparse_attention(torch.empty(0), torch.empty(0), torch.empty(0), math.nan)


def _old_frontend_without_dsa():
    import importlib.machinery

    fake = types.ModuleType("cudnn")  # a frontend that predates the DSA API: `cudnn.DSA` is missing
    fake.__spec__ = importlib.machinery.ModuleSpec("cudnn", None)
    return fake


def _flash_mla_without_sparse_fwd():
    import importlib.machinery

    fake = types.ModuleType("flash_mla")  # a FlashMLA build without the sparse prefill entry point
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_mla", None)
    return fake


@pytest.mark.parametrize(
    "package,fake,call,match",
    [
        ("cudnn", None, lambda: cd._topk_wrapper_chunked(torch.zeros(2, 4), i32([1, 2]), 1), "DSA is unavailable"),
        ("cudnn", _old_frontend_without_dsa, lambda: cd._cudnn_dsa(), "cuDNN DSA is unavailable"),
        ("flash_mla", None, lambda: cd._flash_mla_sparse_fwd(), "flash_mla_sparse_fwd\\) is unavailable"),
        ("flash_mla", _flash_mla_without_sparse_fwd, lambda: cd._flash_mla_sparse_fwd(), "is unavailable"),
    ],
    ids=["topk-chunked-no-cudnn", "cudnn-without-DSA", "no-flash-mla", "flash-mla-without-sparse-fwd"],
)
def test_private_helpers_without_the_package_raise_a_clear_runtime_error(monkeypatch, package, fake, call, match):
    """The private helpers reach the providers directly (no `_require_available` in front): a missing package or a
    build without the entry point is a RuntimeError saying why, never a bare ImportError / AttributeError."""
    import sys

    monkeypatch.setitem(sys.modules, package, fake() if fake is not None else None)  # None: `import` raises
    monkeypatch.setattr(cd, "_CUDNN_DSA", None)
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", None)
    _optional.reset_probe_cache()  # the message's reason comes from the (cached) probe: probe the fake, then forget
    try:
        with pytest.raises(RuntimeError, match=match) as info:
            call()
        assert isinstance(info.value.__cause__, (ImportError, AttributeError))
        assert cd._CUDNN_DSA is None and cd._FLASH_MLA_SPARSE_FWD is None  # nothing half-resolved is cached
    finally:
        monkeypatch.undo()
        _optional.reset_probe_cache()


def test_require_cuda_tensors(monkeypatch):
    with pytest.raises(RuntimeError, match="^op requires CUDA tensors.$"):
        cd._require_cuda_tensors("op")
    with pytest.raises(RuntimeError, match="^op requires CUDA tensors.$"):
        cd._require_cuda_tensors("op", torch.zeros(1))

    def cuda_like(index):  # only .is_cuda and .device are read
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))

    capability = {0: (9, 0), 1: (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device.index])
    assert cd._require_cuda_tensors("op", cuda_like(0), cuda_like(0)) == (9, 0)
    with pytest.raises(ValueError, match="^op requires every tensor on the same CUDA device.$"):
        cd._require_cuda_tensors("op", cuda_like(0), cuda_like(1))
    with pytest.raises(RuntimeError, match="^op requires SM90 or later, got SM86.$"):
        cd._require_cuda_tensors("op", cuda_like(1))


@pytest.mark.parametrize(
    "value,exc,match",
    [
        (True, TypeError, "index_topk must be an int, got bool"),
        (2.0, TypeError, "must be an int"),
        (torch.tensor(3), TypeError, "must be an int"),
        (0, ValueError, r"must be in \[1, 2048\], got 0"),
        (2049, ValueError, r"must be in \[1, 2048\], got 2049"),
    ],
)
def test_validate_topk(value, exc, match):
    with pytest.raises(exc, match=match):
        cd._validate_topk(value)


def test_validate_topk_accepts_the_range():
    for value in (1, 64, 2048):
        cd._validate_topk(value)


# --------------------------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "major,heads,padded",
    [(9, 8, 64), (9, 64, 64), (9, 128, 128), (9, 192, 192), (10, 8, 64), (10, 16, 64), (10, 64, 64)]
    + [(10, 128, 128), (10, 256, 256), (12, 32, 64)],
)
def test_padded_head_count(major, heads, padded):
    assert cd._padded_head_count(heads, major) == padded


@pytest.mark.parametrize("major,heads,alignment", [(9, 48, 64), (9, 96, 64), (10, 96, 128), (10, 192, 128)])
def test_padded_head_count_rejects(major, heads, alignment):
    with pytest.raises(ValueError, match=f"divide {alignment}, got H={heads}"):
        cd._padded_head_count(heads, major)


def test_pad_attention_heads():
    q = torch.randn(3, 4, 576).bfloat16()
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    same_q, same_sink = cd._pad_attention_heads(q, sink, 4)
    assert same_q is q and same_sink is sink
    padded_q, padded_sink = cd._pad_attention_heads(q, sink, 64)
    assert padded_q.shape == (3, 64, 576) and padded_q.dtype == q.dtype
    assert torch.equal(padded_q[:, :4], q) and (padded_q[:, 4:] == 0).all()
    assert torch.equal(padded_sink[:4], sink) and torch.isneginf(padded_sink[4:]).all()


def test_compact_and_sort_indices():
    indices = torch.tensor([[5, -1, 2, 2], [9, 0, 7, -3], [-1, -1, -1, -1], [3, 1, 0, 2]])
    canonical, lengths = cd._compact_and_sort_indices(indices, 8)
    assert canonical.dtype == lengths.dtype == torch.int32
    assert canonical.is_contiguous() and lengths.is_contiguous()
    assert canonical.tolist() == [[2, 2, 5, -1], [0, 7, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3]]
    assert lengths.tolist() == [3, 2, 0, 4]


@pytest.mark.parametrize(
    "limit_rows,rows,width,chunks",
    [(300, 1000, 8, [300, 300, 300, 100]), (1100, 2500, 8, [1024, 1024, 452]), (5, 3, 8, [3]), (0, 4, 8, [1] * 4)],
    ids=["unaligned", "aligned_to_512", "one_launch", "at_least_one_row"],
)
def test_topk_wrapper_chunked_bounds_scratch(fakes, monkeypatch, limit_rows, rows, width, chunks):
    monkeypatch.setattr(cd, "_TOPK_SCRATCH_LIMIT_BYTES", limit_rows * width * 4 * 2)
    scores = torch.randn(rows, width)
    lens = torch.randint(1, width + 1, (rows,), dtype=torch.int32)
    out = cd._topk_wrapper_chunked(scores, lens, 3)
    assert [c["shape"][0] for c in fakes.dsa.calls] == chunks
    assert out.shape == (rows, 3) and out.dtype == torch.int32
    # Chunking is invisible: the same rows in one launch give the same answer.
    monkeypatch.setattr(cd, "_TOPK_SCRATCH_LIMIT_BYTES", 2 * 1024**3)
    assert torch.equal(cd._topk_wrapper_chunked(scores, lens, 3), out)


def test_topk_rows_per_launch_for_documented_widths():
    # S_max=4096 -> 65536 rows/launch; 32768 -> 8192; 200000 -> 1024; 10**6 -> 268.
    for width, rows in ((4096, 65536), (32768, 8192), (200_000, 1024), (10**6, 268)):
        per_row = width * 4 * cd._TOPK_SCRATCH_INT32_FACTOR
        got = max(1, cd._TOPK_SCRATCH_LIMIT_BYTES // per_row)
        got = got - got % cd._TOPK_ROW_ALIGNMENT if got >= cd._TOPK_ROW_ALIGNMENT else got
        assert got == rows


# --------------------------------------------------------------------------------------------- indexer


def _bf16_inputs(rows, keys, heads=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Small integers and quarter-step weights: exact in bf16 and in fp32 sums, so scores are exact everywhere.
    q = torch.randint(-3, 4, (rows, heads, 128), generator=gen).bfloat16()
    k = torch.randint(-3, 4, (keys, 128), generator=gen).bfloat16()
    w = torch.randint(0, 8, (rows, heads), generator=gen).float() / 4
    return q, k, w


def _scripted(rows):
    def ranker(values, seq_lens, top_k):
        return torch.tensor(rows, dtype=torch.int32)

    return ranker


def test_example_c_canonicalization(fakes):
    fakes.dsa.ranker = _scripted([[0, 2], [1, 0], [0, -1], [1, 0], [2, 0]])
    q, k, w = _bf16_inputs(5, 5)
    out = cd.cudnn_indexer_topk(q, k, w, i32([0, 2, 5]), 2)
    assert out.shape == (5, 1, 2) and out.dtype == torch.int32 and out.is_contiguous()
    assert out[:, 0].tolist() == [[0, -1], [0, 1], [2, -1], [2, 3], [2, 4]]
    assert fakes.dsa.calls[-1]["lens"] == [1, 2, 1, 2, 3]
    assert fakes.operations == ["cuDNN DSA indexer"]


def test_example_d_cp_segment_mapping(fakes):
    fakes.dsa.ranker = _scripted([[2, 0], [3, 1]])
    q, k, w = _bf16_inputs(2, 8)
    out = cd.cudnn_indexer_topk(q, k, w, i32([0, 4, 8]), 2, query_indices=torch.tensor([6, 7]))
    scores_call, topk_call = fakes.dsa.calls
    assert scores_call["cu_q"] == [0, 2] and scores_call["cu_k"] == [0, 4] and scores_call["offsets"] == [2]
    assert (scores_call["max_q"], scores_call["max_k"]) == (2, 4)
    assert torch.equal(scores_call["keys"], k[4:8].float())  # gathered key rows 4..7
    assert topk_call["lens"] == [3, 4]
    assert out[:, 0].tolist() == [[4, 6], [5, 7]]


def test_example_e_padded_cp_rows(fakes):
    fakes.dsa.ranker = lambda values, lens, top_k: torch.tensor([[0, 1]] * values.shape[0], dtype=torch.int32)
    meta = prepare_dsa_metadata(
        i32([0, 3, 7, 9]), 12, query_indices=torch.arange(2, 10), cu_seqlens_padded=i32([0, 4, 9, 12])
    )
    q, k, w = _bf16_inputs(8, 12)
    out = cd.cudnn_indexer_topk(q, k, w, i32([0, 3, 7, 9]), 2, packed_metadata=meta)
    assert out[:, 0].tolist() == [[0, 1], [-1, -1], [4, -1], [4, 5], [4, 5], [4, 5], [-1, -1], [9, -1]]
    assert fakes.dsa.calls[-1]["lens"] == [3, 1, 1, 2, 3, 4, 1, 1]


def test_topk_covering_every_document_skips_the_ranker(fakes):
    q, k, w = _bf16_inputs(6, 6)
    out = cd.cudnn_indexer_topk(q, k, w, i32([0, 2, 6]), 5)
    assert [c["op"] for c in fakes.dsa.calls] == ["scores"]  # scores still computed, ranking skipped
    assert out[:, 0].tolist() == [
        [0, -1, -1, -1, -1],
        [0, 1, -1, -1, -1],
        [2, -1, -1, -1, -1],
        [2, 3, -1, -1, -1],
        [2, 3, 4, -1, -1],
        [2, 3, 4, 5, -1],
    ]


@pytest.mark.parametrize(
    "real,padded,first,count,k",
    [
        ([5, 9, 1], None, 0, 15, 3),
        ([5, 9, 1], [8, 10, 2], 0, 20, 4),
        ([5, 9, 1], [8, 10, 2], 6, 10, 2),
        ([13], [16], 8, 8, 6),
    ],
    ids=["cp1", "padded", "cp_window", "one_doc_window"],
)
def test_indexer_matches_the_torch_backend(fakes, real, padded, first, count, k):
    cu = i32([0, *torch.tensor(real).cumsum(0).tolist()])
    cu_p = None if padded is None else i32([0, *torch.tensor(padded).cumsum(0).tolist()])
    total = sum(padded or real)
    q, keys, w = _bf16_inputs(count, total, seed=count)
    query = torch.arange(first, first + count) if count != total else None
    out = cd.cudnn_indexer_topk(q, keys, w, cu, k, query_indices=query, cu_seqlens_padded=cu_p)
    # The adapter rounds the weights to bf16 (exact here), the torch backend keeps them: same scores.
    want = ops.indexer_topk(
        q.float(), keys.float(), w, cu, k, query_indices=query, cu_seqlens_padded=cu_p, backend="torch"
    )
    assert torch.equal(out[:, 0], want)


def _indexer_call(**changes):
    q, k, w = _bf16_inputs(4, 4)
    args = dict(index_q=q, index_k=k, head_weights=w, cu_seqlens=i32([0, 4]), index_topk=2)
    args.update(changes)
    return args


_BAD_INDEXER = [
    ("topk_type", dict(index_topk=2.0), TypeError, "index_topk must be an int"),
    ("topk_range", dict(index_topk=4096), ValueError, r"\[1, 2048\]"),
    ("q_dtype", dict(index_q=torch.zeros(4, 32, 128)), TypeError, "bf16"),
    ("k_dtype", dict(index_k=torch.zeros(4, 128)), TypeError, "bf16"),
    ("w_dtype", dict(head_weights=torch.zeros(4, 32, dtype=torch.float64)), TypeError, "fp32 or bf16"),
    ("q_dim", dict(index_q=torch.zeros(4, 32, 64).bfloat16()), ValueError, "index_q must be"),
    ("k_dim", dict(index_k=torch.zeros(4, 64).bfloat16()), ValueError, "index_k must be"),
    ("w_shape", dict(head_weights=torch.zeros(4, 16)), ValueError, "head_weights must be"),
    (
        "heads",
        dict(index_q=torch.zeros(4, 16, 128).bfloat16(), head_weights=torch.zeros(4, 16)),
        ValueError,
        r"supports H_index in \(32, 64\), got 16",
    ),
    ("bad_layout", dict(cu_seqlens=i32([0, 5])), ValueError, "total_key_tokens=4"),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_INDEXER, ids=[b[0] for b in _BAD_INDEXER])
def test_indexer_validation(fakes, name, changes, exc, match):
    with pytest.raises(exc, match=match):
        cd.cudnn_indexer_topk(**_indexer_call(**changes))


def test_indexer_with_metadata_never_reads_the_layout_arguments(fakes):
    meta = prepare_dsa_metadata(i32([0, 4]), 4)
    out = cd.cudnn_indexer_topk(**_indexer_call(cu_seqlens=i32([0, 1, 2])), packed_metadata=meta)
    assert out.shape == (4, 1, 2)
    with pytest.raises(ValueError, match="packed starts"):
        cd.cudnn_indexer_topk(**_indexer_call(), packed_metadata=prepare_dsa_metadata(i32([0, 5]), 5))


# --------------------------------------------------------------------------------------------- sparse attention


def _sparse_inputs(rows=5, heads=4, keys=7, width=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, heads, 576, generator=gen) / 8).bfloat16().requires_grad_()
    kv = (torch.randn(keys, 1, 576, generator=gen) / 8).bfloat16().requires_grad_()
    idx = torch.randint(0, keys, (rows, width), generator=gen).sort(dim=1).values.to(torch.int32)
    return q, kv, idx


def _reference_grads(q, kv, idx, scale, lengths, grad):
    qf = q.detach().float().requires_grad_()
    kvf = kv.detach().float().requires_grad_()
    out, _ = ref.sparse_mla_reference(qf, kvf, idx, scale, d_v=512, topk_length=lengths)
    dq, dkv = torch.autograd.grad(out, (qf, kvf), grad.float())
    return out, dq, dkv


def _assert_bf16_close(actual, expected):
    # The fakes run in fp32 and round to bf16 once; padding and compaction reorder fp32 sums (~1 bf16 ulp).
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-10)


@pytest.mark.parametrize("mode", ["canonicalize", "all_rows_nonempty", "cached_rows", "lengths_only"], ids=lambda m: m)
def test_split_attention_forward_backward_and_row_compaction(fakes, mode):
    q, kv, idx = _sparse_inputs()
    lengths = torch.tensor([6, 3, 0, 1, 0], dtype=torch.int32)
    if mode == "all_rows_nonempty":
        lengths = torch.tensor([6, 3, 2, 1, 4], dtype=torch.int32)
    slot = torch.arange(idx.shape[1])
    canonical = torch.where(slot[None] < lengths[:, None], idx, -1).to(torch.int32)
    kwargs = {}
    if mode == "all_rows_nonempty":
        kwargs = dict(topk_length=lengths, all_rows_nonempty=True)
    elif mode == "cached_rows":
        kwargs = dict(topk_length=lengths, valid_row_indices=torch.tensor([0, 1, 3]))
    elif mode == "lengths_only":
        kwargs = dict(topk_length=lengths)
    scale = 0.0417
    out = cd.cudnn_sparse_attention(q, kv, canonical[:, None], scale, **kwargs)
    assert out.shape == (5, 4, 512) and out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    grad = torch.randn(out.shape).bfloat16()
    out.backward(grad)
    want_out, want_dq, want_dkv = _reference_grads(q, kv, idx, scale, lengths, grad)
    _assert_bf16_close(out, want_out)
    _assert_bf16_close(q.grad, want_dq)
    _assert_bf16_close(kv.grad, want_dkv)
    empty = (lengths == 0).nonzero().flatten()
    assert (out[empty] == 0).all() and (q.grad[empty] == 0).all()
    fwd, bwd = fakes.fwd.calls[-1], fakes.dsa.calls[-1]
    assert fwd["heads"] == 64 and fwd["width"] == 512  # SM90: 4 heads -> 64; K=6 -> 512
    assert bwd["heads"] == 64 and bwd["width"] == 512
    assert bwd["rows"] == (5 if mode == "all_rows_nonempty" else 3)
    assert fakes.operations == ["cuDNN DSA sparse attention"]


def test_split_attention_all_rows_empty_uses_one_dummy_backward_row(fakes):
    q, kv, idx = _sparse_inputs(rows=3)
    empty = torch.full((3, 1, 6), -1, dtype=torch.int32)
    out = cd.cudnn_sparse_attention(q, kv, empty, 0.1)
    assert (out == 0).all()
    out.backward(torch.ones_like(out))
    call = fakes.dsa.calls[-1]
    assert call["rows"] == 1 and call["lens"] == [1] and (call["q"] == 0).all()
    assert (q.grad == 0).all() and (kv.grad == 0).all()


@pytest.mark.parametrize(
    "capability,heads,padded,width,padded_width",
    [((9, 0), 128, 128, 512, 512), ((9, 0), 64, 64, 513, 1024), ((10, 0), 8, 64, 2048, 2048)],
)
def test_split_attention_pads_heads_and_width_per_generation(fakes, capability, heads, padded, width, padded_width):
    fakes.capability = capability
    q, kv, _ = _sparse_inputs(rows=2, heads=heads, width=1)
    idx = torch.full((2, 1, width), -1, dtype=torch.int32)
    idx[:, 0, :3] = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = cd.cudnn_sparse_attention(q, kv, idx, 0.05)
    assert out.shape == (2, heads, 512)
    assert fakes.fwd.calls[-1]["heads"] == padded and fakes.fwd.calls[-1]["width"] == padded_width
    assert fakes.fwd.calls[-1]["lens"] == [3, 3]


def _sparse_call(**changes):
    q, kv, idx = _sparse_inputs(rows=3)
    args = dict(q=q, kv_latent=kv, topk_indices=idx[:, None], softmax_scale=0.1)
    args.update(changes)
    return args


_L = torch.tensor([1, 1, 1], dtype=torch.int32)
_BAD_SPARSE = [
    ("q_dtype", dict(q=torch.zeros(3, 4, 576)), TypeError, "bf16"),
    ("kv_dtype", dict(kv_latent=torch.zeros(7, 1, 576)), TypeError, "bf16"),
    ("idx_dtype", dict(topk_indices=torch.zeros(3, 1, 6, dtype=torch.int64)), TypeError, "int32"),
    ("q_dim", dict(q=torch.zeros(3, 4, 512).bfloat16()), ValueError, "q must be"),
    ("kv_dim", dict(kv_latent=torch.zeros(7, 2, 576).bfloat16()), ValueError, "kv_latent must be"),
    ("idx_layout", dict(topk_indices=torch.zeros(3, 6, dtype=torch.int32)), ValueError, "topk_indices must be"),
    ("idx_rows", dict(topk_indices=torch.zeros(2, 1, 6, dtype=torch.int32)), ValueError, "topk_indices must be"),
    ("idx_width", dict(topk_indices=torch.zeros(3, 1, 2049, dtype=torch.int32)), ValueError, r"\[1, 2048\]"),
    ("scale_nan", dict(softmax_scale=math.nan), TypeError, "finite"),
    ("scale_inf", dict(softmax_scale=math.inf), TypeError, "finite"),
    ("scale_str", dict(softmax_scale="0.1"), TypeError, "finite"),
    ("scale_zero", dict(softmax_scale=0.0), ValueError, "positive"),
    ("nonempty_type", dict(all_rows_nonempty=1), TypeError, "all_rows_nonempty must be a bool"),
    (
        "nonempty_with_rows",
        dict(all_rows_nonempty=True, valid_row_indices=torch.tensor([0])),
        ValueError,
        "must be None",
    ),
    ("len_dtype", dict(topk_length=_L.long()), ValueError, "topk_length must be int32"),
    ("len_shape", dict(topk_length=_L[:2]), ValueError, "topk_length must be int32"),
    ("len_noncontig", dict(topk_length=torch.ones(6, dtype=torch.int32)[::2]), ValueError, "contiguous"),
    ("rows_without_len", dict(valid_row_indices=torch.tensor([0])), ValueError, "requires topk_length"),
    ("rows_dtype", dict(topk_length=_L, valid_row_indices=torch.tensor([0], dtype=torch.int32)), ValueError, "int64"),
    ("rows_too_many", dict(topk_length=_L, valid_row_indices=torch.arange(4)), ValueError, "more than the 3"),
    (
        "heads",
        dict(q=torch.zeros(3, 48, 576).bfloat16()),
        ValueError,
        "divide 64, got H=48",
    ),
]


@pytest.mark.parametrize("name,changes,exc,match", _BAD_SPARSE, ids=[b[0] for b in _BAD_SPARSE])
def test_split_attention_validation(fakes, name, changes, exc, match):
    with pytest.raises(exc, match=match):
        cd.cudnn_sparse_attention(**_sparse_call(**changes))
    assert fakes.fwd.calls == []


def test_bool_scale_is_accepted_as_one(fakes):
    out = cd.cudnn_sparse_attention(**_sparse_call(softmax_scale=True))
    assert out.shape == (3, 4, 512)


def test_provider_globals_are_looked_up_at_call_time(fakes, monkeypatch):
    other = FakeFlashMLA()
    monkeypatch.setattr(cd, "_FLASH_MLA_SPARSE_FWD", other)
    cd.cudnn_sparse_attention(**_sparse_call())
    assert len(other.calls) == 1 and fakes.fwd.calls == []
