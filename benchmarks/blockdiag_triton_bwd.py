"""Triton varlen attention backward (``providers.triton_varlen_bwd``) vs torch's FA2 backward and cuDNN's, on one GPU.

Packed documents of lengths from U[512, 8192] (seed 1) and U[64, 2048] (seed 2) filling 32K and 64K tokens
(``blockdiag_attention.doc_lengths``); Hq=32, Hkv=8, D=128, bf16, per-document causal. Every backward gets the
same bf16 ``dout`` and, except cuDNN's (fed by its own forward), the output and log-sum-exp of torch's FA2
forward. TFLOP/s = 2.5 * 4 * MaskArea * Hq * D / t_bwd (``blockdiag_attention.mask_area``). Timings are
``triton.testing.do_bench`` medians (p20/p80) after a warm-up (compile, autotune). Our rows also give the time
of each kernel alone (preprocess, dK/dV, dQ) to show where the time goes.

Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/blockdiag_triton_bwd.py [--tokens 32768 65536] [--out-dir DIR]
    PYTHONPATH=src python benchmarks/blockdiag_triton_bwd.py --sweep   # per-config timings at 32K U[512,8192]

``--precompile N`` compiles every configuration the run will use in N spawned processes first (Triton's disk
cache), which shortens a cold machine's run. The report goes to ``blockdiag_triton_bwd_<date>.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402
from blockdiag_attention import LAYOUTS, doc_lengths, mask_area  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _tv():
    from longtrain.blockdiag_cp.providers import triton_varlen_bwd as _triton_varlen

    return _triton_varlen


def make_inputs(total: int, lo: int, hi: int, seed: int) -> dict:
    """bf16 q/k/v/dout, FA2 forward out/lse ([T, Hq] view), cu_seqlens and the backward FLOP count."""
    lengths = doc_lengths(total, lo, hi, seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = D**-0.5
    max_len = max(lengths)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
    return {
        "lengths": lengths, "cu": cu, "max": max_len, "q": q, "k": k, "v": v, "dout": dout, "scale": scale,
        "out": res[0], "lse_fa2": res[1], "lse": res[1].t(), "flops": 2.5 * 4.0 * mask_area(lengths) * HQ * D,
    }  # fmt: skip


def ours(inp: dict, cfg=None, kernels=("dkdv", "dq")):
    tv = _tv()
    args = (inp["dout"], inp["q"], inp["k"], inp["v"], inp["out"], inp["lse"], inp["cu"], inp["cu"])
    if cfg is None:
        cfg = tv._autotune(args, inp["scale"])
    grads = (torch.empty_like(inp["q"]), torch.empty_like(inp["k"]), torch.empty_like(inp["v"]))
    return lambda: tv._launch_all(*args, inp["scale"], cfg, grads, kernels)


def fa2_bwd(inp: dict):
    rng = torch.zeros(2, dtype=torch.int64, device="cuda")
    unused = torch.empty(0, device="cuda")
    a = (inp["dout"], inp["q"], inp["k"], inp["v"], inp["out"], inp["lse_fa2"], inp["cu"], inp["cu"])
    return lambda: torch.ops.aten._flash_attention_backward(
        *a, inp["max"], inp["max"], 0.0, True, rng, unused, scale=inp["scale"]
    )


def cudnn_bwd(inp: dict):
    """cuDNN's ragged backward fed by cuDNN's forward, or ``(None, reason)``."""
    from longtrain.blockdiag_cp.providers import cudnn_graph as cv

    reason = cv.cudnn_unavailable_reason(torch.bfloat16, torch.device("cuda"))
    if reason is not None:
        return None, reason
    q, k, v, cu, m = inp["q"], inp["k"], inp["v"], inp["cu"], inp["max"]
    lay = cv._layout(cu, cu, m, m, HQ, HKV, D, None)
    p = cv._params(q, k, lay, inp["scale"], False, q.shape[0], k.shape[0])
    out, stats = cv.cudnn_varlen_fwd(q, k, v, lay, p)
    return (lambda: cv.cudnn_varlen_bwd(inp["dout"], q, k, v, out, stats, lay, p)), None


def _ours_provider(inp: dict):
    return ours(inp), None


def _fa2_provider(inp: dict):
    return fa2_bwd(inp), None


def _time_row(tv, inp: dict, fn, split: bool) -> dict:
    """Timing columns of one backward; ``split`` adds our per-kernel times and the chosen config."""
    t = bench(fn)
    row = {"bwd_ms": t["ms"], "p20": t["p20"], "p80": t["p80"], "tflops": inp["flops"] / t["ms"] / 1e9}
    if split:
        cfg = tv.tuned_configs()[(D, HQ, HKV, torch.bfloat16, str(inp["q"].device))]
        pre = bench(ours(inp, cfg, ()))["ms"]
        row.update(config=cfg.short(), pre_ms=pre, dkv_ms=bench(ours(inp, cfg, ("dkdv",)))["ms"] - pre)
        if cfg.dq_mode == "kernel":
            row["dq_ms"] = bench(ours(inp, cfg, ("dq",)))["ms"] - pre
    return row


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    text = f"{row['tflops']:6.1f} TFLOP/s ({row['bwd_ms']:.3f} ms)"
    if "config" in row:
        text += f" {row['config']} pre {row['pre_ms']:.3f} dkv {row['dkv_ms']:.3f} dq {row.get('dq_ms', 0):.3f}"
    return text


def bench(fn) -> dict:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    p50, p20, p80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    return {"ms": p50, "p20": p20, "p80": p80}


def _compile_one(task: tuple[dict, tuple[str, ...]]) -> str:
    """Spawned worker: run one configuration once on a small input so Triton's disk cache holds its kernels."""
    values, kernels = task
    tv = _tv()
    cfg = tv.config_from_dict(values)
    try:
        inp = make_inputs(4096, 512, 2048, 1)
        ours(inp, cfg, kernels)()
        torch.cuda.synchronize()
        return f"compiled {cfg.short()} {kernels}"
    except Exception as exc:  # a tile that does not fit: reported, and skipped by the timing loop
        return f"FAILED {cfg.short()} {kernels}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(tasks: list[tuple], workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    payload = [(asdict(c), tuple(k)) for c, k in tasks]
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for line in pool.map(_compile_one, payload):
            print("  precompile:", line, flush=True)


