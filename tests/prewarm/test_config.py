"""PrewarmConfig: documented fields and order, validation, and every edge case of ``from_dict``."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import pytest
import yaml

from longtrain.prewarm import PrewarmConfig, PrewarmConfigError

DOCUMENTED = ["cublas_backward", "fla_gdn_autotune", "mamba_ssd_autotune", "comm_groups"]


def test_documented_fields_come_first_in_order_and_default_off():
    names = [f.name for f in dataclasses.fields(PrewarmConfig)]
    assert names[:4] == DOCUMENTED
    cfg = PrewarmConfig()
    assert not any(dataclasses.asdict(cfg).values())
    assert cfg.enabled == []


def test_positional_and_keyword_construction():
    assert PrewarmConfig(True, False, True, False) == PrewarmConfig(cublas_backward=True, mamba_ssd_autotune=True)
    cfg = PrewarmConfig(False, True, False, True)
    assert cfg.fla_gdn_autotune and cfg.comm_groups and not cfg.dsa_autotune
    assert cfg.enabled == ["fla_gdn_autotune", "comm_groups"]


def test_apply_signature_is_the_documented_one():
    params = inspect.signature(PrewarmConfig.apply).parameters
    assert list(params) == ["self", "model_parts", "device", "batch_size", "pp_mesh"]
    assert params["batch_size"].default == 1 and params["pp_mesh"].default is None


@pytest.mark.parametrize("bad", [1, "true", None, 0.0], ids=["int", "str", "None", "float"])
def test_constructor_rejects_non_bool_switch(bad):
    with pytest.raises(PrewarmConfigError, match="cublas_backward must be a bool"):
        PrewarmConfig(cublas_backward=bad)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4096"], ids=["zero", "negative", "bool", "float", "str"])
def test_constructor_rejects_bad_seq_len(bad):
    with pytest.raises(PrewarmConfigError, match="fla_gdn_seq_len"):
        PrewarmConfig(fla_gdn_seq_len=bad)


@pytest.mark.parametrize(
    "field,bad",
    [("cublas_backward", "false"), ("comm_groups", 1), ("mamba_ssd_autotune", None), ("fla_gdn_seq_len", -1)],
    ids=["str-false-switch", "int-switch", "None-switch", "negative-seq-len"],
)
def test_assignment_after_construction_is_validated_and_leaves_the_config_unchanged(field, bad):
    # Before: cfg.cublas_backward = "false" was accepted and, being truthy, turned the cuBLAS prewarm on.
    cfg = PrewarmConfig(comm_groups=True)
    before = cfg.to_dict()
    with pytest.raises(PrewarmConfigError, match=field):
        setattr(cfg, field, bad)
    assert cfg.to_dict() == before
    setattr(cfg, field, 4096 if field == "fla_gdn_seq_len" else True)  # a valid value still assigns
    assert getattr(cfg, field) == (4096 if field == "fla_gdn_seq_len" else True)


@pytest.mark.parametrize("section", [None, False, {}], ids=["missing-or-null", "false", "empty"])
def test_from_dict_off_sections(section):
    assert PrewarmConfig.from_dict(section) == PrewarmConfig()


def test_from_dict_subset_keeps_defaults_and_full_section():
    assert PrewarmConfig.from_dict({"comm_groups": True}) == PrewarmConfig(comm_groups=True)
    full = {name: True for name in DOCUMENTED} | {"dsa_autotune": True, "fla_gdn_seq_len": 8192}
    full["blockdiag_autotune"] = True
    cfg = PrewarmConfig.from_dict(full)
    assert cfg.to_dict() == full
    assert PrewarmConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_true_is_rejected_with_guidance():
    with pytest.raises(PrewarmConfigError, match="ambiguous") as info:
        PrewarmConfig.from_dict(True)
    assert "cublas_backward" in str(info.value)  # lists what to write instead


def test_from_dict_unknown_key_lists_valid_keys():
    with pytest.raises(PrewarmConfigError, match="cublas_backwards") as info:
        PrewarmConfig.from_dict({"cublas_backwards": True})
    for name in DOCUMENTED + ["dsa_autotune", "fla_gdn_seq_len"]:
        assert name in str(info.value)
    # A TypeError, as a dataclass constructor would raise, and a ValueError: either except catches it.
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_from_dict_non_string_key_rejected():
    with pytest.raises(PrewarmConfigError, match="unknown prewarm option 1"):
        PrewarmConfig.from_dict({1: True})


@pytest.mark.parametrize(
    "value", ["yes", "true", 1, 0, None, [True]], ids=["yes", "str-true", "1", "0", "null", "list"]
)
def test_from_dict_non_bool_value_rejected(value):
    with pytest.raises(PrewarmConfigError, match="prewarm.fla_gdn_autotune must be true or false"):
        PrewarmConfig.from_dict({"fla_gdn_autotune": value})


@pytest.mark.parametrize("value", [0, -1, True, "8192", 1.5])
def test_from_dict_bad_seq_len_rejected(value):
    with pytest.raises(PrewarmConfigError, match="fla_gdn_seq_len must be a positive int or null"):
        PrewarmConfig.from_dict({"fla_gdn_seq_len": value})


def test_from_dict_seq_len_null_is_unset():
    assert PrewarmConfig.from_dict({"fla_gdn_seq_len": None}).fla_gdn_seq_len is None


@pytest.mark.parametrize("section", ["cublas_backward", ["cublas_backward"], 1], ids=["str", "list", "int"])
def test_from_dict_non_mapping_rejected(section):
    with pytest.raises(PrewarmConfigError, match="must be a mapping"):
        PrewarmConfig.from_dict(section)


def test_from_dict_drops_target_key():
    assert PrewarmConfig.from_dict({"_target_": "anything", "cublas_backward": True}) == PrewarmConfig(True)


def test_from_dict_accepts_config_nodes_and_mappings():
    class Node:  # a config node exposing to_dict() (not a Mapping)
        def to_dict(self):
            return {"mamba_ssd_autotune": True}

    class ReadOnly(Mapping):
        def __init__(self, data):
            self._data = data

        def __getitem__(self, key):
            return self._data[key]

        def __iter__(self):
            return iter(self._data)

        def __len__(self):
            return len(self._data)

    assert PrewarmConfig.from_dict(Node()) == PrewarmConfig(mamba_ssd_autotune=True)
    assert PrewarmConfig.from_dict(ReadOnly({"dsa_autotune": True})) == PrewarmConfig(dsa_autotune=True)


def test_from_yaml_sections():
    doc = yaml.safe_load(
        """
