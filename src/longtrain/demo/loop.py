"""One rank of the demo: the training loop (:func:`run_rank`), its step-1 parity check and per-step measurements.

Every step:

1. the next packed row of the shipped corpus (several documents, a padding tail) is sharded over the CP ranks by
   :func:`longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx`;
2. inside the step context the model runs forward and backward (GQA layers through ``cp_blockdiag_sdpa``, DSA
   layers with all-gathered latent KV); the loss is the sum of token cross-entropies over this rank's shard
   divided by the number of labels in the whole row, so the gradients summed over the CP ranks equal the
   single-rank gradients;
3. gradients are all-reduced (sum) over the CP group, clipped, and AdamW steps.

At step 1 the same row also runs unsharded on one rank (dense block-diagonal mask for the GQA layers) and the
loss and gradient norm are compared: the ``parity:`` line. Each step records its time, tokens/s, model FLOPs
(:mod:`longtrain.models.flops`) and, on CUDA, the allocator's peak (``torch.cuda.max_memory_allocated``, reset
before the step, so the parity run and the prewarm do not count).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from longtrain.demo.config import (
    DEMO_PREWARM,
    DemoConfig,
    build_model_config,
    dtype_name,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "PARITY_RTOL",
    "CPMesh",
    "ParityError",
    "allreduce_grads",
    "check_parity",
    "packed_cu_seqlens",
    "run_rank",
]

# Relative tolerance of the step-1 parity check, per dtype: CP and single-rank runs sum the same terms in a
# different order (all-gathered vs local K/V, per-document vs masked attention, rank-wise loss sums).
PARITY_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
_GIB = float(1 << 30)


class ParityError(RuntimeError):
    """The CP run disagreed with the single-rank run at step 1."""


class CPMesh:
    """The CP "mesh" ``make_cp_blockdiag_batch_and_ctx`` needs: ``size()``, ``get_local_rank()``, ``get_group()``."""

    def __init__(self, group: Any):
        self.group = group

    def size(self) -> int:
        return torch.distributed.get_world_size(self.group)

    def get_local_rank(self) -> int:
        return torch.distributed.get_rank(self.group)

    def get_group(self) -> Any:
        return self.group


def packed_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[N+1] int32`` run boundaries of a 1-D id row (a padding tail counts as its own run), as the CP step
    state holds them (``BlockdiagCpModelState.packed_cu_seqlens``), on the row's device."""
    from longtrain.blockdiag_cp.step import packed_runs

    return packed_runs(doc_ids.cpu()).to(doc_ids.device, torch.int32)


def _step_loss(model, input_ids, position_ids, labels, step_inputs, num_labels: int) -> torch.Tensor:
    logits = model(input_ids, position_ids, step_inputs)
    loss_sum = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss_sum / num_labels


