"""``longtrain demo``: a small LM on packed documents with context parallelism, prewarm and a parity check.

:func:`main` validates the options (a preset's defaults, then a ``--config`` file, then flags: see
:mod:`longtrain.demo.presets`), checks them against this machine before any rank starts, launches the ranks
(:func:`longtrain.demo.launch.launch`: ``cp`` processes joined by torch.distributed, or ``torchrun``'s ranks), each
running :func:`longtrain.demo.loop.run_rank`, then writes the outputs and prints the summary
(:mod:`longtrain.demo.report`). This module keeps the names other code imports from it (``DemoConfig``,
``run_rank``, ``launch``, ``allreduce_grads``, ``_Mesh``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from longtrain.demo.config import (
    DEMO_PREWARM,
    DemoConfig,
    DemoConfigError,
    build_model_config,
    check_environment,
    dtype_name,
    make_config,
    read_config_file,
    resolve_device,
    resolve_dtype,
)
from longtrain.demo.launch import launch, with_torchrun_world
from longtrain.demo.loop import (
    PARITY_RTOL,
    CPMesh,
    ParityError,
    allreduce_grads,
    check_parity,
    packed_cu_seqlens,
    run_rank,
)
from longtrain.demo.presets import PRESETS, help_default
from longtrain.demo.report import format_summary, write_outputs

__all__ = [
    "DEMO_PREWARM",
    "DemoConfig",
    "DemoConfigError",
    "ParityError",
    "add_demo_arguments",
    "allreduce_grads",
    "build_model_config",
    "check_environment",
    "config_from_args",
    "launch",
    "main",
    "run_rank",
    "write_outputs",
]

# The names this module had before the split into longtrain.demo (tests and benchmarks import them).
_Mesh = CPMesh
_packed_cu_seqlens = packed_cu_seqlens
_parity = check_parity
_PARITY_RTOL = PARITY_RTOL
_dtype_name = dtype_name

#: Flag destinations that are DemoConfig keys of the same name.
_FLAG_KEYS = (
    "preset", "steps", "seq_len", "cp", "device", "dtype", "attn_backend", "kv_exchange", "sharding", "dsa_backend",
    "seed", "lr", "documents", "peak_tflops", "out",
)  # fmt: skip


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    presets = "; ".join(f"{name}: {preset.summary}" for name, preset in PRESETS.items())
    p.add_argument(
        "--preset",
        metavar="NAME",
        help=f"defaults of every option below ({presets}). Default: tiny, or h200-32k with --device cuda",
    )
    p.add_argument("--config", metavar="FILE", help="YAML file whose top-level keys are these options (flags win)")
    p.add_argument("--steps", type=int, help=f"optimizer steps ({help_default('steps')})")
    p.add_argument("--seq-len", type=int, help=f"tokens per packed row, divisible by 2*cp ({help_default('seq_len')})")
    p.add_argument("--cp", type=int, help=f"context-parallel ranks, one process each ({help_default('cp')})")
    p.add_argument("--device", help=f"cpu, cuda or auto ({help_default('device')})")
    p.add_argument(
        "--dtype", help=f"float32 or bfloat16; auto: float32 on CPU, bfloat16 on CUDA ({help_default('dtype')})"
    )
    p.add_argument(
        "--attn-backend",
        help="varlen backend of the GQA layers: auto, flash, te, cudnn, flex, reference, "
        f"dense (the plain-PyTorch baseline) (default {d.attn_backend})",
    )
    p.add_argument("--kv-exchange", help=f"K/V exchange: allgather, halo, a2a (default {d.kv_exchange})")
    p.add_argument("--sharding", help=f"CP sharding: contiguous or balanced (default {d.sharding})")
    p.add_argument(
        "--dsa-backend",
        help=f"DSA kernels: auto, triton, cudnn, torch (the plain-PyTorch baseline) (default {d.dsa_backend})",
    )
    p.add_argument("--seed", type=int, help=f"seed of the model and the data (default {d.seed})")
    p.add_argument("--lr", type=float, help=f"AdamW learning rate ({help_default('lr')})")
    p.add_argument("--documents", help=f"corpus documents: chapters or books ({help_default('documents')})")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s of one device for MFU (default: the documented bf16 dense peak of known GPUs, else n/a)",
    )
    p.add_argument("--out", help=f"output folder (default {d.out})")
    p.add_argument("--no-prewarm", action="store_true", help="skip the setup-time prewarm")
    p.add_argument("--no-parity", action="store_true", help="skip the step-1 parity check")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The config of a preset's defaults, then the ``--config`` file's keys, then the flags given."""
    explicit: dict[str, Any] = {}
    if getattr(args, "config", None):
        explicit.update(read_config_file(args.config))
    explicit.update({n: getattr(args, n) for n in _FLAG_KEYS if getattr(args, n, None) is not None})
    if getattr(args, "no_prewarm", False):
        explicit["prewarm"] = False
    if getattr(args, "no_parity", False):
        explicit["parity"] = False
    return make_config(explicit)


def main(args: argparse.Namespace) -> int:
    """``longtrain demo``: validate, launch, write outputs, print the summary. Exit codes: 0 ok, 1 failure
    (including a failed parity check), 2 bad options, 130 interrupted."""
    try:
        cfg = with_torchrun_world(config_from_args(args))  # the header and the summary report the ranks that run
        check_environment(cfg)
    except DemoConfigError as exc:
        print(f"longtrain demo: error: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(cfg)
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        print(
            f"longtrain demo: preset={cfg.preset} cp={cfg.cp} device={device} "
            f"dtype={dtype_name(resolve_dtype(cfg, device))} seq_len={cfg.seq_len} steps={cfg.steps} "
            f"attn={cfg.attn_backend}/{cfg.kv_exchange} dsa={cfg.dsa_backend} documents={cfg.documents} out={cfg.out}",
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        result = launch(cfg)
    except KeyboardInterrupt:
        print("\nlongtrain demo: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    except ParityError as exc:
        print(f"longtrain demo: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"longtrain demo: failed: {exc}", file=sys.stderr)
        return 1
    if result["rank"] != 0:  # under torchrun every rank returns here; rank 0 reports
        return 0
    summary = write_outputs(cfg, result, time.perf_counter() - t0)
    print(format_summary(cfg, summary), flush=True)
    return 0
