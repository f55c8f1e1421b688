"""Gloo multi-process harness for CPU tests of multi-rank code.

``run_ranks(fn, world_size, *args, **kwargs)`` runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size``
processes joined in one gloo process group and returns the per-rank results in rank order. ``fn`` must be a
module-level (picklable) function; it may use ``torch.distributed`` collectives on the default group.

- Rendezvous goes through a ``FileStore`` in a fresh temporary directory: no port is ever hard-coded.
- Workers are spawned once per world size and reused across calls (spawning costs seconds per process).
- Any exception on any rank is re-raised in the parent as ``RankError`` with that rank's traceback; the
  results of ranks that succeeded are attached.
- Every call is bounded: if the ranks do not all answer within ``timeout`` seconds (a hang, e.g. mismatched
  collectives), the workers are killed, the pool is discarded and ``RankTimeout`` is raised.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankError", "RankTimeout", "GlooWorld", "run_ranks", "shutdown_all"]


class RankError(RuntimeError):
    """One or more ranks raised. ``errors`` maps rank -> formatted traceback; ``results`` holds the others."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any]):
        self.errors = errors
        self.results = results
        first = min(errors)
        super().__init__(f"rank(s) {sorted(errors)} raised; rank {first}:\n{errors[first]}")


class RankTimeout(TimeoutError):
    """The ranks did not all finish in time (likely a hang); the pool was killed."""


def _worker(rank: int, world: int, store_path: str, tasks: mp.Queue, results: mp.Queue, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s)
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            call_id, fn, args, kwargs = task
            try:
                out = fn(rank, world, *args, **kwargs)
                results.put((call_id, rank, True, out))
            except BaseException:
                results.put((call_id, rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class GlooWorld:
    """A pool of ``world_size`` gloo ranks that run submitted functions collectively."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0):
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size must be in [1, 8], got {world_size}")
        self.world_size = world_size
        self._ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="longtrain-gloo-")
        store_path = os.path.join(self._dir, "store")
        self._results: mp.Queue = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, self._tasks[r], self._results, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError("this GlooWorld was killed after a timeout; create a new one")
        call_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(results) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if remaining <= 0 or dead:
                self.close(kill=True)
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                what = f"rank process(es) {dead} died" if dead else f"no answer within {timeout:.0f}s"
                detail = "".join(f"\nrank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
                raise RankTimeout(f"{what}; ranks {missing} did not finish (hang?){detail}")
            try:
                cid, rank, ok, payload = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if cid != call_id:
                continue
            if ok:
                results[rank] = payload
            else:
                errors[rank] = payload
        if errors:
            raise RankError(errors, results)
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill and not self.broken:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.broken = True
        shutil.rmtree(self._dir, ignore_errors=True)


_POOLS: dict[int, GlooWorld] = {}


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; results in rank order."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = _POOLS[world_size] = GlooWorld(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    except RankTimeout:
        _POOLS.pop(world_size, None)
        raise
    except RankError:
        # A rank that raised mid-collective can leave its peers blocked; start clean next time.
        pool.close(kill=True)
        _POOLS.pop(world_size, None)
        raise


def shutdown_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_all)
