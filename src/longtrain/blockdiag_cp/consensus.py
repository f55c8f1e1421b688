"""Ranks agree or all fail together: the once-per-step fingerprint check of a context-parallel step.

Before the first collective of a step that depends on sizes (the K/V exchange), every rank publishes a fingerprint
of what decides the collectives: the document-id layout (a hash of the replicated ids), the padded length and the
world size, the attention call's dtype, head counts and head dim, the configured backend and the exchange mode,
and whether the rank's own checks passed. One small exchange through the process group's key-value store (fixed
size, so it cannot itself mismatch) gives every rank all fingerprints; every rank then raises the same
:class:`CPMismatchError` naming the field and the ranks that differ. A rank that never arrives (it failed before the
step and stays alive) makes every waiting rank raise :class:`CPTimeoutError` naming it once
``configure_cp_varlen(step_timeout_s=...)`` has passed (the store's own timeout, 30 minutes by default, otherwise).

The check runs once per step (memoised on the step) and costs nothing per layer.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import time
from typing import Any

import torch
import torch.distributed

__all__ = ["CPMismatchError", "CPStepError", "CPTimeoutError", "exchange_fingerprints", "mismatch"]


class CPMismatchError(ValueError):
    """The ranks of a CP step disagree on something that decides its collectives (raised on every rank alike)."""


class CPTimeoutError(RuntimeError):
    """Some ranks of a CP step did not arrive at the step's check within the bound (raised on every waiting rank)."""


class CPStepError(RuntimeError):
    """A failure on some rank inside a CP step, raised on every rank alike (the failing ranks' reasons are logged)."""


_SEQUENCE: dict[tuple, itertools.count] = {}
_POLL_S = 1.0


def _store(group: Any):
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _group_key(group: Any) -> tuple:
    dist = torch.distributed
    try:
        return tuple(dist.get_process_group_ranks(group)) if group is not None else ("world", dist.get_world_size())
    except Exception:  # a stub group in tests
        return ("group", id(group))


def exchange_fingerprints(group: Any, rank: int, world: int, payload: str, timeout_s: float | None) -> list[str]:
    """Every rank's ``payload`` (in rank order), through the default store: one set and one wait per rank.

    Raises :class:`CPTimeoutError` naming the ranks whose payload did not arrive within ``timeout_s`` (None: the
    store's timeout). The previous exchange's own key is deleted once every rank has moved past it.
    """
    store = _store(group)
    key = _group_key(group)
    seq = next(_SEQUENCE.setdefault(key, itertools.count()))
    prefix = f"longtrain/cp_step/{'-'.join(map(str, key))}/{seq}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], payload)
    bound = timeout_s if timeout_s is not None else store.timeout.total_seconds()
    start = time.monotonic()
    while True:  # short waits, so that a signal (Ctrl-C) reaches Python within a second
        left = bound - (time.monotonic() - start)
        try:
            store.wait(keys, datetime.timedelta(seconds=min(_POLL_S, max(left, 0.001))))
            break
        except Exception as exc:  # the store's timeout error (its class differs between torch versions)
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            if time.monotonic() - start < bound:
                continue
            missing = [r for r in range(world) if not store.check([keys[r]])]
            if not missing:
                continue
            raise CPTimeoutError(
                f"CP ranks {missing} of {world} did not reach the step check within {time.monotonic() - start:.1f} "
                f"s (step {seq}); they failed or are stuck before the step (this rank: {rank})"
            ) from exc
    values = [v.decode() if isinstance(v, bytes) else str(v) for v in store.multi_get(keys)]
    if seq:
        with contextlib.suppress(Exception):
            store.delete_key(f"longtrain/cp_step/{'-'.join(map(str, key))}/{seq - 1}/{rank}")
    return values


def mismatch(payloads: list[str]) -> str | None:
    """The message naming the first field the payloads (``k=v;...``) disagree on, or None when they agree."""
    parsed = [dict(item.split("=", 1) for item in p.split(";") if item) for p in payloads]
    fields = list(parsed[0])
    for f in {f for p in parsed for f in p}:
        if f not in fields:
            fields.append(f)
    for name in fields:
        values = [p.get(name, "<missing>") for p in parsed]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
            return f"CP ranks disagree on {name} ({detail})"
    return None
