"""A float64 model of what the deterministic sparse MLA backward's pieces format costs dkv (CPU, no GPU needed).

``python benchmarks/dsa_pieces_model.py [--out-dir DIR] [--case T,H,K ...]`` writes ``dsa_pieces_model_<date>.md``.
The deterministic mode (``longtrain.dsa.triton.sparse_mla_bwd``) stores one dkv piece per (row, slot, block of 64
heads), the slot's sum over those heads of ``dS * q + P * [dO, 0]``, and sums each key's pieces in fp32 in a fixed
order; ``DET_PIECES`` sets the pieces' format. This script forms the exact pieces in float64 from bf16 inputs (GLM-5.2
dims, one document, query t selecting min(t + 1, K) random causal keys, softmax probabilities from the real logits),
rounds them as each format stores them (fp32; bf16; fp16 after dividing each piece by the power of two at or above its
largest element, the portable kernel's scale), sums them in fp32, rounds dkv to bf16 as the kernels return it, and
compares with the float64 dkv. The rounding of each format is exact here (round to nearest, as the GPU converts); the
kernels' own fp32 accumulation inside a piece is not modelled (it is the same for every format). The GPU measurement
of the same question is ``python benchmarks/dsa_bwd_deterministic.py --accuracy``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS_DIR, reproduce_args, write_report  # noqa: E402

D_QK, D_V, HEAD_BLOCK = 576, 512, 64
CASES = ((2048, 64, 512), (2048, 128, 512))


def _inputs(total: int, heads: int, topk: int, seed: int = 0):
    """bf16-valued float64 q, kv, dO; the index sets; P and dS of the attention (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, D_QK, generator=gen).to(torch.bfloat16).double()
    kv = torch.randn(total, D_QK, generator=gen).to(torch.bfloat16).double()
    dout = torch.randn(total, heads, D_V, generator=gen).to(torch.bfloat16).double()
    idx = torch.full((total, topk), -1, dtype=torch.long)
    for t in range(total):
        n = min(t + 1, topk)
        idx[t, :n] = torch.randperm(t + 1, generator=gen)[:n]
    valid = idx >= 0
    keys = kv[idx.clamp(min=0)]  # [T, K, D_qk]
    scale = D_QK**-0.5
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    p = torch.softmax(logits.masked_fill(~valid[:, None, :], float("-inf")), -1)
    dp = torch.einsum("thv,tkv->thk", dout, keys[..., :D_V])
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    return q, dout, idx, valid, p, ds


def _pieces(q, dout, p, ds, head_block: slice) -> torch.Tensor:
    """The exact pieces of one block of heads, ``[T, K, D_qk]`` float64."""
    hb = head_block
    piece = torch.einsum("thk,thd->tkd", ds[:, hb], q[:, hb])
    piece[..., :D_V] += torch.einsum("thk,thv->tkv", p[:, hb], dout[:, hb])
    return piece


def _store(piece: torch.Tensor, fmt: str) -> torch.Tensor:
    """``piece`` as the format stores it, read back as fp32 (float64-valued)."""
    if fmt == "fp32":
        return piece.float().double()
    if fmt == "bf16":
        return piece.to(torch.bfloat16).double()
    if fmt == "fp16":  # scaled: divided by the power of two at or above the row's largest element
        top = piece.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
        scale = torch.exp2(torch.ceil(torch.log2(top)))
        return (piece / scale).to(torch.float16).double() * scale
    raise ValueError(fmt)


def dkv_errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """``mean_err`` (mean |got - want| / mean |want|) and ``max_err`` (max |got - want| / max |want|) of a dkv
    against its float64 reference ``want``."""
    err = (got.double() - want).abs()
    return dict(mean_err=(err.mean() / want.abs().mean()).item(), max_err=(err.max() / want.abs().max()).item())


def _case(rows: list[dict], total: int, heads: int, topk: int) -> None:
    q, dout, idx, valid, p, ds = _inputs(total, heads, topk)
    flat, mask = idx.clamp(min=0).reshape(-1), valid.reshape(-1)
    exact = torch.zeros(total, D_QK, dtype=torch.float64)
    sums = {f: torch.zeros(total, D_QK, dtype=torch.float32) for f in ("fp32", "fp16", "bf16")}
    for h0 in range(0, heads, HEAD_BLOCK):
        piece = _pieces(q, dout, p, ds, slice(h0, h0 + HEAD_BLOCK)).reshape(-1, D_QK)[mask]
        exact.index_add_(0, flat[mask], piece)
        for fmt, acc in sums.items():
            acc.index_add_(0, flat[mask], _store(piece, fmt).float())
    shape = f"T={total} H={heads} K={topk} 1doc"
    results = {
        "float64 dkv rounded to bf16 (the floor)": exact.to(torch.bfloat16),
        "fp32 pieces (the default backward's fp32 sum, in another order)": sums["fp32"].to(torch.bfloat16),
        "scaled fp16 pieces": sums["fp16"].to(torch.bfloat16),
        "bf16 pieces": sums["bf16"].to(torch.bfloat16),
    }
    base = None
    for name, dkv in results.items():
        row = dict(shape=shape, variant=name, **dkv_errors(dkv, exact))
        if name.startswith("fp32"):
            base = row["mean_err"]
        rows.append(row)
        print(row, flush=True)
    for row in rows:
        if row["shape"] == shape:
            row["of_fp32"] = row["mean_err"] / base
    del exact, sums


def main(out_dir: Path, cases) -> None:
    rows: list[dict] = []
    for total, heads, topk in cases:
        _case(rows, total, heads, topk)
    write_report(
        "dsa_pieces_model", rows, ["shape", "variant", "mean_err", "max_err", "of_fp32"],
        "dkv of the deterministic sparse MLA backward per pieces format, modelled in float64 on CPU (see the script's "
        "docstring): mean_err = mean |dkv - ref| / mean |ref|, max_err = max |dkv - ref| / max |ref| against the "
        "float64 dkv; of_fp32 = mean_err over the fp32 pieces'. Reproduce: "
        f"`python benchmarks/dsa_pieces_model.py {reproduce_args()}`.",
        out_dir=out_dir, title="Sparse MLA backward: what the deterministic mode's pieces format costs dkv (model)",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--case", action="append", default=None, help="T,H,K (repeatable); default: two shapes")
    args = parser.parse_args()
    chosen = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else list(CASES)
    main(args.out_dir, chosen)
