"""The demo's outputs: ``summary.json`` and ``loss_curve.png`` next to the ``metrics.jsonl`` the loop writes, and
the printed summary.

Steady state is steps 2..N (step 1 alone when the run has one step): tokens/s is the mean of the steps' rates (as
before); model TFLOP/s is the steady steps' model FLOPs (:mod:`longtrain.models.flops`) over their time, for the
whole job and per rank (``/ cp``, one device each); MFU is the per-rank rate over the device's peak, n/a without a
documented peak. Peak memory is ``torch.cuda.max_memory_allocated`` of step 1 and the largest of the steady steps
(the largest of any rank); n/a on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longtrain.demo.config import DemoConfig

__all__ = ["format_summary", "summarize", "write_outputs"]


def summarize(cfg: DemoConfig, result: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The ``summary.json`` content of rank 0's ``result`` (without the loss curve's path)."""
    from longtrain.models.flops import mfu

    history = result["history"]
    losses = [h["loss"] for h in history]
    steady = history[1:] or history[:1]
    tps = [h["tokens_per_s"] for h in steady]
    steady_time = sum(h["step_time_s"] for h in steady)
    tflops = sum(h["model_flops"] for h in steady) / steady_time / 1e12
    per_rank = tflops / cfg.cp
    peak = result["peak_tflops"]
    ratio = mfu(per_rank, peak)
    memory_note = None
    if result["step1_peak_memory_gib"] is None:
        memory_note = f"not available on {result['device_name']}: torch.cuda.max_memory_allocated is CUDA-only"
    return {
        "preset": cfg.preset,
        "steps": len(history),
        "cp": cfg.cp,
        "seq_len": cfg.seq_len,
        "sharding": cfg.sharding,
        "attn_backend": cfg.attn_backend,
        "dsa_backend": cfg.dsa_backend,
        "documents": cfg.documents,
        "device": result["device"],
        "device_name": result["device_name"],
        "dtype": result["dtype"],
        "layers": result["layers"],
        "parameters": result["parameters"],
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "mean_tokens_per_s": sum(tps) / len(tps),
        "real_token_fraction": sum(h["real_tokens"] for h in steady) / (cfg.seq_len * len(steady)),
        "model_flops_per_step": sum(h["model_flops"] for h in steady) / len(steady),
        "model_tflops_per_s": tflops,
        "model_tflops_per_s_per_rank": per_rank,
        "peak_tflops": peak,
        "peak_tflops_source": result["peak_source"],
        "mfu": ratio,
        "step1_peak_memory_gib": result["step1_peak_memory_gib"],
        "steady_peak_memory_gib": result["steady_peak_memory_gib"],
        "peak_memory_note": memory_note,
        "steady_steps": len(steady),
        "wall_s": wall_s,
        "parity": result["parity"],
    }


def write_outputs(cfg: DemoConfig, result: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Write ``summary.json`` and ``loss_curve.png`` to ``cfg.out``; returns the summary (with ``loss_curve``)."""
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(cfg, result, wall_s)
    history = result["history"]
    png = out_dir / "loss_curve.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([h["step"] for h in history], [h["loss"] for h in history], marker=".", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"longtrain demo ({cfg.preset}): cp={cfg.cp}, layers {result['layers']}, {result['dtype']}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png)
        plt.close(fig)
        summary["loss_curve"] = str(png)
    except ImportError:
        summary["loss_curve"] = "not written (pip install matplotlib, or longtrain[demo])"
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GiB"


def format_summary(cfg: DemoConfig, summary: dict[str, Any]) -> str:
    """The lines ``longtrain demo`` prints at the end."""
    par = summary["parity"]
    parity = "OK" if par and par["ok"] else "skipped" if par is None else "FAILED"
    if summary["mfu"] is None:
        mfu_text = f"MFU n/a ({summary['peak_tflops_source']})"
    else:
        mfu_text = f"MFU {100 * summary['mfu']:.1f}% of {summary['peak_tflops']:g} ({summary['peak_tflops_source']})"
    memory = f"step 1 {_gib(summary['step1_peak_memory_gib'])}, steady {_gib(summary['steady_peak_memory_gib'])}"
    if summary["peak_memory_note"]:
        memory = f"n/a ({summary['peak_memory_note']})"
    return (
        f"summary: {summary['steps']} steps on {summary['cp']} rank(s) ({summary['device']}, {summary['dtype']}), "
        f"preset {summary['preset']}, model {summary['layers']} with {summary['parameters']:,} parameters; loss "
        f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}; {summary['mean_tokens_per_s']:,.0f} tokens/s; "
        f"parity {parity}; wall {summary['wall_s']:.1f}s\n"
        f"throughput (steady steps): {summary['model_tflops_per_s']:.3g} model TFLOP/s "
        f"({summary['model_tflops_per_s_per_rank']:.3g} per rank), {mfu_text}; peak memory: {memory}\n"
        f"outputs: {Path(cfg.out) / 'metrics.jsonl'}, {summary['loss_curve']}, {Path(cfg.out) / 'summary.json'}"
    )
