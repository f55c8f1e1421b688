"""Context-parallel parity and scaling of block-diagonal attention over real ranks (NCCL on GPUs, gloo on CPUs).

Launch with torchrun, one process per GPU::

    torchrun --standalone --nproc-per-node 8 benchmarks/cp_scaling.py            # GPUs: bf16, NCCL
    torchrun --standalone --nproc-per-node 2 benchmarks/cp_scaling.py --device cpu --quick   # CPU smoke (gloo)

Sections (rank 0 writes the report ``cp_scaling_<W>ranks_<date>.md/.json``):

1. **parity**: for every K/V exchange (allgather, halo, a2a) and the layouts "documents straddling ranks +
   padding", "an all-padding rank", "one document over all ranks" and "many short documents", the local output
   and the gradients of q, k, v of ``cp_blockdiag_sdpa`` on the rank's shard, against a single-device float64
   reference of the whole row (computed on every rank). GPU rule (flash-attention's): the CP error may be at most
   2x the error of the same backend run unsharded in the same dtype plus one bf16 rounding step; CPU (fp32):
   relative error <= 1e-5.
2. **scaling**: forward and forward+backward time of one attention call per rank at T tokens per rank
   (documents U[512, 8192], and one long document), for each exchange; per-GPU TFLOP/s (mask-area FLOPs of the
   whole row / W / the slowest rank's time) and the fraction of the single-GPU kernel throughput on a T-token
   row of the same distribution (goal: >= 90% at 32K tokens per GPU with all-gather).
3. **dsa**: the DSA layer (``DSAAttention``, latent KV all-gathered) forward+backward per rank at T tokens per
   rank against one GPU with the same T, when ``--dsa`` is given.

The demo's multi-GPU parity is a separate command: ``longtrain demo --cp W --device cuda``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from blockdiag_attention import mask_area  # noqa: E402
from longtrain.blockdiag_cp import (  # noqa: E402
    configure_cp_varlen,
    cp_blockdiag_sdpa,
    kernels,
    make_cp_blockdiag_batch_and_ctx,
    resolve_backend,
)
from longtrain.packing import doc_lengths, ids_from_lengths  # noqa: E402
from longtrain.train import _Mesh  # noqa: E402

EXCHANGES = ("allgather", "halo", "a2a")


def ids_from_total(lengths: list[int], total: int) -> torch.Tensor:
    """Document ids 1.. for ``lengths`` then padding (0) up to ``total``."""
    return ids_from_lengths(lengths, total - sum(lengths))


def parity_layouts(total: int, world: int) -> dict[str, torch.Tensor]:
    local = total // world
    short = doc_lengths(total - 5, 1, 9, seed=3)
    return {
        "straddle+padding": ids_from_total(doc_lengths(total - local // 2, local // 3, local + local // 2, 1), total),
        "all-padding rank": ids_from_total([local // 2, local // 3], total),
        "one document": ids_from_total([total], total),
        "many short docs": ids_from_total(short, total),
    }


def cp_attention(q_full, k_full, v_full, ids, group, dout_full, *, grads: bool):
    """Run ``cp_blockdiag_sdpa`` on this rank's shard of the full tensors; returns (out, dq, dk, dv) local."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = ids.numel()
    dummy = {"inputs_embeds": torch.zeros(1, seq, 1, device=q_full.device), "_packed_seq_ids": ids[None]}
    ctx, _local, _layout = make_cp_blockdiag_batch_and_ctx(_Mesh(group), None, dummy)
    length = seq // world
    rows = slice(rank * length, (rank + 1) * length)
    q = q_full[:, :, rows].detach().clone().requires_grad_(grads)
    k = k_full[:, :, rows].detach().clone().requires_grad_(grads)
    v = v_full[:, :, rows].detach().clone().requires_grad_(grads)
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v, is_causal=True)
        if grads:
            out.backward(dout_full[:, :, rows])
    if not grads:
        return out, None, None, None
    return out, q.grad, k.grad, v.grad