def _sweep_configs():
    cls = _tv().TritonVarlenBwdConfig
    dkv = [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (64, 128, 8, 3), (64, 128, 8, 4), (16, 64, 4, 4)]
    dq = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3)]
    atomic = []  # measured at 242-266 TFLOP/s (fp32 atomics), well behind the dQ kernel: not swept again
    dkv_cfgs = [cls(dkv_block_m=m, dkv_block_n=n, dkv_warps=w, dkv_stages=s) for m, n, w, s in dkv]
    dq_cfgs = [cls(dq_block_m=m, dq_block_n=n, dq_warps=w, dq_stages=s) for m, n, w, s in dq]
    at_cfgs = [cls(dkv_block_m=m, dkv_block_n=n, dkv_warps=w, dkv_stages=s, dq_mode="atomic") for m, n, w, s in atomic]
    return dkv_cfgs, dq_cfgs, at_cfgs


def sweep(args) -> int:
    dkv_cfgs, dq_cfgs, at_cfgs = _sweep_configs()
    if args.precompile:
        tasks = [(c, ("dkdv",)) for c in dkv_cfgs] + [(c, ("dq",)) for c in dq_cfgs]
        cands = [(c, ("dkdv", "dq")) for c in _tv().CANDIDATES]
        precompile(tasks + [(c, ("dkdv", "dq")) for c in at_cfgs] + cands, args.precompile)
    lo, hi, seed = LAYOUTS["long"]
    inp = make_inputs(32768, lo, hi, seed)
    flops = inp["flops"]
    rows = []

    def run(kind, cfg, kernels):
        try:
            t = bench(ours(inp, cfg, kernels))
        except Exception as exc:
            print(f"{kind:6s} {cfg.short():40s} FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return None
        rows.append({"kind": kind, "config": asdict(cfg), "short": cfg.short(), **t})
        print(f"{kind:6s} {cfg.short():40s} {t['ms']:8.3f} ms  (p20 {t['p20']:.3f} p80 {t['p80']:.3f})", flush=True)
        return t["ms"]

    pre = run("pre", dkv_cfgs[0], ())
    dkv_ms = {c: run("dkv", c, ("dkdv",)) for c in dkv_cfgs}
    dq_ms = {c: run("dq", c, ("dq",)) for c in dq_cfgs}
    for c in at_cfgs:
        ms = run("atomic", c, ("dkdv", "dq"))
        if ms is not None:
            print(f"       -> atomic full {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    best_dkv = sorted((ms, i) for i, (c, ms) in enumerate(dkv_ms.items()) if ms is not None)[:3]
    best_dq = sorted((ms, i) for i, (c, ms) in enumerate(dq_ms.items()) if ms is not None)[:2]
    for _, i in best_dkv:
        for _, j in best_dq:
            for overlap in (False, True):
                a, b = dkv_cfgs[i], dq_cfgs[j]
                cfg = _tv().TritonVarlenBwdConfig(
                    dkv_block_m=a.dkv_block_m, dkv_block_n=a.dkv_block_n, dkv_warps=a.dkv_warps,
                    dkv_stages=a.dkv_stages, dq_block_m=b.dq_block_m, dq_block_n=b.dq_block_n, dq_warps=b.dq_warps,
                    dq_stages=b.dq_stages, overlap=overlap,
                )  # fmt: skip
                ms = run("full", cfg, ("dkdv", "dq"))
                if ms is not None:
                    print(f"       -> full {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    fa2 = bench(fa2_bwd(inp))
    rows.append({"kind": "fa2", **fa2})
    print(f"FA2 backward {fa2['ms']:.3f} ms = {flops / fa2['ms'] / 1e9:.1f} TFLOP/s; preprocess {pre} ms", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "blockdiag_triton_bwd_sweep.json").write_text(json.dumps({"flops": flops, "rows": rows}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default="blockdiag_triton_bwd")
    ap.add_argument("--sweep", action="store_true", help="per-config timings at 32K U[512,8192] instead")
    ap.add_argument("--precompile", type=int, default=0, help="compile every config in N processes first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    if args.sweep:
        return sweep(args)
    tv = _tv()
    if args.precompile:
        precompile([(c, ("dkdv", "dq")) for c in tv.CANDIDATES], args.precompile)
    rows: list[dict] = []
    providers = [("triton (ours, autotuned)", _ours_provider), ("torch FA2 bwd", _fa2_provider),
                 ("cuDNN bwd (its own fwd stats)", cudnn_bwd)]  # fmt: skip
    for total in args.tokens:
        for layout, (lo, hi, seed) in LAYOUTS.items():
            inp = make_inputs(total, lo, hi, seed)
            base = {"tokens": total, "layout": f"U[{lo},{hi}] seed {seed}", "docs": len(inp["lengths"]),
                    "max_doc": inp["max"]}  # fmt: skip
            for name, make in providers:
                row = {**base, "backend": name}
                try:
                    fn, reason = make(inp)
                    if fn is None:
                        row["status"] = f"unavailable: {reason}"
                    else:
                        row.update(_time_row(tv, inp, fn, name.startswith("triton")))
                        row["status"] = "ok"
                except Exception as exc:
                    traceback.print_exc()
                    row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
                rows.append(row)
                print(f"{total:6d} {layout:5s} {name:32s} {_summary(row)}", flush=True)
            inp.clear()
            torch.cuda.empty_cache()
    columns = [
        ("tokens", "tokens"), ("layout", "documents"), ("docs", "n docs"), ("max_doc", "max doc"),
        ("backend", "backward"), ("tflops", "TFLOP/s"), ("bwd_ms", "ms (p50)"), ("p20", "p20"), ("p80", "p80"),
        ("pre_ms", "preprocess ms"), ("dkv_ms", "dK/dV kernel ms"), ("dq_ms", "dQ kernel ms"), ("config", "config"),
        ("status", "status"),
    ]  # fmt: skip
    notes = (
        f"Hq={HQ}, Hkv={HKV}, D={D}, bf16, per-document causal (bottom-right). TFLOP/s = 2.5*4*MaskArea*Hq*D / "
        "t_bwd with MaskArea = sum L(L+1)/2. Each backward is timed alone (do_bench median, p20/p80) on the same "
        "dout; ours and FA2's take the output and log-sum-exp of torch's FA2 forward, cuDNN's its own forward's. "
        "Kernel columns: each kernel alone after the preprocess (dK/dV and dQ = time with that kernel minus the "
        "preprocess alone). Config: dkv<block_m>x<block_n>w<warps>s<stages>/dq<...> as chosen by the autotuner "
        f"(candidates: {[c.short() for c in tv.CANDIDATES]})."
    )
    md, js = write_report(args.name, rows, columns, notes, header=machine_header(), out_dir=args.out_dir,
                          title="Triton varlen attention backward vs FA2 / cuDNN (one GPU)")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
