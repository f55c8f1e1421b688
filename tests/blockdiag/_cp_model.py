"""Shared pieces of the block-diagonal CP runtime tests: a tiny q/k/v/o attention layer, its single-process
dense reference, the document layouts under test and a collective counter."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

E, HQ, HKV, D = 16, 4, 2, 8  # GQA 4:2, small dims

# Document lengths of each case; a trailing ("pad", n) adds n padding positions inside the sequence.
CASES: dict[str, list[int]] = {
    # documents straddle rank boundaries, padding tail inside S (and the CP pad after it)
    "straddle_pad": [5, 9, 3, 6, -4],
    # 7 real tokens then padding: every rank but the first (W=2, 3) or two (W=4) is all padding
    "all_pad_rank": [3, 4, -13],
    # one document over every rank (straddle > L for W >= 3, so halo turns into a2a)
    "one_doc": [22],
}


def _many_short() -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return [*torch.randint(1, 5, (50,), generator=g).tolist(), -3]


CASES["many_short"] = _many_short()


def case_ids(name: str) -> torch.Tensor:
    """``[S] int64`` document ids of a case (negative lengths are padding)."""
    out: list[int] = []
    doc = 0
    for n in CASES[name]:
        if n < 0:
            out += [0] * -n
        else:
            doc += 1
            out += [doc] * n
    return torch.tensor(out, dtype=torch.int64)


def make_params(seed: int = 0) -> list[torch.Tensor]:
    """float64 ``[Wq, Wk, Wv, Wo]``."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(HQ * D, E), (HKV * D, E), (HKV * D, E), (E, HQ * D)]
    return [torch.randn(s, generator=g, dtype=torch.float64) / E**0.5 for s in shapes]


def make_inputs(seq_len: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 embeddings ``x: [1, S, E]`` and an upstream gradient ``g: [1, S, E]``."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, seq_len, E, generator=g, dtype=torch.float64),
        torch.randn(1, seq_len, E, generator=g, dtype=torch.float64),
    )


def attention_layer(x: torch.Tensor, params: list[torch.Tensor], sdpa) -> torch.Tensor:
    """``x: [1, T, E]`` -> ``[1, T, E]`` through q/k/v projections, ``sdpa(q, k, v, is_causal=True)``, o."""
    wq, wk, wv, wo = params
    t = x.shape[1]
    q = (x @ wq.T).view(1, t, HQ, D).transpose(1, 2)
    k = (x @ wk.T).view(1, t, HKV, D).transpose(1, 2)
    v = (x @ wv.T).view(1, t, HKV, D).transpose(1, 2)
    o = sdpa(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(1, t, HQ * D) @ wo.T


def reference_sdpa(ids: torch.Tensor):
    """Dense block-causal SDPA over the full unpadded sequence (heads repeated for GQA)."""
    s = ids.numel()
    pos = torch.arange(s)
    mask = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0) & (pos[:, None] >= pos[None, :])
    mask |= torch.eye(s, dtype=torch.bool)

    def sdpa(q, k, v, is_causal=False):
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
        )

    return sdpa


def reference_run(ids: torch.Tensor) -> dict:
    """float64 forward/backward of the layer on the full sequence; loss weights padding rows by zero."""
    s = ids.numel()
    params = [p.requires_grad_() for p in make_params()]
    x, g = make_inputs(s)
    x.requires_grad_()
    y = attention_layer(x, params, reference_sdpa(ids))
    weight = g * (ids > 0).view(1, s, 1)
    (y * weight).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "param_grads": [p.grad for p in params], "g": weight}


def fp32_case(name: str):
    """``(ids, S, float64 reference run, fp32 params, fp32 embeddings x, the batch)`` of a case: what a CP run of
    the layer on the case starts from (``x`` and the params require grad)."""
    ids = case_ids(name)
    s = ids.numel()
    x64, _ = make_inputs(s)
    ref = reference_run(ids)
    params = [p.float().requires_grad_() for p in make_params()]
    x = x64.float().requires_grad_()
    batch = {"inputs_embeds": x, "_packed_seq_ids": ids[None].clone(), "labels": torch.arange(s)[None]}
    return ids, s, ref, params, x, batch


_COUNTED = ("all_gather", "reduce_scatter", "all_reduce", "batch_isend_irecv", "all_to_all_single")


@contextlib.contextmanager
def count_collectives():
    """Count calls of the exchange-relevant ``torch.distributed`` collectives inside the block."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def wrap(name):
        real = originals[name]

        def counted(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return counted

    for name in _COUNTED:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max-norm relative error ``max|a - e| / max|e|`` (0 for two empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class FakeMesh:
    """The three methods ``make_cp_blockdiag_batch_and_ctx`` needs from a 1-D DeviceMesh."""

    def __init__(self, world: int, rank: int, group=None):
        self._world, self._rank, self._group = world, rank, group

    def size(self) -> int:
        return self._world

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self):
        return self._group