a: {prewarm: {cublas_backward: true, fla_gdn_autotune: true, comm_groups: true}}
b: {prewarm: }
c: {prewarm: false}
d: {}
e: {prewarm: {cublas_backward: no}}
f: {prewarm: {cublas_backward: "no"}}
"""
    )
    assert PrewarmConfig.from_dict(doc["a"]["prewarm"]) == PrewarmConfig(True, True, False, True)
    assert PrewarmConfig.from_dict(doc["b"]["prewarm"]) == PrewarmConfig()
    assert PrewarmConfig.from_dict(doc["c"]["prewarm"]) == PrewarmConfig()
    assert PrewarmConfig.from_dict(doc["d"].get("prewarm")) == PrewarmConfig()
    assert PrewarmConfig.from_dict(doc["e"]["prewarm"]) == PrewarmConfig()  # YAML 1.1 `no` is a boolean
    with pytest.raises(PrewarmConfigError, match="got str 'no'"):  # a quoted "no" is a string: refused
        PrewarmConfig.from_dict(doc["f"]["prewarm"])


def test_one_step_table_drives_switches_order_messages_and_status():
    """PrewarmConfig's switches, `enabled` order, the run order, the failure messages and `backend_status` all come
    from longtrain.prewarm.steps (one table)."""
    import dataclasses

    from longtrain.prewarm import PrewarmConfig, backend_status
    from longtrain.prewarm.report import _FAILURE_MESSAGES, _planned_steps
    from longtrain.prewarm.steps import PREWARM_STEPS, SWITCHES

    bool_fields = [f.name for f in dataclasses.fields(PrewarmConfig) if f.type in ("bool", bool)]
    assert sorted(bool_fields) == sorted(SWITCHES)
    everything = PrewarmConfig(**{name: True for name in SWITCHES}, fla_gdn_seq_len=4096)
    assert everything.enabled == list(SWITCHES)
    planned = [name for name, _ in _planned_steps(everything, [], "cpu", 1, None)]
    assert planned == [s.name for s in PREWARM_STEPS] and planned[-1] == "comm_groups"
    assert set(_FAILURE_MESSAGES) == set(planned)
    assert [name for name, _ in backend_status()] == list(SWITCHES)
