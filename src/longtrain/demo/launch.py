"""Launching the demo's ranks: ``cp`` processes joined by torch.distributed (gloo on CPU, NCCL on CUDA) through a
FileStore in a temporary directory (:func:`launch`), or the ranks ``torchrun`` started (``WORLD_SIZE`` ranks are
the CP group). A failure on any rank ends every rank; Ctrl-C in the parent stops them all."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
from typing import Any

import torch

from longtrain.demo.config import DemoConfig, DemoConfigError, resolve_device
from longtrain.demo.loop import ParityError, run_rank

__all__ = ["launch", "with_torchrun_world"]


def with_torchrun_world(cfg: DemoConfig) -> DemoConfig:
    """``cfg`` with ``cp`` set to torchrun's ``WORLD_SIZE`` (those ranks are the CP group); unchanged outside torchrun.
    A world the row cannot be sharded over is a :class:`DemoConfigError` that names ``WORLD_SIZE``."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return cfg
    world = int(os.environ["WORLD_SIZE"])
    if world == cfg.cp:
        return cfg
    try:
        return dataclasses.replace(cfg, cp=world)
    except DemoConfigError as exc:
        raise DemoConfigError(
            f"torchrun started WORLD_SIZE={world} ranks, and they are the CP group (in place of cp={cfg.cp}): {exc}"
        ) from None


def _worker(rank: int, world: int, store_dir: str, cfg: DemoConfig, results: Any) -> None:
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates us on Ctrl-C
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = resolve_device(cfg)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5), **kwargs
    )
    try:
        out = run_rank(cfg)
        results.put((rank, "ok", out))
    except ParityError as exc:
        results.put((rank, "parity", str(exc)))
    except BaseException as exc:
        import traceback

        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        gc.collect()  # before destroying the group: torch 2.13's gloo can abort at exit otherwise (README)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo on ``cfg.cp`` ranks; returns rank 0's result. Raises on any rank's failure."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _launch_torchrun(cfg)
    if cfg.cp == 1:
        return run_rank(cfg)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="longtrain-demo-") as store_dir:
        procs = [ctx.Process(target=_worker, args=(r, cfg.cp, store_dir, cfg, results)) for r in range(cfg.cp)]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        try:
            while len(outcomes) < cfg.cp:
                try:
                    rank, status, payload = results.get(timeout=0.5)
                    outcomes[rank] = (status, payload)
                    if status != "ok":
                        break
                except Exception:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                    if dead:
                        # A crashed rank may have put nothing; give its peers a moment to report.
                        time.sleep(1.0)
                        if all(r not in outcomes for r in dead):
                            outcomes[dead[0]] = ("error", f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}")
                            break
        except KeyboardInterrupt:
            _stop(procs)
            raise
        _stop(procs, graceful=all(s == "ok" for s, _ in outcomes.values()) and len(outcomes) == cfg.cp)
    for rank, (status, payload) in sorted(outcomes.items()):
        if status == "parity":
            raise ParityError(payload)
        if status == "error":
            raise RuntimeError(f"rank {rank} failed: {payload}")
    return outcomes[0][1]


def _stop(procs, graceful: bool = False) -> None:
    for p in procs:
        p.join(timeout=30 if graceful else 0.1)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def _launch_torchrun(cfg: DemoConfig) -> dict[str, Any]:
    import torch.distributed as dist

    cfg = with_torchrun_world(cfg)
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return run_rank(cfg)
    finally:
        gc.collect()  # before destroying the group: torch 2.13's gloo can abort at exit otherwise (README)
        dist.destroy_process_group()
