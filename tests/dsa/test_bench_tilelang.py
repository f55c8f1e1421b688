"""``longtrain.bench_suites.tilelang_baseline``: why TileLang's kernels cannot run, the layout they take, and the
rows the DSA benchmark gets from them, on CPU with stand-in example modules that keep the examples' signatures."""

from __future__ import annotations

import sys
import textwrap

import torch

from longtrain.bench_suites import tilelang_baseline as tb

_FAKES = {
    "sparse_mla_fwd_pipelined.py": """
        from _tl_fake_ref import reference

        def sparse_mla_fwd_interface(q, kv, indices, q_start_index_s, kv_stride, sm_scale=None, is_casual=True,
                                     return_kernel=False, print_kernel=False):
            assert q_start_index_s == 0 and kv_stride == 1 and return_kernel

            def kernel(q, kv, indices, start):
                assert start.tolist() == [0]
                return reference(q, kv, indices)

            return kernel
    """,
    "sparse_mla_fwd.py": """
        from _tl_fake_ref import reference

        def sparse_mla_fwd_interface(q, kv, indices, sm_scale=None):
            return reference(q, kv, indices)
    """,
    "sparse_mla_bwd.py": """
        import torch

        def preprocess(batch, seq, heads, d_v):
            return lambda out, do: (out.float() * do.float()).sum(-1)

        def bwd(batch, seq, seq_kv, heads, d_v, d_tail, topk, kv_group, sm_scale, is_causal):
            assert (d_v, d_tail, kv_group, is_causal) == (512, 64, 1, True)
            return lambda q, kv, do, indices, lse, delta, dkv: torch.zeros_like(q)
    """,
    "_tl_fake_ref.py": '''
        import torch
        from longtrain.dsa.reference import sparse_mla_reference

        def reference(q, kv, indices):
            """TileLang's layout in and out: [1, T, H, D], [1, T, 1, D], [1, T, 1, K] with T for no key."""
            total = q.shape[1]
            assert q.dim() == kv.dim() == indices.dim() == 4 and indices.dtype == torch.int32
            idx = torch.where(indices[0, :, 0] >= total, -1, indices[0, :, 0])
            out, lse = sparse_mla_reference(q[0].float(), kv[0].float(), idx, 576**-0.5, d_v=512)
            return out[None].to(q.dtype), lse[None]
    ''',
}


def _inputs(total=6, heads=2, topk=4):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, heads, 576, generator=g)
    kv = torch.randn(total, 1, 576, generator=g)
    idx = torch.full((total, topk), -1, dtype=torch.int32)
    for t in range(total):
        keys = torch.randperm(t + 1, generator=g)[:topk].sort().values
        idx[t, : len(keys)] = keys.to(torch.int32)
    return q, kv, idx


def test_inputs_take_tilelangs_layout():
    q, kv, idx = _inputs()
    q4, kv4, ind = tb.tilelang_inputs(q, kv, idx)
    assert q4.shape == (1, 6, 2, 576) and kv4.shape == (1, 6, 1, 576) and ind.shape == (1, 6, 1, 4)
    assert ind.dtype == torch.int32 and ind.is_contiguous()
    assert torch.equal(ind[0, :, 0], torch.where(idx >= 0, idx, 6))  # no key: T, past every causal window
    assert torch.equal(q4[0], q) and torch.equal(kv4[0], kv)


def test_each_missing_piece_has_its_reason(monkeypatch, tmp_path):
    real = tb.importlib.util.find_spec
    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: None if name == "tilelang" else real(name))
    assert "tilelang not installed" in tb.tilelang_unavailable()
    monkeypatch.setattr(tb.importlib.util, "find_spec", lambda name: object() if name == "tilelang" else real(name))
    monkeypatch.delenv(tb.EXAMPLES_ENV, raising=False)
    assert f"{tb.EXAMPLES_ENV} is not set" in tb.tilelang_unavailable()
    monkeypatch.setenv(tb.EXAMPLES_ENV, str(tmp_path))
    (tmp_path / "sparse_mla_fwd.py").write_text("")
    assert "lacks sparse_mla_fwd_pipelined.py, sparse_mla_bwd.py" in tb.tilelang_unavailable()
    for name in tb._FILES:
        (tmp_path / name).write_text("")
    monkeypatch.setattr(tb.torch.cuda, "is_available", lambda: False)
    assert tb.tilelang_unavailable() == "needs CUDA"


def test_unavailable_baseline_is_a_row_with_its_reason(monkeypatch):
    monkeypatch.setattr(tb, "tilelang_unavailable", lambda: "tilelang not installed (test)")
    rows = []
    q, kv, idx = _inputs()
    tb.tilelang_rows(lambda **r: rows.append(r), None, q, kv, idx, None, None, "shape", 1.0, 1.0)
    assert [r["op"] for r in rows] == ["sparse_mla_fwd", "sparse_mla_bwd"]
    assert all(r["note"] == "unavailable: tilelang not installed (test)" for r in rows)


def test_rows_call_the_examples_interfaces_and_compare_with_ours(monkeypatch, tmp_path):
    """Stand-ins with the examples' signatures: the pipelined kernel through ``return_kernel=True`` and a start
    index, the simple forward, the backward's preprocess / bwd kernels; each forward's output is checked against
    ours (equal here), and a stand-in that raises is a failed row, not a crash."""
    from longtrain.dsa.reference import sparse_mla_reference

    for name, text in _FAKES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.setenv(tb.EXAMPLES_ENV, str(tmp_path))
    monkeypatch.setattr(tb, "tilelang_unavailable", lambda: None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("sparse_mla_fwd_pipelined", "sparse_mla_fwd", "sparse_mla_bwd", "_tl_fake_ref"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    q, kv, idx = _inputs()
    ours, _ = sparse_mla_reference(q, kv, idx, 576**-0.5, d_v=512)
    rows = []
    bench = lambda fn: (fn(), (2.0, 1.9, 2.1))[1]  # noqa: E731
    tb.tilelang_rows(lambda **r: rows.append(r), bench, q, kv, idx, ours, torch.randn_like(ours), "s", 8e9, 4e9)
    assert [r["impl"].split(" ")[1] for r in rows] == [
        "sparse_mla_fwd_pipelined.py", "sparse_mla_fwd.py", "sparse_mla_bwd.py"]  # fmt: skip
    assert all("failed" not in str(r.get("note")) for r in rows), rows
    assert [r["tflops"] for r in rows] == [4.0, 4.0, 2.0]
    for r in rows[:2]:
        assert r["note"].startswith("max relative difference from ours") and float(r["note"].split()[-1]) < 1e-6
    raising = "def sparse_mla_fwd_interface(*a, **k):\n    raise RuntimeError('no')\n"
    (tmp_path / "sparse_mla_fwd.py").write_text(raising)
    monkeypatch.delitem(sys.modules, "sparse_mla_fwd", raising=False)
    rows.clear()
    tb.tilelang_rows(lambda **r: rows.append(r), bench, q, kv, idx, ours, torch.randn_like(ours), "s", 8e9, 4e9)
    assert rows[1]["note"] == "failed: RuntimeError: no" and rows[2]["note"].startswith("failed: RuntimeError")
    assert "failed" not in str(rows[0].get("note"))
