"""The ``longtrain`` command: ``doctor`` (what can run here and why not), ``demo`` (the main job), ``bench``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module that has backends exposes ``backend_status() -> list[tuple[str, str | None]]``:
# (backend name, None when available else the reason it is not).
BACKEND_MODULES: tuple[tuple[str, str], ...] = (
    ("blockdiag_cp", "longtrain.blockdiag_cp.providers"),
    ("dsa", "longtrain.dsa.ops"),
    ("prewarm", "longtrain.prewarm"),
)


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)), line]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def doctor_rows() -> list[tuple[str, str, str, str]]:
    """``(module, backend, "yes"/"no", reason)`` for every backend of every module; a module's ``auto`` choices
    come as ``(module, "auto <op> -> <route>", "auto", why)``."""
    rows: list[tuple[str, str, str, str]] = []
    for label, module_name in BACKEND_MODULES:
        module = importlib.import_module(module_name)
        for backend, reason in module.backend_status():
            if reason is None and backend.startswith("auto ") and ": " in backend:  # what auto picks, and why
                choice, why = backend.split(": ", 1)
                rows.append((label, choice, "auto", why))
                continue
            rows.append((label, backend, "no" if reason else "yes", reason or ""))
    return rows


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from longtrain import __version__, _optional

    print(f"longtrain {__version__} | torch {torch.__version__} | python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name} (SM{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        print("device: CPU only (no CUDA device visible)")
    print()
    print("optional packages")
    pkg_rows = [(name, "yes" if ok else "no", reason) for name, ok, reason in _optional.package_table()]
    print(_table(pkg_rows, ("package", "available", "reason")))
    print()
    print("backends")
    print(_table(doctor_rows(), ("module", "backend", "available", "reason")))
    from longtrain.blockdiag_cp.providers import auto_choice

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    picks = "; ".join(
        f"{str(dtype).replace('torch.', '')}: long documents -> {auto_choice(dtype, device, 'long')}, short -> "
        f"{auto_choice(dtype, device, 'short')}, with dropout -> {auto_choice(dtype, device, 'long', 0.1)}"
        for dtype in (torch.bfloat16, torch.float32)
    )
    print(f"\nblockdiag_cp attn_backend='auto' on {device}: {picks}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from longtrain import __version__

    parser = argparse.ArgumentParser(prog="longtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"longtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="show which backends of every module can run here, and why not")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser(
        "demo",
        help="train a small LM on packed documents with context parallelism (CPU is fine)",
        description="Train a decoder LM (GQA block-diagonal attention + DSA layers) on packed documents of a "
        "shipped public-domain corpus, with --cp ranks of context parallelism launched by the demo itself (or "
        "torchrun), prewarm, a step-1 parity check against a single-rank run, metrics.jsonl, a loss curve and a "
        "summary with tokens/s, model TFLOP/s, MFU and peak memory. --preset picks the defaults: tiny (the CPU demo) "
        "or h200-32k (a 0.74B GLM-5.2-style model on 32K-token rows for one H200, the default with --device cuda).",
    )
    from longtrain.train import add_demo_arguments

    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    from longtrain.bench import add_bench_arguments

    p = sub.add_parser(
        "bench",
        help="run the GPU benchmark suites (blockdiag, dsa, prewarm) and write markdown + JSON + a PNG chart",
    )
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def cmd_bench(args: argparse.Namespace) -> int:
    from longtrain import bench

    return bench.main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from longtrain import train

    return train.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