def single_device(q, k, v, ids, dout, backend: str):
    """The whole row on this device, no CP: per-document causal attention and its gradients."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    meta = kernels.precompute_blockdiag_varlen_meta(ids, row_offset=0, local_len=ids.numel(), device=q.device)
    out = kernels._cp_blockdiag_varlen(q, k, v, ids.to(q.device), 0, backend=backend, meta=meta)
    if out is None:
        out = kernels.dense_blockdiag_sdpa(q, k, v, ids.to(q.device), 0)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    a, b = a.detach().double(), b.detach().double()
    if mask is not None:
        a, b = a[..., mask, :], b[..., mask, :]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_parity(args, group, device, dtype, backend) -> list[dict]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    total = args.parity_tokens * world
    rows = []
    for name, ids in parity_layouts(total, world).items():
        g = torch.Generator().manual_seed(7)
        q = torch.randn(1, 8, total, 64, generator=g)
        k, v = torch.randn(1, 2, total, 64, generator=g), torch.randn(1, 2, total, 64, generator=g)
        dout = torch.randn(1, 8, total, 64, generator=g)
        # float64 oracle on the device (the math kernel per document: keep --parity-tokens modest)
        ref = single_device(
            *(t.to(device, torch.float64) for t in (q, k, v)),
            ids.to(device),
            dout.to(device, torch.float64),
            "reference",
        )
        same = single_device(*(t.to(device, dtype) for t in (q, k, v)), ids.to(device), dout.to(device, dtype), backend)
        length = total // world
        sl = slice(rank * length, (rank + 1) * length)
        real = (ids[sl] > 0).to(device)
        for exchange in EXCHANGES:
            configure_cp_varlen(attn_backend=backend, kv_exchange=exchange)
            out, dq, dk, dv = cp_attention(
                *(t.to(device, dtype) for t in (q, k, v)), ids.to(device), group, dout.to(device, dtype), grads=True
            )
            errs, bounds = {}, {}
            for label, cp_t, same_t, ref_t, mask in (
                ("out", out, same[0][:, :, sl], ref[0][:, :, sl], real),
                ("dq", dq, same[1][:, :, sl], ref[1][:, :, sl], None),
                ("dk", dk, same[2][:, :, sl], ref[2][:, :, sl], None),
                ("dv", dv, same[3][:, :, sl], ref[3][:, :, sl], None),
            ):
                r = ref_t.to(device)
                errs[label] = rel_err(cp_t, r, mask)
                if dtype == torch.float32:
                    bounds[label] = 1e-5
                else:
                    bounds[label] = 2 * rel_err(same_t, r, mask) + 2.0**-8
            ok = all(errs[x] <= bounds[x] for x in errs)
            flag = torch.tensor([1.0 if ok else 0.0], device=device)
            worst = torch.tensor([max(errs[x] / bounds[x] for x in errs)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            rows.append(
                {
                    "section": "parity",
                    "layout": name,
                    "exchange": exchange,
                    "backend": backend,
                    "worst_err_over_bound": float(worst),
                    "ok": bool(flag.item()),
                }
            )
    return rows


def _time(fn, device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, all ranks in lockstep (barrier before each call)."""
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def _single_gpu_call(q, k, v, dout, ids, meta, backend: str, *, grads: bool) -> None:
    """One unsharded attention call on the first ``len(ids)`` rows (the single-GPU baseline)."""
    rows = slice(0, ids.numel())
    qq, kk, vv = (t[:, :, rows].detach().requires_grad_(grads) for t in (q, k, v))
    out = kernels._cp_blockdiag_varlen(qq, kk, vv, ids, 0, backend=backend, meta=meta)
    if out is None:
        out = kernels.dense_blockdiag_sdpa(qq, kk, vv, ids, 0)
    if grads:
        out.backward(dout[:, :, rows])


