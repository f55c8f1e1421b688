"""``PrewarmConfig``: the typed ``prewarm:`` config section and its ``apply``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from longtrain.prewarm._common import _log, _pkg

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


from longtrain.prewarm.steps import SWITCHES


class PrewarmConfigError(ValueError, TypeError):
    """An invalid ``prewarm:`` section (a ``ValueError`` and a ``TypeError``, so either ``except`` catches it)."""


_SWITCHES = SWITCHES  # the switches of the one step table (longtrain.prewarm.steps), in run order
_IGNORED_KEYS = frozenset({"_target_"})


@dataclass
class PrewarmConfig:
    """Typed view over the ``prewarm:`` config section. Every prewarm is opt-in (default off).

    Positional construction follows the documented field order (a plain ``@dataclass``, not ``kw_only``):
    ``PrewarmConfig(cublas_backward, fla_gdn_autotune, mamba_ssd_autotune, comm_groups)``; the fields after
    those four are additions of this project.
    """

    cublas_backward: bool = False
    """Tiny fp32 and bf16 fwd+bwd matmuls so cuBLAS/cuBLASLt allocate their workspaces now. Needs CUDA."""
    fla_gdn_autotune: bool = False
    """fla gated-delta-net kernels: CP backward kernels, dense (real batch size) and packed fwd+bwd per GDN
    shape found in the model. Needs CUDA and fla."""
    mamba_ssd_autotune: bool = False
    """Mamba-2 SSD Triton kernels, with and without ``seq_idx``, per mixer shape. Needs CUDA and mamba_ssm."""
    comm_groups: bool = False
    """One-element all-reduce on every process group grad-norm clipping uses (a collective: enable it on every
    rank or none)."""
    dsa_autotune: bool = False
    """longtrain's DSA Triton kernels, per ``dsa_autotune_shape()`` found in the model. Needs CUDA and triton."""
    fla_gdn_seq_len: int | None = None
    """Per-rank training tokens per sample (the packed length for packed batches, after CP sharding). When set
    with ``fla_gdn_autotune``, also warms fla's fused l2-norm kernels, whose key is a bucket of
    ``batch * seq_len * heads``. None: those kernels tune at step 1 when that bucket is above the first."""
    blockdiag_autotune: bool = False
    """longtrain's block-diagonal varlen attention backend (the one ``configure_cp_varlen`` selected), per
    ``blockdiag_attention_shape()`` found in the model: JIT compiles, cuDNN graphs, autotuning. Needs CUDA."""

    def __setattr__(self, name: str, value: Any) -> None:
        # Every assignment is checked (the constructor's and a later ``cfg.comm_groups = ...``): a truthy non-bool
        # such as "false" would otherwise turn a prewarm on. An invalid value leaves the field as it was.
        _check_field(name, value)
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, section: Any) -> PrewarmConfig:
        """Build from a ``prewarm:`` YAML/dict section.

        - missing (``None``), ``null`` or ``false``: every prewarm off;
        - a mapping (dict, a config node with ``to_dict()``, any ``Mapping``): its keys are the field names,
          each a bool (``fla_gdn_seq_len``: a positive int or null); missing keys stay off; a ``_target_`` key
          is ignored;
        - ``true`` is rejected: it does not say which warmup to run, and ``comm_groups`` is a collective that
          every rank must agree on. Name the prewarms instead.

        Raises:
            PrewarmConfigError: (a ``ValueError`` and ``TypeError``) for ``true``, a non-mapping section, an
                unknown key (the message lists the valid ones) or a value of the wrong type.
        """
        if section is None or section is False:
            return cls()
        if section is True:
            raise PrewarmConfigError(
                "prewarm: true is ambiguous; enable the prewarms by name, e.g. "
                "prewarm: {cublas_backward: true, fla_gdn_autotune: true}. Valid keys: " + ", ".join(_valid_keys())
            )
        to_dict = getattr(section, "to_dict", None)
        if not isinstance(section, Mapping) and callable(to_dict):
            try:
                section = to_dict()
            except Exception as exc:
                raise PrewarmConfigError(
                    f"the prewarm section's to_dict() raised {type(exc).__name__}: {exc}; pass a plain mapping of "
                    "prewarm names to true/false. Valid keys: " + ", ".join(_valid_keys())
                ) from exc
        if not isinstance(section, Mapping):
            raise PrewarmConfigError(
                f"the prewarm section must be a mapping of prewarm names to true/false, got "
                f"{type(section).__name__} {section!r}. Valid keys: " + ", ".join(_valid_keys())
            )
        kwargs: dict[str, Any] = {}
        valid = set(_valid_keys())
        for key, value in section.items():
            if key in _IGNORED_KEYS:
                continue
            if not isinstance(key, str) or key not in valid:
                raise PrewarmConfigError(f"unknown prewarm option {key!r}. Valid keys: " + ", ".join(_valid_keys()))
            if key == "fla_gdn_seq_len":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise PrewarmConfigError(
                        f"prewarm.fla_gdn_seq_len must be a positive int or null, got {type(value).__name__} {value!r}"
                    )
            elif not isinstance(value, bool):
                raise PrewarmConfigError(
                    f"prewarm.{key} must be true or false, got {type(value).__name__} {value!r} "
                    "(quote-free YAML booleans: true/false)"
                )
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict (``from_dict(cfg.to_dict()) == cfg``)."""
        return dataclasses.asdict(self)

    @property
    def enabled(self) -> list[str]:
        """Names of the enabled prewarms, in run order."""
        return [name for name in SWITCHES if getattr(self, name)]

    def apply(
        self,
        model_parts: list[torch.nn.Module],
        device: torch.device | int | str | None,
        batch_size: int = 1,
        pp_mesh: DeviceMesh | None = None,
    ) -> None:
        """Run the enabled prewarms (best-effort: never raises an ``Exception``; failures are logged).

        Call after the model is parallelized (parameters in their final DTensor form) and before any forward
        pass; on every rank when ``comm_groups`` is on. The report is logged at INFO; use
        :func:`longtrain.prewarm.run_prewarms` to get it back.

        Args:
            model_parts: the (already parallelized) model parts (pipeline stages, or a one-element list).
            device: the device assigned to this rank (``torch.device``, CUDA index or string), or None when
                no accelerator is available.
            batch_size: per-rank training batch size (the micro-batch size under pipeline parallelism); fla
                keys its dense GDN cumulative-sum autotuner on it.
            pp_mesh: the pipeline-parallel submesh, if pipeline parallelism is enabled (its process group is
                warmed for the grad-norm all-reduce).
        """
        try:
            _pkg().run_prewarms(self, model_parts, device, batch_size=batch_size, pp_mesh=pp_mesh)
        except Exception:
            _log().exception("Prewarm failed; continuing without it.")


def _check_field(name: str, value: Any) -> None:
    if name in _SWITCHES and not isinstance(value, bool):
        raise PrewarmConfigError(
            f"PrewarmConfig.{name} must be a bool (true/false), got {type(value).__name__} {value!r}"
        )
    if (
        name == "fla_gdn_seq_len"
        and value is not None
        and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
    ):
        raise PrewarmConfigError(f"PrewarmConfig.fla_gdn_seq_len must be a positive int or None, got {value!r}")


def _valid_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(PrewarmConfig)]
