"""Compile and autotune every Triton DSA kernel for a model's static dims before training step 1."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from longtrain.dsa.triton._common import SELECT_BY_KEYS, indexer_fp8_unfit, require_available

__all__ = ["causal_topk_indices", "warmup"]


def causal_topk_indices(
    num_tokens: int, topk: int, *, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random canonical index rows for one causal document: row ``t`` holds ``min(t+1, K)`` keys of ``[0, t]``.

    Returns ``(indices [T, K] int32`` ascending then ``-1``, ``topk_length [T] int32)``.
    """
    scores = torch.rand((num_tokens, num_tokens), generator=generator)
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -1.0)
    width = min(topk, num_tokens)
    chosen = scores.topk(width, dim=1).indices
    length = torch.clamp(torch.arange(num_tokens) + 1, max=topk)
    chosen = torch.where(torch.arange(width)[None, :] < length[:, None], chosen, num_tokens).sort(dim=1).values
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32)
    out[:, :width] = torch.where(chosen < num_tokens, chosen, -1).to(torch.int32)
    return out.to(device), length.to(torch.int32).to(device)


def warmup(
    *,
    num_heads: int,
    d_qk: int,
    d_v: int,
    topk: int,
    index_heads: int,
    index_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_tokens: int = 512,
    with_sink: bool = False,
    with_topk_length: bool = True,
) -> dict[str, Any]:
    """Run the sparse MLA forward + backward and the indexer top-k once at ``num_tokens`` tokens (the indexer also
    with FP8 scores where they run: CUDA SM89+ or the interpreter; ``"index_fp8"`` in the result says whether).

    Autotune keys are static model dims (heads, head dims, dtype), so this fills every autotune and
    compilation cache the training step will hit; token counts never re-trigger tuning. The RNG state of
    the caller is left untouched.

    Returns:
        ``{"kernels": [...], "seconds": float, "num_tokens": int, ...}`` describing what was warmed.
    """
    device = torch.device(device)
    require_available(device)
    from longtrain.dsa.triton import indexer_topk
    from longtrain.dsa.triton.sparse_mla import sparse_mla_triton

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    num_tokens = max(1, int(num_tokens))
    idx, length = causal_topk_indices(num_tokens, topk, generator=gen, device=device)
    q = (torch.randn((num_tokens, num_heads, d_qk), generator=gen) * 0.5).to(device=device, dtype=dtype)
    kv = (torch.randn((num_tokens, 1, d_qk), generator=gen) * 0.5).to(device=device, dtype=dtype)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    sink = torch.zeros(num_heads, device=device, requires_grad=True) if with_sink else None
    out = sparse_mla_triton(
        q, kv, idx, d_qk**-0.5, d_v=d_v, topk_length=length if with_topk_length else None, attn_sink=sink
    )
    grads = torch.autograd.grad(out, [t for t in (q, kv, sink) if t is not None], torch.ones_like(out))
    iq = torch.randn((num_tokens, index_heads, index_dim), generator=gen).to(device=device, dtype=dtype)
    ik = torch.randn((num_tokens, index_dim), generator=gen).to(device=device, dtype=dtype)
    weights = torch.randn((num_tokens, index_heads), generator=gen).to(device)
    starts = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    lengths = torch.arange(1, num_tokens + 1, dtype=torch.int32, device=device)
    # A K below the row lengths makes the scoring and radix-select kernels run, not only the fast path; the
    # selection compiles once per (sample, candidates) setting its defaults pick by key count: warm each of them.
    base = indexer_topk.default_config()
    for _, sample, cand in SELECT_BY_KEYS:
        cfg = dataclasses.replace(base, select_sample=sample, select_cand=cand)
        selected = indexer_topk.indexer_topk_triton(
            iq, ik, weights, starts, lengths, max(1, min(topk, num_tokens // 2)), config=cfg
        )
    # The FP8 scores (``fp8=True``) are their own compiled variant of the scoring kernel: warmed where they run.
    index_fp8 = indexer_fp8_unfit(device) is None
    if index_fp8:
        selected = indexer_topk.indexer_topk_triton(
            iq, ik, weights, starts, lengths, max(1, min(topk, num_tokens // 2)), config=cfg, fp8=True
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_backward_plan, sm90_dq_plan
    from longtrain.dsa.triton.sparse_mla_fwd import _sm90_default

    fwd_kernel = "sparse_mla_fwd_sm90_kernel" if _sm90_default(q, d_v) else "sparse_mla_fwd_kernel"
    plan = sm90_backward_plan(q, d_v, None, compute_dkv=True, dkv_forced=False)
    bwd_kernels = {
        None: ["sparse_mla_bwd_kernel_ds", "sparse_mla_bwd_kernel_dkv"],
        "ds": ["sparse_mla_bwd_sm90_kernel_ds", "sparse_mla_bwd_kernel_dkv"],
        "fused": ["sparse_mla_bwd_sm90_kernel_ds_dkv"],
        "fused_ws": ["sparse_mla_bwd_sm90_ws_kernel"],
    }[plan and plan[0]]
    dq_kernel = "sparse_mla_bwd_sm90_kernel_dq" if sm90_dq_plan(q, d_v, None) else "sparse_mla_bwd_kernel_dq"
    # The bf16/fp16 scores run the SM90 kernel where it applies; the FP8 codes always score on the portable kernel.
    sm90_scores = indexer_topk.scores_route(iq, base, False) == "sm90"
    score_kernels = ["indexer_topk_fwd_sm90_kernel_scores"] if sm90_scores else []
    if index_fp8 or not sm90_scores:
        score_kernels.append("indexer_topk_fwd_kernel_scores")
    del q, kv, out, grads, iq, ik, selected
    return {
        "kernels": [
            fwd_kernel,
            "sparse_mla_bwd_kernel_preprocess",
            *bwd_kernels,
            dq_kernel,
            *score_kernels,
            "indexer_topk_fwd_kernel_select",
        ],
        "shape": {
            "num_heads": num_heads,
            "d_qk": d_qk,
            "d_v": d_v,
            "topk": topk,
            "index_heads": index_heads,
            "index_dim": index_dim,
            "dtype": str(dtype),
        },
        "index_fp8": index_fp8,
        "num_tokens": num_tokens,
        "device": str(device),
        "finite": finite,
        "seconds": time.perf_counter() - start,
    }