def run_scaling(args, group, device, dtype, backend) -> list[dict]:
    world = dist.get_world_size(group)
    rows = []
    hq, hkv, d = (32, 8, 128) if device.type == "cuda" else (4, 2, 16)
    for per_rank in args.tokens_per_rank:
        total = per_rank * world
        layouts = {
            "docs U[512,8192]": doc_lengths(total, min(512, per_rank), min(8192, total), seed=1),
            "one long document": [total],
        }
        for name, lengths in layouts.items():
            ids = ids_from_total(lengths, total).to(device)
            g = torch.Generator(device="cpu").manual_seed(0)
            q = torch.randn(1, hq, total, d, generator=g).to(device, dtype)
            k = torch.randn(1, hkv, total, d, generator=g).to(device, dtype)
            v = torch.randn(1, hkv, total, d, generator=g).to(device, dtype)
            dout = torch.randn(1, hq, total, d, generator=g).to(device, dtype)
            flops = 4.0 * mask_area(lengths) * hq * d
            # Single-GPU baseline: a per_rank-token row of the same distribution, no exchange.
            if name == "one long document":
                one_lengths = [per_rank]
            else:
                one_lengths = doc_lengths(per_rank, min(512, per_rank), min(8192, per_rank), 1)
            one_ids = ids_from_total(one_lengths, per_rank).to(device)
            one_flops = 4.0 * mask_area(one_lengths) * hq * d
            one_meta = kernels.precompute_blockdiag_varlen_meta(
                one_ids, row_offset=0, local_len=per_rank, device=device
            )
            one = functools.partial(_single_gpu_call, q, k, v, dout, one_ids, one_meta, backend)
            t1_f = _time(functools.partial(one, grads=False), device, args.reps)
            t1_fb = _time(functools.partial(one, grads=True), device, args.reps)
            single_fwd, single_bwd = one_flops / t1_f / 1e12, 2.5 * one_flops / max(t1_fb - t1_f, 1e-9) / 1e12
            for exchange in EXCHANGES:
                configure_cp_varlen(attn_backend=backend, kv_exchange=exchange)
                cp = functools.partial(cp_attention, q, k, v, ids, group, dout)
                t_f = _time(functools.partial(cp, grads=False), device, args.reps)
                t_fb = _time(functools.partial(cp, grads=True), device, args.reps)
                slowest = torch.tensor([t_f, t_fb], device=device, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                t_f, t_fb = slowest.tolist()
                fwd = flops / world / t_f / 1e12
                fb = 3.5 * flops / world / t_fb / 1e12
                single_fb = 3.5 * one_flops / t1_fb / 1e12
                rows.append(
                    {
                        "section": "scaling",
                        "tokens_per_rank": per_rank,
                        "layout": name,
                        "exchange": exchange,
                        "backend": backend,
                        "fwd_tflops_per_gpu": fwd,
                        "fwd_bwd_tflops_per_gpu": fb,
                        "single_gpu_fwd_tflops": single_fwd,
                        "single_gpu_bwd_tflops": single_bwd,
                        "kept_fwd_bwd": fb / single_fb,
                    }
                )
    return rows


def _dsa_step(layer, x, pos, cu, rank: int, per_rank: int, group, *, cp: bool) -> None:
    """DSA layer forward+backward on this rank's rows (``cp``) or on ``per_rank`` rows alone (one GPU)."""
    rows = slice(rank * per_rank, (rank + 1) * per_rank) if cp else slice(0, per_rank)
    cu_rows = cu if cp else torch.tensor([0, per_rank], dtype=torch.int32, device=x.device)
    out = layer(x[rows].detach().requires_grad_(True), pos[rows], cu_rows, cp_group=group if cp else None)
    out.float().square().mean().backward()


def run_dsa(args, group, device, dtype) -> list[dict]:
    from longtrain.dsa.layer import DSAAttention, DSAConfig
    from longtrain.models import TinyLMConfig

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = []
    if device.type == "cuda":
        cfg = DSAConfig(hidden_size=2048, num_heads=64, q_lora_rank=1024)
    else:
        # the demo model's CPU-sized DSA layer
        cfg = dataclasses.replace(TinyLMConfig().dsa_config(), index_topk=16, backend="torch")
    torch.manual_seed(0)
    layer = DSAAttention(cfg, 0, "full").to(device, dtype)
    for per_rank in args.dsa_tokens_per_rank:
        total = per_rank * world
        lengths = doc_lengths(total, min(4096, per_rank), min(16384, total), seed=5)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        x = torch.randn(total, cfg.hidden_size, device=device, dtype=dtype) * 0.1

        step = functools.partial(_dsa_step, layer, x, pos, cu, rank, per_rank, group)
        t_cp = _time(functools.partial(step, cp=True), device, args.reps)
        t_one = _time(functools.partial(step, cp=False), device, args.reps)
        worst = torch.tensor([t_cp], device=device, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        rows.append(
            {
                "section": "dsa",
                "tokens_per_rank": per_rank,
                "fwd_bwd_ms_cp": float(worst) * 1e3,
                "fwd_bwd_ms_single_gpu": t_one * 1e3,
                "kept": t_one / float(worst),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", help="varlen backend (auto: the fastest available)")
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=None)
    p.add_argument("--parity-tokens", type=int, default=None, help="tokens per rank of the parity rows")
    p.add_argument("--dsa", action="store_true", help="also time the DSA layer with CP")
    p.add_argument("--dsa-tokens-per-rank", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke test)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.tokens_per_rank is None:
        args.tokens_per_rank = [256] if args.quick else ([32768, 131072] if cuda else [1024])
    if args.parity_tokens is None:
        args.parity_tokens = 64 if args.quick else (1024 if cuda else 256)
    if args.dsa_tokens_per_rank is None:
        args.dsa_tokens_per_rank = [128] if args.quick else ([32768] if cuda else [512])
    if args.reps is None:
        args.reps = 2 if args.quick else (10 if cuda else 3)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.group.WORLD
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = resolve_backend(args.backend, dtype, device)
    rows = run_parity(args, group, device, dtype, backend)
    rows += run_scaling(args, group, device, dtype, backend)
    if args.dsa:
        rows += run_dsa(args, group, device, dtype)
    world = dist.get_world_size(group)
    failed = [r for r in rows if r["section"] == "parity" and not r["ok"]]
    if dist.get_rank() == 0:
        from _report import write_report

        columns = [
            "section",
            "layout",
            "tokens_per_rank",
            "exchange",
            "backend",
            ("ok", "parity ok"),
            ("worst_err_over_bound", "err / bound"),
            ("fwd_tflops_per_gpu", "fwd TFLOP/s per GPU"),
            ("fwd_bwd_tflops_per_gpu", "fwd+bwd TFLOP/s per GPU"),
            ("single_gpu_fwd_tflops", "1-GPU fwd TFLOP/s"),
            ("single_gpu_bwd_tflops", "1-GPU bwd TFLOP/s"),
            ("kept_fwd_bwd", "kept (fwd+bwd)"),
            ("fwd_bwd_ms_cp", "DSA fwd+bwd ms (CP)"),
            ("fwd_bwd_ms_single_gpu", "DSA ms (1 GPU)"),
            "kept",
        ]
        sections = __doc__[__doc__.index("Sections") :]
        notes = f"{world} ranks, {device.type}, {str(dtype)[6:]}, backend {backend}.\n\n{sections}"
        md, js = write_report(f"cp_scaling_{world}ranks", rows, columns, notes, out_dir=args.out_dir)
        print(f"wrote {md} and {js}; parity failures: {len(failed)}", flush=True)
    dist.barrier()
    gc.collect()  # torch 2.13's gloo can abort at exit otherwise (benchmarks/results/exit_check_*)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
