"""Per-call host overhead of the public DSA ops (validation + dispatch), measured apart from kernel time.

Usage (repository root)::

    python benchmarks/dsa_overhead.py                          # this checkout; report -> benchmarks/results/
    python benchmarks/dsa_overhead.py --before-src DIR/src     # also an older tree (a `git worktree` of an earlier
                                                               # commit): --rounds runs of each tree, alternating, each
                                                               # in a fresh process with PYTHONPATH=<tree>/src; the
                                                               # report shows both
    python benchmarks/dsa_overhead.py --json-out rows.json     # rows only, no report (what --before-src runs)

Shape: T = 4096 query rows and keys (one causal document), K = 512, sparse MLA at GLM-5.2's widths (H = 64,
D_qk = 576, d_v = 512, bf16; q and kv require grad, as in training) and its indexer (H_I = 32, D_I = 128, bf16, fp32
head weights, the prebuilt packed metadata passed in: the per-layer hot path).

What is timed (``time.perf_counter_ns`` around each call; median and 20th/80th percentiles over ``--calls`` calls
after ``--warmup``):

- ``public op, kernels stubbed``: ``sparse_mla_attention`` / ``indexer_topk`` with the kernel launch of the route
  replaced by a function that returns preallocated outputs (torch route: ``ops.sparse_mla_torch_fwd`` /
  ``ops._indexer_topk_torch``; triton route: ``triton.sparse_mla_fwd.sparse_mla_fwd`` /
  ``triton.indexer_topk.indexer_topk_fwd``). What is left is everything the Python side does per call: boundary
  validation, backend resolution, the backend's own checks, casts of small tensors, the autograd node. On CPU the
  triton route runs its host code under ``TRITON_INTERPRET=1`` (the kernels are stubbed, so nothing is
  interpreted).
- ``boundary validation only``: ``ops._validate_sparse_mla`` alone, the checks every call must pay once.
- ``python calls / check calls``: from one profiled call, how many Python functions of ``longtrain`` ran and which
  of them are checks (names with ``check`` or ``valid``), with their counts: what "validated twice" looks like.
- on CUDA, additionally ``public op, real kernels``: host time per call (perf_counter, no synchronisation inside
  the timed region) and device time (CUDA events around the same call), for each route that can run.

The stubs are looked up by name, so the script runs against older trees too (a row whose hook is missing there
says so).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

T, H, D_QK, D_V, K = 4096, 64, 576, 512, 512
H_I, D_I = 32, 128


def _import_longtrain(src: str | None):
    """Import ``longtrain`` from ``src`` (default: PYTHONPATH if it names one, else this checkout's ``src``)."""
    if src is not None:
        sys.path.insert(0, str(Path(src).resolve()))
    elif not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, str(REPO / "src"))
    import torch

    if not torch.cuda.is_available():
        # Triton decides at kernel definition whether to interpret; set it before any kernel module loads.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import longtrain
    from longtrain.dsa import ops

    return longtrain, ops


