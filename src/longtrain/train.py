"""The demo training loop: a small LM on packed documents with context parallelism, prewarm and a parity check.

``longtrain demo`` (see :func:`main`) validates its options, then runs :func:`run_rank` on ``cp`` processes joined
by torch.distributed (gloo on CPU, NCCL on CUDA), launched by itself through a FileStore in a temporary
directory, or by ``torchrun`` (then ``WORLD_SIZE`` ranks are the CP group). Every step:

1. the next packed row of the shipped corpus (several documents, a padding tail) is sharded contiguously over
   the CP ranks by :func:`longtrain.blockdiag_cp.make_cp_blockdiag_batch_and_ctx`;
2. inside the step context the model runs forward and backward (GQA layers through ``cp_blockdiag_sdpa``, DSA
   layers with all-gathered latent KV); the loss is the sum of token cross-entropies over this rank's shard
   divided by the number of labels in the whole row, so the gradients summed over the CP ranks equal the
   single-rank gradients;
3. gradients are all-reduced (sum) over the CP group, clipped, and AdamW steps.

At step 1 the same row also runs unsharded on one rank (dense block-diagonal mask for the GQA layers) and the
loss and gradient norm are compared: the ``parity:`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["DemoConfig", "DemoConfigError", "add_demo_arguments", "config_from_args", "main", "run_rank"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# Relative tolerance of the step-1 parity check, per dtype: CP and single-rank runs sum the same terms in a
# different order (all-gathered vs local K/V, per-document vs masked attention, rank-wise loss sums).
_PARITY_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class DemoConfigError(ValueError):
    """An impossible or unavailable demo option (reported to the user, exit code 2)."""


@dataclass(kw_only=True)
class DemoConfig:
    """Options of ``longtrain demo`` (also the keys of its ``--config`` YAML file)."""

    steps: int = 200
    """Optimizer steps."""
    seq_len: int = 2048
    """Tokens per packed row (the global sequence, before sharding); divisible by 2 * cp."""
    cp: int = 2
    """Context-parallel ranks (processes)."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available)."""
    dtype: str = "auto"
    """``float32`` or ``bfloat16``; ``auto``: float32 on CPU, bfloat16 on CUDA."""
    attn_backend: str = "auto"
    """Varlen backend of the GQA layers (any name ``configure_cp_varlen`` accepts)."""
    kv_exchange: str = "allgather"
    """K/V exchange of the GQA layers: ``allgather``, ``halo`` or ``a2a``."""
    sharding: str = "contiguous"
    """Which positions each CP rank owns: ``contiguous`` or ``balanced`` (equal causal work; the DSA and GDN layers
    then run on the whole row and keep each rank's rows)."""
    dsa_backend: str = "auto"
    """Backend of the DSA layers: ``auto``, ``triton``, ``cudnn`` or ``torch``."""
    seed: int = 0
    """Seed of the model initialisation and of the data stream."""
    lr: float = 3e-3
    """AdamW learning rate (cosine decay to 10% after 10% warm-up)."""
    out: str = "runs/demo"
    """Output folder: metrics.jsonl, loss_curve.png, summary.json."""
    model: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`longtrain.models.TinyLMConfig` (e.g. ``hidden_size``, ``layers``, ``dsa``)."""
    prewarm: dict[str, Any] | bool | None = None
    """The ``prewarm:`` section, read by :meth:`longtrain.prewarm.PrewarmConfig.from_dict` (``true`` is refused
    there and here); None: the demo's set (cuBLAS, fla GDN, DSA and block-diagonal autotune, comm groups);
    ``false`` (``--no-prewarm``): none."""
    parity: bool = True
    """Run the step-1 parity check against a single-rank run of the same row."""
    progress: bool = True
    """Draw a progress bar on rank 0."""

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DemoConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.seq_len % (2 * self.cp):
            raise DemoConfigError(
                f"--seq-len {self.seq_len} is not divisible by 2 * cp = {2 * self.cp}: contiguous CP sharding splits "
                f"the row into 2 * cp equal chunks; use e.g. --seq-len {self.seq_len + (-self.seq_len) % (2 * self.cp)}"
            )
        if self.seq_len < 16:
            raise DemoConfigError(f"--seq-len must be at least 16, got {self.seq_len}")
        if self.sharding not in ("contiguous", "balanced"):
            raise DemoConfigError(f"--sharding must be contiguous or balanced, got {self.sharding!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise DemoConfigError(f"--device must be one of cpu, cuda, auto; got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise DemoConfigError(f"--dtype must be one of auto, float32, bfloat16; got {self.dtype!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise DemoConfigError(f"--lr must be a positive number, got {self.lr!r}")
        if not isinstance(self.model, dict):
            raise DemoConfigError(f"model: must be a mapping of TinyLMConfig fields, got {type(self.model).__name__}")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> DemoConfig:
        """Read the YAML file (top-level keys are the fields of this class), then apply ``overrides``."""
        try:
            import yaml
        except ImportError:
            raise DemoConfigError(
                f"--config {path}: reading YAML needs pyyaml: pip install pyyaml (or pip install 'longtrain[demo]')"
            ) from None
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise DemoConfigError(f"--config {path}: no such file") from None
        except yaml.YAMLError as exc:
            raise DemoConfigError(f"--config {path}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise DemoConfigError(f"--config {path}: expected a mapping at the top level, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DemoConfigError(f"--config {path}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
        data.update(overrides)
        return cls(**data)


#: The prewarms the demo runs when its config has no ``prewarm:`` section.
DEMO_PREWARM = {
    "cublas_backward": True, "fla_gdn_autotune": True, "dsa_autotune": True, "blockdiag_autotune": True,
    "comm_groups": True,
}  # fmt: skip


def resolve_device(cfg: DemoConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: DemoConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_environment(cfg: DemoConfig) -> None:
    """Fail fast, before any process starts, on options this machine cannot run."""
    from longtrain.blockdiag_cp import providers, state
    from longtrain.dsa import ops

    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DemoConfigError("--device cuda: no CUDA device is visible (use --device cpu)")
        if cfg.cp > torch.cuda.device_count() and "WORLD_SIZE" not in os.environ:
            raise DemoConfigError(
                f"--cp {cfg.cp} needs {cfg.cp} GPUs (one per rank), this machine has {torch.cuda.device_count()}"
            )
    try:
        attn = state.normalize_attn_backend(cfg.attn_backend)
        state.normalize_kv_exchange(cfg.kv_exchange)
    except ValueError as exc:
        raise DemoConfigError(str(exc)) from None
    if device.type != "cuda" and attn not in ("auto", "dense", "reference", "flex"):
        raise DemoConfigError(
            f"--attn-backend {cfg.attn_backend}: needs a CUDA device, and this run is on {device} "
            "(use --attn-backend auto, reference or dense on CPU)"
        )
    if cfg.prewarm is not None and cfg.prewarm is not False:
        from longtrain.prewarm import PrewarmConfig, PrewarmConfigError

        try:
            PrewarmConfig.from_dict(cfg.prewarm)
        except PrewarmConfigError as exc:
            raise DemoConfigError(f"prewarm: {exc}") from None
    if attn not in ("auto", "dense"):
        reason = providers.unavailable_reason(attn, dtype, device)
        if reason is not None:
            raise DemoConfigError(f"--attn-backend {cfg.attn_backend}: not available here ({reason}); try auto")
    if cfg.dsa_backend not in ops.BACKENDS:
        raise DemoConfigError(f"--dsa-backend must be one of {list(ops.BACKENDS)}, got {cfg.dsa_backend!r}")
    if cfg.dsa_backend == "triton" and ops._triton_reason(device) is not None:
        raise DemoConfigError(f"--dsa-backend triton: not available on {device} ({ops._triton_reason(device)})")
    if cfg.dsa_backend == "cudnn":
        reason = ops._cudnn_reason(device)
        if reason is not None:
            raise DemoConfigError(f"--dsa-backend cudnn: not available ({reason})")
    build_model_config(cfg, device)


def build_model_config(cfg: DemoConfig, device: torch.device):
    from longtrain import _optional
    from longtrain.models import TinyLMConfig, default_layer_pattern

    overrides = dict(cfg.model)
    with_gdn = device.type == "cuda" and _optional.fla()[0]
    overrides.setdefault("layers", default_layer_pattern(with_gdn))
    dsa = dict(overrides.pop("dsa", {}) or {})
    dsa.setdefault("backend", cfg.dsa_backend)
    if "N" in overrides["layers"] and not with_gdn:
        raise DemoConfigError(
            f"model.layers={overrides['layers']!r} has a GDN layer 'N', which needs CUDA and fla "
            f"({_optional.fla()[1] or 'CPU device'})"
        )
    valid = sorted(f.name for f in dataclasses.fields(TinyLMConfig))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise DemoConfigError(f"model: unknown key(s) {unknown}; valid keys: {valid}")
    try:
        model_cfg = TinyLMConfig(**overrides, dsa=dsa)
        model_cfg.dsa_config()
    except (TypeError, ValueError) as exc:
        raise DemoConfigError(f"model: {exc}") from None
    return model_cfg


# --------------------------------------------------------------------------------------------------------------
# One rank


class _Mesh:
    """The CP "mesh" ``make_cp_blockdiag_batch_and_ctx`` needs: ``size()``, ``get_local_rank()``, ``get_group()``."""

    def __init__(self, group: Any):
        self.group = group

    def size(self) -> int:
        return torch.distributed.get_world_size(self.group)

    def get_local_rank(self) -> int:
        return torch.distributed.get_rank(self.group)

    def get_group(self) -> Any:
        return self.group


def _packed_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
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


def _reference_step(model, row, device, cfg: DemoConfig) -> tuple[float, float]:
    """Loss and gradient norm of the whole row on this rank alone (dense block-diagonal mask for GQA)."""
    from longtrain.blockdiag_cp import disable_cp1_packed_varlen, enable_cp1_packed_varlen
    from longtrain.dsa.layer import DSAAttention
    from longtrain.models import StepInputs

    batch = {k: v.to(device) for k, v in row.as_batch().items()}
    doc_ids = batch["_packed_seq_ids"]
    cu = _packed_cu_seqlens(doc_ids[0])
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
    mesh = _Mesh(group) if distributed else None
    configure_cp_varlen(attn_backend=cfg.attn_backend, kv_exchange=cfg.kv_exchange)

    torch.manual_seed(cfg.seed)
    model = TinyLM(build_model_config(cfg, device)).to(device=device, dtype=dtype)
    attach_cp1_packed_varlen_hooks(model)
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

    stream = PackedStream(cfg.seq_len, seed=cfg.seed, max_doc=max(32, cfg.seq_len // 3))
    out_dir = Path(cfg.out)
    metrics_file = None
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = (out_dir / "metrics.jsonl").open("w")
    progress = _Progress(cfg.steps, cfg.progress and rank == 0)
    history: list[dict[str, Any]] = []
    parity: dict[str, Any] | None = None

    for step in range(1, cfg.steps + 1):
        row = stream.next_row()
        if step == 1 and cfg.parity:
            ref_loss, ref_norm = _reference_step(model, row, device, cfg) if rank == 0 else (0.0, 0.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
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
            else:  # balanced: the DSA / GDN layers run on the whole row (its metadata), each rank keeps its rows
                meta = DSAAttention.prepare_metadata(cu, cp_step.full_len, padding_mask=cp_step.doc_ids[0] == 0)
                perm = cp_step.shard_plan.permutation
                order = torch.empty_like(perm)
                order[perm] = torch.arange(perm.numel())
                step_inputs = StepInputs(cu_seqlens=cu, padding_mask=padding, dsa_metadata=meta, cp_group=group,
                                         token_index=cp_step.token_index, row_order=order.to(device))  # fmt: skip
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
            parity = _parity(rank, loss_value, _grad_norm(model), ref_loss, ref_norm, dtype, device, distributed)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": loss_value,
            "tokens_per_s": cfg.seq_len / dt,
            "grad_norm": grad_norm,
            "lr": lr_at(step),
            "step_time_s": dt,
            "documents": row.num_documents,
        }
        history.append(record)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        progress.update(step, loss_value, record["tokens_per_s"])
    if metrics_file is not None:
        metrics_file.close()
    return {
        "rank": rank,
        "world": world,
        "history": history,
        "parity": parity,
        "device": str(device),
        "dtype": _dtype_name(dtype),
        "layers": model.config.layers,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _parity(rank, loss, norm, ref_loss, ref_norm, dtype, device, distributed) -> dict[str, Any]:
    """Compare the CP step with the single-rank reference (computed on rank 0); every rank learns the verdict."""
    rtol = _PARITY_RTOL[dtype]
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


class ParityError(RuntimeError):
    """The CP run disagreed with the single-rank run at step 1."""


# --------------------------------------------------------------------------------------------------------------
# Launching


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

    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.cp:
        cfg = dataclasses.replace(cfg, cp=world)
    device = resolve_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return run_rank(cfg)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------
# Outputs and the command line


def write_outputs(cfg: DemoConfig, result: dict[str, Any], wall_s: float) -> dict[str, Any]:
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    history = result["history"]
    losses = [h["loss"] for h in history]
    tps = [h["tokens_per_s"] for h in history[1:]] or [history[0]["tokens_per_s"]]
    summary = {
        "steps": len(history),
        "cp": cfg.cp,
        "sharding": cfg.sharding,
        "device": result["device"],
        "dtype": result["dtype"],
        "layers": result["layers"],
        "parameters": result["parameters"],
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "mean_tokens_per_s": sum(tps) / len(tps),
        "wall_s": wall_s,
        "parity": result["parity"],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = out_dir / "loss_curve.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([h["step"] for h in history], losses, marker=".", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"longtrain demo: cp={cfg.cp}, layers {result['layers']}, {result['dtype']}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png)
        plt.close(fig)
        summary["loss_curve"] = str(png)
    except ImportError:
        summary["loss_curve"] = "not written (pip install matplotlib, or longtrain[demo])"
    return summary


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--config", metavar="FILE", help="YAML file whose top-level keys are these options (flags win)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--seq-len", type=int, help=f"tokens per packed row, divisible by 2*cp (default {d.seq_len})")
    p.add_argument("--cp", type=int, help=f"context-parallel ranks, one process each (default {d.cp})")
    p.add_argument("--device", help=f"cpu, cuda or auto (default {d.device})")
    p.add_argument("--dtype", help="float32 or bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument(
        "--attn-backend",
        help="varlen backend of the GQA layers: auto, flash, te, cudnn, flex, reference, "
        f"dense (default {d.attn_backend})",
    )
    p.add_argument("--kv-exchange", help=f"K/V exchange: allgather, halo, a2a (default {d.kv_exchange})")
    p.add_argument("--sharding", help=f"CP sharding: contiguous or balanced (default {d.sharding})")
    p.add_argument("--dsa-backend", help=f"DSA kernels: auto, triton, cudnn, torch (default {d.dsa_backend})")
    p.add_argument("--seed", type=int, help=f"seed of the model and the data (default {d.seed})")
    p.add_argument("--lr", type=float, help=f"AdamW learning rate (default {d.lr})")
    p.add_argument("--out", help=f"output folder (default {d.out})")
    p.add_argument("--no-prewarm", action="store_true", help="skip the setup-time prewarm")
    p.add_argument("--no-parity", action="store_true", help="skip the step-1 parity check")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    names = (
        "steps",
        "seq_len",
        "cp",
        "device",
        "dtype",
        "attn_backend",
        "kv_exchange",
        "sharding",
        "dsa_backend",
        "seed",
        "lr",
        "out",
    )
    overrides = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if getattr(args, "no_prewarm", False):
        overrides["prewarm"] = False
    if getattr(args, "no_parity", False):
        overrides["parity"] = False
    if args.config:
        return DemoConfig.from_yaml(args.config, **overrides)
    return DemoConfig(**overrides)


def main(args: argparse.Namespace) -> int:
    """``longtrain demo``: validate, launch, write outputs, print the summary. Exit codes: 0 ok, 1 failure
    (including a failed parity check), 2 bad options, 130 interrupted."""
    try:
        cfg = config_from_args(args)
        check_environment(cfg)
    except DemoConfigError as exc:
        print(f"longtrain demo: error: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(cfg)
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        print(
            f"longtrain demo: cp={cfg.cp} device={device} dtype={_dtype_name(resolve_dtype(cfg, device))} "
            f"seq_len={cfg.seq_len} steps={cfg.steps} attn={cfg.attn_backend}/{cfg.kv_exchange} "
            f"dsa={cfg.dsa_backend} out={cfg.out}",
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        result = launch(cfg)
    except KeyboardInterrupt:
        print("\nlongtrain demo: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    except ParityError as exc:
        print(f"longtrain demo: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"longtrain demo: failed: {exc}", file=sys.stderr)
        return 1
    if result["rank"] != 0:  # under torchrun every rank returns here; rank 0 reports
        return 0
    summary = write_outputs(cfg, result, time.perf_counter() - t0)
    par = summary["parity"]
    print(
        f"summary: {summary['steps']} steps on {summary['cp']} rank(s) ({summary['device']}, {summary['dtype']}), "
        f"model {summary['layers']} with {summary['parameters']:,} parameters; loss {summary['first_loss']:.3f} -> "
        f"{summary['final_loss']:.3f}; {summary['mean_tokens_per_s']:,.0f} tokens/s; parity "
        f"{'OK' if par and par['ok'] else 'skipped' if par is None else 'FAILED'}; wall {summary['wall_s']:.1f}s\n"
        f"outputs: {Path(cfg.out) / 'metrics.jsonl'}, {summary['loss_curve']}, {Path(cfg.out) / 'summary.json'}",
        flush=True,
    )
    return 0
