"""``transformers.Trainer`` with context parallelism (see :mod:`longtrain.integrations.hf`, which re-exports this).

At cp = 1 the plain ``Trainer`` needs nothing from us: ``attn_implementation="longtrain_blockdiag"`` and
``DataCollatorWithFlattening`` train exactly like every document in a row of its own (the collator's ``-100`` at
each document's first label keeps the loss from predicting across documents, and the Trainer's
``num_items_in_batch`` counts the same targets either way). With CP the Trainer would hand every rank rows of its
own and count every row once per rank; :class:`CPTrainerMixin` (and :data:`CPTrainer`, the mixin on
``transformers.Trainer``) gives the ranks of one CP group the same rows, shards each row with :func:`hf_cp_batch`
inside ``training_step`` and counts each row once, so DDP's gradient average over all ranks is the gradient of
the single-process loss.
"""

from __future__ import annotations

from typing import Any

import torch

from longtrain.blockdiag_cp.step import resolve_cp_group

from .hf_batch import hf_cp_batch

__all__ = ["CPTrainerMixin", "cp_trainer_class"]


class CPTrainerMixin:
    """Context parallelism for a ``transformers.Trainer`` (subclass): ``class MyTrainer(CPTrainerMixin, Trainer)``,
    or :data:`longtrain.integrations.hf.CPTrainer`. Extra keyword arguments:

    - ``cp_mesh``: the CP group of this rank, as :func:`hf_cp_batch` takes it (``None``, a ``ProcessGroup``, a
      1-D ``DeviceMesh`` or ``mesh["cp"]``); ``None`` or a group of one rank is the plain Trainer.
    - ``cp_sharding`` / ``cp_shard_chunk``: :func:`hf_cp_batch`'s ``sharding`` / ``shard_chunk``.

    With a CP group of W > 1 ranks (launched with ``torchrun`` / ``accelerate launch``, so the Trainer sees every
    process; the groups partition the ranks, ``world = dp x W``):

    - the training dataloader is sharded over the data-parallel replicas only: the W ranks of a group get the
      same batches (a map-style dataset; one packed row per batch, ``DataCollatorWithFlattening``);
    - ``training_step`` runs :func:`hf_cp_batch` on the row (labels shifted over the full row, then sharded) and
      the forward and backward inside its step context;
    - ``num_items_in_batch`` (and the token counter of ``include_num_input_tokens_seen``) counts each row once, not
      once per CP rank, so with the Trainer's loss scaling and
      DDP's gradient average the update is the single-process one (``average_tokens_across_devices`` on, the
      default: the token mean over the global batch; off: the mean of the replicas' means).

    Refused with a ``ValueError`` (the sharded labels are already shifted, or the loss would not be normalised by
    the row's count): ``compute_loss_func``, ``label_smoothing_factor``, a model whose forward takes no loss kwargs,
    accelerate's own context/sequence parallelism (``parallelism_config``), a sampler that is already rank-aware.
    Evaluation is the plain Trainer's: each rank evaluates rows of its own, without CP.
    """

    def __init__(self, *args: Any, cp_mesh: Any = None, cp_sharding: str | None = None,
                 cp_shard_chunk: int | None = None, **kwargs: Any) -> None:  # fmt: skip
        group, _, size = resolve_cp_group(cp_mesh)
        self.cp_mesh, self.cp_sharding, self.cp_shard_chunk = cp_mesh, cp_sharding, cp_shard_chunk
        self._cp_group, self._cp_size = group, size
        self._cp_dp_size, self._cp_dp_rank = 1, 0
        super().__init__(*args, **kwargs)
        if size > 1:
            self._cp_check()

    # ------------------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------------------

    def _cp_check(self) -> None:
        dist = torch.distributed
        name, w = type(self).__name__, self._cp_size
        world = dist.get_world_size()
        if self.args.world_size != world:
            raise RuntimeError(
                f"{name}: a CP group of {w} ranks in a torch.distributed world of {world}, but the Trainer sees "
                f"{self.args.world_size} process(es): launch with torchrun or accelerate launch (WORLD_SIZE, RANK and "
                "LOCAL_RANK set) so the Trainer wraps the model in DDP over every rank"
            )
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (pc.cp_enabled or getattr(pc, "sp_enabled", False)):
            raise ValueError(
                f"{name}: TrainingArguments(parallelism_config=...) enables accelerate's own context/sequence "
                f"parallelism; with cp_mesh= the CP is longtrain's: leave cp_size/sp_size at 1 there"
            )
        refused = {
            "compute_loss_func": self.compute_loss_func is not None,
            "label_smoothing_factor": self.label_smoother is not None,
        }
        for what, given in refused.items():
            if given:
                raise ValueError(
                    f"{name}: {what} is not supported with CP ({w} ranks): it would receive this rank's labels, "
                    "already shifted over the full row and sharded; let the model compute the loss"
                )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"{name}: {type(self.model).__name__}.forward takes no loss kwargs (num_items_in_batch), so the "
                "per-rank losses could not be normalised by the whole row's label count; CP needs a model that "
                "does (transformers' causal LMs do)"
            )
        ranks = dist.get_process_group_ranks(self._cp_group)
        firsts: list[Any] = [None] * world
        dist.all_gather_object(firsts, min(ranks))
        groups = sorted(set(firsts))
        if len(groups) * w != world:
            raise ValueError(
                f"{name}: the CP groups must partition the {world} ranks into groups of {w}; their first ranks are "
                f"{firsts}"
            )
        self._cp_dp_size, self._cp_dp_rank = len(groups), groups.index(min(ranks))

    def get_train_dataloader(self):  # noqa: ANN201 - transformers' DataLoader
        loader = super().get_train_dataloader()
        if self._cp_size == 1:
            return loader
        from accelerate.data_loader import BatchSamplerShard

        shard = next(
            (s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
             if isinstance(s, BatchSamplerShard)),
            None,
        )  # fmt: skip
        if shard is None or shard.num_processes != self.args.world_size:
            raise ValueError(
                f"{type(self).__name__}: CP needs the Trainer's map-style dataloader, sharded by accelerate over the "
                f"{self.args.world_size} ranks, to re-shard it over the {self._cp_dp_size} data-parallel replicas; got "
                f"{type(loader).__name__} without such a shard (an IterableDataset, dispatch_batches or a rank-aware "
                "sampler)"
            )
        shard.num_processes, shard.process_index = self._cp_dp_size, self._cp_dp_rank
        return loader

    def get_total_train_batch_size(self, args: Any) -> int:
        return super().get_total_train_batch_size(args) // self._cp_size

    # ------------------------------------------------------------------------------------------------------
    # a step
    # ------------------------------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._cp_size > 1 and num_items is not None:
            num_items = num_items / self._cp_size  # the W ranks of a CP group counted the same rows
        return batches, num_items

    def _track_num_input_tokens(self, inputs: dict) -> None:
        # The Trainer's token counter (``include_num_input_tokens_seen``) sums every rank's batch: the W ranks of a
        # CP group hold the same row, so it would count each row W times.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self._cp_size > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._cp_size

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        if self._cp_size == 1:
            return super().training_step(model, inputs, num_items_in_batch)
        if num_items_in_batch is None:
            raise ValueError(
                f"{type(self).__name__}: with CP the Trainer must count the labels of the accumulated batch "
                "(num_items_in_batch): give the batches 'labels'"
            )
        inputs = self._prepare_inputs(inputs)
        ctx, kwargs, _ = hf_cp_batch(inputs, self.cp_mesh, sharding=self.cp_sharding, shard_chunk=self.cp_shard_chunk)
        kwargs.pop("num_items_in_batch", None)  # the Trainer passes its own count, over the accumulated batches
        with ctx():
            return super().training_step(model, kwargs, num_items_in_batch)


_CLASSES: dict[type, type] = {}


def cp_trainer_class(base: type | None = None) -> type:
    """``CPTrainerMixin`` on ``base`` (default ``transformers.Trainer``), built once per
    base. ``longtrain.integrations.hf.CPTrainer`` is ``cp_trainer_class()``."""
    if base is None:
        from .hf_blockdiag import _transformers

        base = _transformers().Trainer
    if base not in _CLASSES:
        _CLASSES[base] = type(f"CP{base.__name__}", (CPTrainerMixin, base), {"__module__": __name__})
    return _CLASSES[base]
