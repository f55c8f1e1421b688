"""Shared helpers for the block-diagonal kernel tests: layouts and a brute-force oracle."""

from __future__ import annotations

import torch

from longtrain.packing import ids_from_lengths  # noqa: F401  (the helpers below and the tests use it)


def brute_mask(ids: torch.Tensor, row_offset: int, local_len: int) -> torch.Tensor:
    """The documented allow-mask ``[L, S]`` written as a double loop (oracle for the vectorised builder)."""
    s = ids.numel()
    out = torch.zeros(local_len, s, dtype=torch.bool)
    for i in range(local_len):
        p = row_offset + i
        for c in range(s):
            same = ids[p] == ids[c] and ids[p] > 0 and ids[c] > 0 and p >= c
            out[i, c] = bool(same) or p == c
    return out


def brute_segments(ids: list[int], row_offset: int, local_len: int):
    """(n_real, s_first, seg_q, seg_k) by walking the ids (oracle for the segmenter)."""
    local = ids[row_offset : row_offset + local_len]
    n_real = sum(1 for x in local if x > 0)
    if n_real == 0:
        return 0, None, None, None
    seg_q: list[int] = []
    for i in range(n_real):
        if i == 0 or local[i] != local[i - 1]:
            seg_q.append(0)
        seg_q[-1] += 1
    back = 0
    p = row_offset - 1
    while p >= 0 and ids[p] == local[0]:
        back += 1
        p -= 1
    seg_k = [seg_q[0] + back, *seg_q[1:]]
    return n_real, row_offset - back, seg_q, seg_k


def patch_provider(monkeypatch, name: str, attention) -> None:
    """Replace the ``attention`` call of registry entry ``name`` for one test (failure injection, call capture)."""
    from dataclasses import replace

    from longtrain.blockdiag_cp import providers

    monkeypatch.setitem(providers.PROVIDERS, name, replace(providers.PROVIDERS[name], attention=attention))


def meta_from_lengths(seg_q: list[int], seg_k: list[int], device="cpu"):
    """A :class:`VarlenMeta` of segments with these query / key counts (key coordinates from 0)."""
    from longtrain.blockdiag_cp.meta import VarlenMeta

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return VarlenMeta(
        n_real=sum(seg_q), s_first=0, real_end=sum(seg_k), seg_q=tuple(seg_q), seg_k=tuple(seg_k),
        cu_q=cu(seg_q), cu_k=cu(seg_k),
    )  # fmt: skip
