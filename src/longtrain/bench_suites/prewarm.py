"""Prewarm benchmark: what step 1 costs with the prewarm off and on.

For a small model of Qwen3-Next-style GDN layers (fla's ``chunk_gated_delta_rule``, 16 heads x 128, bf16,
packed 32K-token batches with int32 ``cu_seqlens``) and, when ``mamba_ssm`` imports, Mamba-2 SSD mixers
(``mamba_chunk_scan_combined`` with ``seq_idx``), each mode runs in its own process and reports, for training
steps 1 and 2: the number of Triton autotune benchmark runs (``Autotuner._bench`` calls) inside the step, the
allocator peak (``max_memory_allocated`` / ``max_memory_reserved``), the growth of device memory outside the
caching allocator (``torch.cuda.mem_get_info`` delta minus the reserved delta) and the wall time; and, for
the modes with prewarm, the prewarm's wall time and its own autotune runs.

Modes: ``off``; ``on`` (cublas_backward + the model's autotune prewarm, with ``fla_gdn_seq_len`` set to the
training length); ``on-noseq`` (GDN only: the same without ``fla_gdn_seq_len``, to show fla's token-bucketed
l2-norm kernels).

Caches: autotune results are never persisted (``FLA_CACHE_RESULTS=0``; mamba_ssm and triton do not persist
them by default), so every process starts with empty autotune caches: the nonzero count of ``off`` proves
it. To fit the GPU budget the processes share one fresh ``TRITON_CACHE_DIR`` of compiled binaries; ``on``
runs first, so its prewarm time includes every compilation (a cold start) and later processes skip
compiling, not autotuning.

    python benchmarks/prewarm.py [--out DIR] [--budget-s 170] [--scenarios gdn,mamba]   # from a checkout
    python -m longtrain.bench_suites.prewarm [...]                                      # or longtrain bench prewarm
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

from longtrain.bench_suites.report import RESULTS_DIR, write_report

#: The folder that holds the ``longtrain`` package this module belongs to (a checkout's ``src/`` or site-packages):
#: put first on the children's ``PYTHONPATH`` so that they import the same longtrain as this process.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
CHILD_MODULE = "longtrain.bench_suites.prewarm"
MIB = 2**20

GDN = {"layers": 2, "hidden": 2048, "heads": 16, "head_dim": 128, "tokens": 32768, "docs": 4}
MAMBA = {"layers": 2, "hidden": 2048, "heads": 32, "head_dim": 64, "state": 128, "groups": 8, "chunk": 128}
MAMBA_TOKENS, MAMBA_DOCS = 16384, 4


# ---------------------------------------------------------------------------------------------- child process


def _install_bench_counter() -> Counter:
    """Count ``Autotuner._bench`` calls (one per candidate config benchmarked), by kernel name."""
    from triton.runtime import autotuner

    counts: Counter = Counter()
    real = autotuner.Autotuner._bench

    def counting(self, *args, **kwargs):
        fn = self
        while not hasattr(fn, "__name__") and hasattr(fn, "fn"):
            fn = fn.fn
        counts[getattr(getattr(self, "base_fn", None), "__name__", None) or getattr(fn, "__name__", "?")] += 1
        return real(self, *args, **kwargs)

    autotuner.Autotuner._bench = counting
    return counts


def _load_mamba_ssd():
    """``mamba_chunk_scan_combined`` without running ``mamba_ssm/__init__`` (it imports the CUDA extension
    ``selective_scan_cuda`` eagerly, which a build without the extension lacks; the Triton SSD path needs none)."""
    if "mamba_ssm" not in sys.modules:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None:
            raise ImportError("mamba_ssm is not installed")
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["mamba_ssm"] = pkg
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined


def _gdn_model(torch, nn, F):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    class GDNLayer(nn.Module):
        """Qwen3-Next-style gated-delta-net attention (q/k already at ``num_v_heads``)."""

        def __init__(self, hidden: int, heads: int, head_dim: int):
            super().__init__()
            self.num_v_heads, self.head_k_dim, self.head_v_dim = heads, head_dim, head_dim
            self.chunk_gated_delta_rule = chunk_gated_delta_rule
            self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
            self.ab = nn.Linear(hidden, 2 * heads, bias=False)
            self.A_log = nn.Parameter(torch.zeros(heads))
            self.out = nn.Linear(heads * head_dim, hidden, bias=False)

        def forward(self, x, cu_seqlens):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.num_v_heads, self.head_k_dim).unbind(2)
            a, b = self.ab(x).float().chunk(2, dim=-1)
            g = -self.A_log.float().exp() * F.softplus(a)
            beta = b.sigmoid().to(x.dtype)
            o, _ = self.chunk_gated_delta_rule(
                q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens
            )
            return x + self.out(o.reshape(B, T, -1))

    model = nn.ModuleList([GDNLayer(GDN["hidden"], GDN["heads"], GDN["head_dim"]) for _ in range(GDN["layers"])])
    T = GDN["tokens"]
    cu = torch.linspace(0, T, GDN["docs"] + 1, dtype=torch.int32)
    return model, T, GDN["hidden"], cu, None


def _mamba_model(torch, nn, F):
    op = _load_mamba_ssd()
    H, P, N, G, chunk = MAMBA["heads"], MAMBA["head_dim"], MAMBA["state"], MAMBA["groups"], MAMBA["chunk"]

    class Mixer(nn.Module):
        """Mamba-2 SSD mixer (the in-projection splits into x, B, C, dt; no conv, no gate)."""

        def __init__(self, hidden: int):
            super().__init__()
            self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups, self.chunk_size = H, P, N, G, chunk
            self.cp = None
            self.in_proj = nn.Linear(hidden, H * P + 2 * G * N + H, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.D = nn.Parameter(torch.ones(H))
            self.dt_bias = nn.Parameter(torch.zeros(H))
            self.out = nn.Linear(H * P, hidden, bias=False)

        def forward(self, x, seq_idx):
            B, T, _ = x.shape
            xs, Bm, Cm, dt = self.in_proj(x).split([H * P, G * N, G * N, H], dim=-1)
            y = op(
                xs.reshape(B, T, H, P), dt, -self.A_log.float().exp(), Bm.reshape(B, T, G, N),
                Cm.reshape(B, T, G, N), chunk, D=self.D.float(), z=None, dt_bias=self.dt_bias.float(),
                seq_idx=seq_idx, dt_softplus=True,
            )  # fmt: skip
            return x + self.out(y.reshape(B, T, -1))

    model = nn.ModuleList([Mixer(MAMBA["hidden"]) for _ in range(MAMBA["layers"])])
    T = MAMBA_TOKENS
    seq_idx = torch.arange(MAMBA_DOCS, dtype=torch.int32).repeat_interleave(T // MAMBA_DOCS)[None]
    return model, T, MAMBA["hidden"], None, seq_idx


def child(scenario: str, mode: str, out_json: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
    import torch
    import torch.nn.functional as F
    from torch import nn

    counts = _install_bench_counter()
    import longtrain.prewarm as prewarm

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    build = _gdn_model if scenario == "gdn" else _mamba_model
    model, T, hidden, cu, seq_idx = build(torch, nn, F)
    model = model.to(dev, torch.bfloat16)
    for layer in model:  # fp32 SSM/decay parameters, as Nemotron/Qwen3-Next keep them
        for name in ("A_log", "D", "dt_bias"):
            if hasattr(layer, name):
                getattr(layer, name).data = getattr(layer, name).data.float()
    x = torch.randn(1, T, hidden, device=dev, dtype=torch.bfloat16)
    extra = cu.to(dev) if cu is not None else seq_idx.to(dev)
    torch.cuda.synchronize()
    result: dict = {"scenario": scenario, "mode": mode}

    if mode != "off":
        cfg = prewarm.PrewarmConfig(
            cublas_backward=True,
            fla_gdn_autotune=scenario == "gdn",
            mamba_ssd_autotune=scenario == "mamba",
            fla_gdn_seq_len=T if (scenario == "gdn" and mode == "on") else None,
        )
        before = sum(counts.values())
        t0 = time.perf_counter()
        report = prewarm.run_prewarms(cfg, [model], dev, batch_size=1)
        result["prewarm_s"] = time.perf_counter() - t0
        result["prewarm_benches"] = sum(counts.values()) - before
        result["prewarm_report"] = report.format()
        result["prewarm_errors"] = sum(s.errors for s in report.steps)
        result["prewarm_ran"] = report.ran

    steps = []
    for i in (1, 2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        free0, total = torch.cuda.mem_get_info(dev)
        res0 = torch.cuda.memory_reserved(dev)
        bench0 = Counter(counts)
        t0 = time.perf_counter()
        out = x
        for layer in model:
            out = layer(out, extra)
        out.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        for p in model.parameters():
            p.grad = None
        del out
        free1, _ = torch.cuda.mem_get_info(dev)
        res1 = torch.cuda.memory_reserved(dev)
        benched = counts - bench0
        steps.append(
            {
                "step": i,
                "autotune_benches": sum(benched.values()),
                "kernels_tuned": ", ".join(f"{k}x{v}" for k, v in sorted(benched.items())),
                "seconds": seconds,
                "peak_allocated_mib": torch.cuda.max_memory_allocated(dev) / MIB,
                "peak_reserved_mib": torch.cuda.max_memory_reserved(dev) / MIB,
                "outside_allocator_delta_mib": ((free0 - free1) - (res1 - res0)) / MIB,
            }
        )
    result["steps"] = steps
    Path(out_json).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- parent


def _scenario_available(scenario: str) -> str | None:
    name = "fla" if scenario == "gdn" else "mamba_ssm"
    return None if importlib.util.find_spec(name) is not None else f"{name} not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["gdn", "mamba"])
    parser.add_argument("--mode", choices=["off", "on", "on-noseq"])
    parser.add_argument("--json")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting new runs after this")
    parser.add_argument("--scenarios", default="gdn,mamba")
    parser.add_argument("--cache-dir", help="TRITON_CACHE_DIR to use (default: a fresh temporary one)")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mode, args.json)
        return 0

    deadline = time.monotonic() + args.budget_s
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="longtrain-prewarm-triton-")
    os.makedirs(args.out, exist_ok=True)
    child_log = open(os.path.join(args.out, "prewarm_child_logs.txt"), "a")  # noqa: SIM115 - lives for the run
    pythonpath = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, FLA_CACHE_RESULTS="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = pythonpath
    env.pop("TRITON_CACHE_AUTOTUNING", None)
    plan = []
    for scenario in args.scenarios.split(","):
        why = _scenario_available(scenario)
        if why:
            print(f"[prewarm bench] {scenario}: skipped ({why})", flush=True)
            continue
        plan += [(scenario, "on"), (scenario, "off")]
    if "gdn" in args.scenarios and not _scenario_available("gdn"):
        plan.append(("gdn", "on-noseq"))

    rows, not_run, details = [], [], []
    for scenario, mode in plan:
        remaining = deadline - time.monotonic()
        if remaining < 20:
            not_run.append(f"{scenario}/{mode}")
            continue
        out_json = os.path.join(cache_dir, f"{scenario}-{mode}.json")
        cmd = [sys.executable, "-m", CHILD_MODULE, "--child", scenario, "--mode", mode, "--json", out_json]
        t0 = time.monotonic()
        child_log.write(f"===== {scenario}/{mode}\n")
        child_log.flush()
        try:
            proc = subprocess.run(cmd, env=env, timeout=remaining, stdout=child_log, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            not_run.append(f"{scenario}/{mode} (timed out after {time.monotonic() - t0:.0f} s)")
            continue
        print(f"[prewarm bench] {scenario}/{mode}: rc={proc.returncode} in {time.monotonic() - t0:.1f}s", flush=True)
        if proc.returncode != 0:
            not_run.append(f"{scenario}/{mode} (rc={proc.returncode}, see prewarm_child_logs.txt)")
            continue
        res = json.loads(Path(out_json).read_text())
        if "prewarm_report" in res:
            details.append(f"{scenario}/{mode} prewarm report:\n\n```\n{res['prewarm_report']}\n```")
            print(res["prewarm_report"], flush=True)
        for step in res["steps"]:
            row = {"scenario": scenario, "mode": mode, **step}
            if step["step"] == 1 and "prewarm_s" in res:
                row["prewarm_s"] = res["prewarm_s"]
                row["prewarm_benches"] = res["prewarm_benches"]
                row["prewarm_errors"] = res["prewarm_errors"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    notes = [__doc__.split("\n\n", 1)[1].strip(), f"Geometry: GDN {GDN}; Mamba {MAMBA}, tokens {MAMBA_TOKENS}."]
    if not_run:
        notes.append("Not run (GPU budget or failure): " + ", ".join(not_run) + ".")
    notes += details
    columns = [
        "scenario", "mode", "step", ("autotune_benches", "autotune runs"), ("seconds", "step s"),
        ("peak_allocated_mib", "peak alloc MiB"), ("peak_reserved_mib", "peak reserved MiB"),
        ("outside_allocator_delta_mib", "outside-allocator growth MiB"), ("prewarm_s", "prewarm s"),
        ("prewarm_benches", "prewarm autotune runs"), ("prewarm_errors", "prewarm errors"),
        ("kernels_tuned", "kernels tuned in step"),
    ]  # fmt: skip
    md, js = write_report(
        "prewarm", rows, columns, "\n\n".join(notes), out_dir=args.out, title="Prewarm: step 1 with prewarm off/on"
    )
    print(f"wrote {md} and {js}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