def _inputs(device, torch):
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = (torch.randn(T, H, D_QK, generator=gen) / 4).to(device=device, dtype=torch.bfloat16).requires_grad_()
    kv = (torch.randn(T, 1, D_QK, generator=gen) / 4).to(device=device, dtype=torch.bfloat16).requires_grad_()
    # Row t selects min(t + 1, K) keys of its causal prefix (the last ones: the layout, not the values, matters).
    row = torch.arange(T)[:, None]
    slot = torch.arange(K)[None, :]
    first = (row - K + 1).clamp_min(0)
    idx = torch.where(first + slot <= row, first + slot, -1).to(torch.int32).to(device)
    iq = (torch.randn(T, H_I, D_I, generator=gen)).to(device=device, dtype=torch.bfloat16)
    ik = (torch.randn(T, D_I, generator=gen)).to(device=device, dtype=torch.bfloat16)
    iw = (torch.randn(T, H_I, generator=gen) * (H_I**-0.5 * D_I**-0.5)).to(device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    return q, kv, idx, iq, ik, iw, cu


def _time(fn, calls: int, warmup: int) -> dict:
    for _ in range(warmup):
        fn()
    gc.collect()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()

    def pct(p):
        return samples[min(len(samples) - 1, int(p * len(samples)))] / 1e3

    return {"median_us": pct(0.5), "p20_us": pct(0.2), "p80_us": pct(0.8)}


def _profile(fn) -> dict:
    """Python functions of longtrain that one call runs, and the checks among them."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    calls, checks = 0, {}
    for (filename, _line, name), (_cc, ncalls, *_rest) in stats.items():
        if "longtrain" not in filename:
            continue
        calls += ncalls
        if ("check" in name or "valid" in name) and "unchecked" not in name:
            checks[name] = checks.get(name, 0) + ncalls
    return {"python_calls": calls, "check_calls": sum(checks.values()), "checks": checks}


class _Stub:
    """Replace ``module.name`` for the duration of a ``with`` block (``ok`` is False when it does not exist)."""

    def __init__(self, module, name, value):
        self.module, self.name, self.value = module, name, value
        self.ok = module is not None and hasattr(module, name)

    def __enter__(self):
        if self.ok:
            self.saved = getattr(self.module, self.name)
            setattr(self.module, self.name, self.value)
        return self

    def __exit__(self, *exc):
        if self.ok:
            setattr(self.module, self.name, self.saved)


def _triton_modules(ops, torch, device):
    """``(sparse_mla_fwd module, indexer_topk module)`` when the Triton route can run here, else ``None``."""
    try:
        import importlib

        triton_pkg = importlib.import_module("longtrain.dsa.triton")
        ok, why = triton_pkg.availability(device)
        if not ok:
            return None, why
        fwd = importlib.import_module("longtrain.dsa.triton.sparse_mla_fwd")
        idx = importlib.import_module("longtrain.dsa.triton.indexer_topk")
        return (fwd, idx), ""
    except Exception as exc:  # no triton: the rows say so
        return None, f"{type(exc).__name__}: {exc}"


def measure(src: str | None, calls: int, warmup: int) -> dict:
    longtrain, ops = _import_longtrain(src)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, kv, idx, iq, ik, iw, cu = _inputs(device, torch)
    from longtrain.dsa.metadata import prepare_dsa_metadata

    meta = prepare_dsa_metadata(cu, T)
    scale = D_QK**-0.5
    out = torch.zeros(T, H, D_V, dtype=q.dtype, device=device)
    lse = torch.zeros(T, H, dtype=torch.float32, device=device)
    sel = torch.full((T, K), -1, dtype=torch.int32, device=device)
    rows: list[dict] = []

    def sparse(backend):
        return lambda: ops.sparse_mla_attention(q, kv, idx, scale, d_v=D_V, backend=backend)

    def indexer(backend):
        return lambda: ops.indexer_topk(iq, ik, iw, cu, K, packed_metadata=meta, backend=backend)

    def add(op, route, what, fn=None, note="", profile=True):
        row = {"op": op, "route": route, "measure": what, "note": note}
        if fn is not None:
            row.update(_time(fn, calls, warmup))
            if profile:
                row.update(_profile(fn))
        rows.append(row)
        print(json.dumps(row), flush=True)

    triton_mods, triton_why = _triton_modules(ops, torch, device)
    torch_stubs = [
        _Stub(ops, "sparse_mla_torch_fwd", lambda *a, **k: out),
        _Stub(ops, "_indexer_topk_torch", lambda *a, **k: sel),
    ]
    triton_stubs = []
    if triton_mods is not None:
        triton_stubs = [
            _Stub(triton_mods[0], "sparse_mla_fwd", lambda *a, **k: (out, lse)),
            _Stub(triton_mods[1], "indexer_topk_fwd", lambda *a, **k: sel),
        ]
    stubbed = "public op, kernels stubbed"
    for stub in torch_stubs + triton_stubs:
        stub.__enter__()
    try:
        for backend in ("torch", "triton", "auto"):
            if backend == "triton" and triton_mods is None:
                add("sparse_mla_attention", backend, stubbed, note=f"triton cannot run here: {triton_why}")
                add("indexer_topk", backend, stubbed, note=f"triton cannot run here: {triton_why}")
                continue
            if device.type == "cuda" and backend == "auto":
                # auto may pick a route whose kernels are not stubbed here (cuDNN): time it with real kernels below.
                continue
            note = "auto resolves to torch on CPU" if backend == "auto" else ""
            if not torch_stubs[0].ok:
                note = "hook ops.sparse_mla_torch_fwd missing in this tree"
            add("sparse_mla_attention", backend, stubbed, sparse(backend), note=note)
            add("indexer_topk", backend, stubbed, indexer(backend), note=note)
    finally:
        for stub in torch_stubs + triton_stubs:
            stub.__exit__()

    validate = getattr(ops, "_validate_sparse_mla", None)
    if validate is not None:
        add(
            "sparse_mla_attention",
            "-",
            "boundary validation only",
            lambda: validate(q, kv, idx, scale, D_V, None, None),
            note="ops._validate_sparse_mla",
            profile=False,
        )

    if device.type == "cuda":
        real = "public op, real kernels"
        for backend in ("triton", "cudnn", "auto"):
            for op, fn in (("sparse_mla_attention", sparse(backend)), ("indexer_topk", indexer(backend))):
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as exc:
                    add(op, backend, real, note=f"cannot run: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                row = {"op": op, "route": backend, "measure": real, "note": ""}
                host, dev = [], []
                for i in range(warmup + calls):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter_ns()
                    result = fn()
                    t1 = time.perf_counter_ns()
                    end.record()
                    end.synchronize()
                    del result
                    if i >= warmup:
                        host.append((t1 - t0) / 1e3)
                        dev.append(start.elapsed_time(end) * 1e3)
                host.sort()
                dev.sort()
                row.update(
                    median_us=host[len(host) // 2],
                    p20_us=host[len(host) // 5],
                    p80_us=host[4 * len(host) // 5],
                    device_us=dev[len(dev) // 2],
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"longtrain": str(Path(longtrain.__file__).resolve().parent), "device": str(device), "rows": rows}


def _key(row: dict) -> tuple:
    return row["op"], row["route"], row["measure"]


def _run_tree(src: Path, calls: int, warmup: int) -> dict:
    """One measurement of the tree at ``src`` in a fresh process (``PYTHONPATH=src``)."""
    out = Path(tempfile.mkdtemp()) / "rows.json"
    cmd = [sys.executable, __file__, "--json-out", str(out), "--calls", str(calls), "--warmup", str(warmup)]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(src)))
    return json.loads(out.read_text())


def _combine(runs: list[dict]) -> dict:
    """Rows of several runs of one tree: per row the median over runs of each run's median (and its spread)."""
    combined = dict(runs[0], rows=[])
    for row in runs[0]["rows"]:
        same = [r for run in runs for r in run["rows"] if _key(r) == _key(row)]
        merged = dict(row)
        for field in ("median_us", "device_us"):
            values = sorted(r[field] for r in same if r.get(field) is not None)
            if values:
                merged[field] = values[len(values) // 2]
                if field == "median_us":
                    merged["spread_us"] = (values[0], values[-1])
        combined["rows"].append(merged)
    combined["runs"] = len(runs)
    return combined


def write(after: dict, before: dict | None, out_dir: str | None) -> None:
    sys.path.insert(0, str(HERE))
    from _report import write_report

    before_rows = {_key(r): r for r in (before or {}).get("rows", [])}
    rows = []
    for row in after["rows"]:
        merged = {"op": row["op"], "route": row["route"], "measure": row["measure"]}
        old = before_rows.get(_key(row), {})
        merged["before_us"] = old.get("median_us")
        merged["after_us"] = row.get("median_us")
        for side, src in (("before", old), ("after", row)):
            if src.get("spread_us"):
                merged[f"{side}_spread"] = "{:.1f} - {:.1f}".format(*src["spread_us"])
        if merged["before_us"] and merged["after_us"]:
            merged["change"] = f"{(merged['after_us'] / merged['before_us'] - 1) * 100:+.0f}%"
        merged["device_us"] = row.get("device_us")
        merged["checks_before"] = _checks_text(old)
        merged["checks_after"] = _checks_text(row)
        notes = dict.fromkeys(n for n in (old.get("note", ""), row.get("note", "")) if n)
        merged["note"] = "; ".join(notes) or None
        rows.append(merged)
    columns = [
        "op",
        "route",
        "measure",
        ("before_us", "before µs"),
        ("before_spread", "before: runs' range"),
        ("after_us", "after µs"),
        ("after_spread", "after: runs' range"),
        "change",
        ("device_us", "device µs"),
        ("checks_before", "checks per call, before"),
        ("checks_after", "checks per call, after"),
        "note",
    ]
    notes = __doc__.split("Shape:", 1)[1].strip()
    runs = after.get("runs", 1)
    notes += (
        f"\n\nEach cell: the median over {runs} run(s) of each run's median per-call time; with --before-src the runs "
        "of the two trees alternate, each in a fresh process."
    )
    notes += f" after: longtrain from `{after['longtrain']}` on {after['device']}."
    if before is not None:
        notes += f" before: `{before['longtrain']}` (commit {before.get('commit', 'n/a')})."
    notes += (
        " Reproduce: `git worktree add /tmp/lt_before <earlier commit>; "
        "python benchmarks/dsa_overhead.py --before-src /tmp/lt_before/src`."
    )
    md, js = write_report(
        "dsa_overhead" + ("_cuda" if after["device"].startswith("cuda") else "_cpu"),
        rows,
        columns,
        notes,
        out_dir=out_dir,
        title="DSA public ops: per-call host overhead (T = 4096, K = 512)",
    )
    print("report:", md, js)


def _checks_text(row: dict) -> str | None:
    if "checks" not in row:
        return None
    parts = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(row["checks"].items()))
    return f"{row['check_calls']} of {row['python_calls']} calls: {parts}" if parts else f"0 of {row['python_calls']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=None, help="import longtrain from this src folder")
    parser.add_argument("--before-src", default=None, help="also measure this src folder (in a subprocess)")
    parser.add_argument("--rounds", type=int, default=3, help="with --before-src: alternating runs of each tree")
    parser.add_argument("--json-out", default=None, help="write the rows to this file and no report")
    parser.add_argument("--out-dir", default=None, help="report folder (default benchmarks/results)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(measure(args.src, args.calls, args.warmup), indent=1))
        return 0
    before = None
    if args.before_src:
        before_src = Path(args.before_src).resolve()
        after_src = Path(args.src).resolve() if args.src else REPO / "src"
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(max(1, args.rounds)):
            runs["before"].append(_run_tree(before_src, args.calls, args.warmup))
            runs["after"].append(_run_tree(after_src, args.calls, args.warmup))
        before, after = _combine(runs["before"]), _combine(runs["after"])
        commit = subprocess.run(
            ["git", "-C", str(before_src), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        before["commit"] = commit or "n/a"
    else:
        after = measure(args.src, args.calls, args.warmup)
    write(after, before, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