def allreduce_grads(model: torch.nn.Module, group: Any) -> None:
    """Sum every parameter's gradient over ``group`` in one collective.

    A rank whose shard is all padding produces no gradient for some parameters (its queries attend to nothing),
    so a missing gradient counts as zeros: every rank then issues the same collective with the same size.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def _grad_norm(model) -> float:
    total = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    return math.sqrt(total)


def _reference_step(model, row, device) -> tuple[float, float]:
    """Loss and gradient norm of the whole row on this rank alone (dense block-diagonal mask for GQA)."""
    from longtrain.blockdiag_cp import disable_cp1_packed_varlen, enable_cp1_packed_varlen
    from longtrain.dsa.layer import DSAAttention
    from longtrain.models import StepInputs

    batch = {k: v.to(device) for k, v in row.as_batch().items()}
    doc_ids = batch["_packed_seq_ids"]
    cu = packed_cu_seqlens(doc_ids[0])
    padding = doc_ids[0] == 0
    meta = DSAAttention.prepare_metadata(cu, doc_ids.shape[1], padding_mask=padding)
    model.zero_grad(set_to_none=True)
    enable_cp1_packed_varlen(doc_ids, "dense")
    try:
        loss = _step_loss(
            model,
            batch["input_ids"],
            batch["position_ids"],
            batch["labels"],
            StepInputs(cu_seqlens=cu, padding_mask=padding, dsa_metadata=meta),
            int((batch["labels"] != -100).sum()),
        )
        loss.backward()
    finally:
        disable_cp1_packed_varlen()
    out = float(loss.detach()), _grad_norm(model)
    model.zero_grad(set_to_none=True)
    return out


def check_parity(rank, loss, norm, ref_loss, ref_norm, dtype, device, distributed) -> dict[str, Any]:
    """Compare the CP step with the single-rank reference (computed on rank 0); every rank learns the verdict."""
    rtol = PARITY_RTOL[dtype]
    d_loss = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    d_norm = abs(norm - ref_norm) / max(abs(ref_norm), 1e-12)
    ok = d_loss <= rtol and d_norm <= rtol
    if distributed:
        flag = torch.tensor([1.0 if ok else 0.0], device=device if device.type == "cuda" else "cpu")
        torch.distributed.broadcast(flag, src=0)
        ok = bool(flag.item())
    result = {
        "loss": loss,
        "ref_loss": ref_loss,
        "loss_rel_diff": d_loss,
        "grad_norm": norm,
        "ref_grad_norm": ref_norm,
        "grad_norm_rel_diff": d_norm,
        "rtol": rtol,
        "ok": ok,
    }
    if rank == 0:
        print(
            f"parity: loss cp={loss:.8f} single={ref_loss:.8f} rel_diff={d_loss:.2e} | grad_norm cp={norm:.8f} "
            f"single={ref_norm:.8f} rel_diff={d_norm:.2e} | rtol={rtol:g} {'OK' if ok else 'FAILED'}",
            flush=True,
        )
    if not ok:
        raise ParityError(f"step-1 parity failed: loss rel diff {d_loss:.2e}, grad norm rel diff {d_norm:.2e}")
    return result


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tps: float) -> None:
        if not self.enabled:
            return
        width = 28
        done = int(width * step / self.total)
        text = f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total}  loss {loss:.4f}  {tps:,.0f} tok/s"
        if self.tty:
            print("\r" + text, end="" if step < self.total else "\n", file=sys.stderr, flush=True)
        elif step == 1 or step == self.total or step % max(1, self.total // 10) == 0:
            print(text, file=sys.stderr, flush=True)


def _peak_memory_over_ranks(step1: float | None, steady: float | None, device, distributed) -> tuple[Any, Any]:
    """The largest step-1 and steady-state peaks of any rank (one all-reduce at the end, CUDA only)."""
    if device.type != "cuda" or not distributed:
        return step1, steady
    values = torch.tensor([step1 or 0.0, steady if steady is not None else -1.0], device=device, dtype=torch.float64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return float(values[0]), (float(values[1]) if values[1] >= 0 else None)


def run_rank(cfg: DemoConfig) -> dict[str, Any]:
    """Train on this process's rank (the process group, if any, is already initialised)."""
    import torch.distributed as dist

    from longtrain.blockdiag_cp import (
        attach_cp1_packed_varlen_hooks,
        configure_cp_varlen,
        make_cp_blockdiag_batch_and_ctx,
    )
    from longtrain.corpus import PackedStream
    from longtrain.dsa.layer import DSAAttention
    from longtrain.models import StepInputs, TinyLM
    from longtrain.models.flops import FlopCounter, doc_lengths_of, mfu, peak_tflops
    from longtrain.prewarm import PrewarmConfig, run_prewarms

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = resolve_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dtype = resolve_dtype(cfg, device)
    group = dist.group.WORLD if distributed else None
    mesh = CPMesh(group) if distributed else None
    configure_cp_varlen(attn_backend=cfg.attn_backend, kv_exchange=cfg.kv_exchange)

    torch.manual_seed(cfg.seed)
    model = TinyLM(build_model_config(cfg, device)).to(device=device, dtype=dtype)
    attach_cp1_packed_varlen_hooks(model)
    flop_counter = FlopCounter.for_model(model)
    peak, peak_source = peak_tflops(device, cfg.peak_tflops)
    if cfg.prewarm is not False:
        section = DEMO_PREWARM if cfg.prewarm is None else cfg.prewarm
        # run_prewarms is what PrewarmConfig.apply runs; the demo prints its report.
        report = run_prewarms(PrewarmConfig.from_dict(section), [model], device, batch_size=1)
        if rank == 0:
            print(report.format(), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warm = max(1, cfg.steps // 10)

    def lr_at(step: int) -> float:
        if step <= warm:
            return cfg.lr * step / warm
        t = (step - warm) / max(1, cfg.steps - warm)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    stream = PackedStream(
        cfg.seq_len,
        seed=cfg.seed,
        min_doc=cfg.min_doc,
        max_doc=cfg.doc_span_max,
        documents=cfg.documents,
        max_pad=cfg.max_pad,
    )
    out_dir = Path(cfg.out)
    metrics_file = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = (out_dir / "metrics.jsonl").open("w")
    progress = _Progress(cfg.steps, cfg.progress and rank == 0)
    history: list[dict[str, Any]] = []
    parity: dict[str, Any] | None = None
    step1_peak: float | None = None
    steady_peak: float | None = None

    for step in range(1, cfg.steps + 1):
        row = stream.next_row()
        if step == 1 and cfg.parity:
            ref_loss, ref_norm = _reference_step(model, row, device) if rank == 0 else (0.0, 0.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in row.as_batch().items()}
        num_labels = int((batch["labels"] != -100).sum())
        # One path at every world size: the step's context makes cp_blockdiag_sdpa block-diagonal (no collective
        # on one rank) and the DSA layers read the same step's metadata.
        ctx, local, _layout = make_cp_blockdiag_batch_and_ctx(mesh, None, batch, sharding=cfg.sharding)
        with ctx() as cp_step:
            cu = cp_step.packed_cu_seqlens.to(torch.int32)
            padding = local["_packed_seq_ids"][0] == 0
            if cp_step.contiguous:
                meta = DSAAttention.metadata_for_step(cp_step)
                step_inputs = StepInputs(cu_seqlens=cu, padding_mask=padding, dsa_metadata=meta, cp_group=group)
            else:  # balanced: the DSA layers take the step (their own rows), GDN runs on the whole row
                perm = cp_step.shard_plan.permutation
                order = torch.empty_like(perm)
                order[perm] = torch.arange(perm.numel())
                step_inputs = StepInputs(cu_seqlens=cu, padding_mask=padding, dsa_metadata=None, cp_group=group,
                                         token_index=cp_step.token_index, row_order=order.to(device),
                                         cp_step=cp_step)  # fmt: skip
            loss = _step_loss(
                model, local["input_ids"], local["position_ids"], local["labels"], step_inputs, num_labels
            )
            loss.backward()
        loss_value = loss.detach().double()
        if distributed:
            allreduce_grads(model, group)
            dist.all_reduce(loss_value, group=group)
        loss_value = float(loss_value)
        if step == 1 and cfg.parity:
            parity = check_parity(rank, loss_value, _grad_norm(model), ref_loss, ref_norm, dtype, device, distributed)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak_mem = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak_mem = torch.cuda.max_memory_allocated(device) / _GIB
            if step == 1:
                step1_peak = peak_mem
            else:
                steady_peak = max(steady_peak or 0.0, peak_mem)
        dt = time.perf_counter() - t0
        lengths = doc_lengths_of(row.doc_ids)
        flops = flop_counter.step(lengths).total
        tflops = flops / dt / 1e12
        record = {
            "step": step,
            "loss": loss_value,
            "tokens_per_s": cfg.seq_len / dt,
            "grad_norm": grad_norm,
            "lr": lr_at(step),
            "step_time_s": dt,
            "documents": row.num_documents,
            "real_tokens": sum(lengths),
            "model_flops": flops,
            "model_tflops_per_s": tflops,
            "mfu": mfu(tflops / world, peak),
            "peak_memory_gib": peak_mem,
        }
        history.append(record)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        progress.update(step, loss_value, record["tokens_per_s"])
    if metrics_file is not None:
        metrics_file.close()
    step1_peak, steady_peak = _peak_memory_over_ranks(step1_peak, steady_peak, device, distributed)
    return {
        "rank": rank,
        "world": world,
        "history": history,
        "parity": parity,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "dtype": dtype_name(dtype),
        "layers": model.config.layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_tflops": peak,
        "peak_source": peak_source,
        "step1_peak_memory_gib": step1_peak,
        "steady_peak_memory_gib": steady_peak,
    }
