"""Runtime knobs (synonyms, normalisation, configure round trip) and the per-step state slot."""

from __future__ import annotations

import threading

import pytest
import torch

from longtrain.blockdiag_cp import kernels, providers, state


@pytest.fixture(autouse=True)
def _restore_knobs():
    previous = state.cp_varlen_runtime_config()
    yield
    state.configure_cp_varlen(**previous)


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        (None, "auto"),
        ("", "auto"),
        ("  Default ", "auto"),
        ("AUTO", "auto"),
        ("fa2", "flash"),
        ("Flash-Attention-2", "flash"),
        ("flash_attn", "flash"),
        ("Transformer-Engine", "te"),
        ("transformerengine", "te"),
        ("flex_attention", "flex"),
        ("FlexAttention", "flex"),
        ("cudnn_sdpa", "cudnn"),
        ("ref", "reference"),
        ("torch_reference", "reference"),
        ("sdpa", "dense"),
        ("torch-sdpa", "dense"),
    ],
)
def test_normalize_attn_backend(spelling, canonical):
    assert state.normalize_attn_backend(spelling) == canonical


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        (None, "allgather"),
        ("", "allgather"),
        ("All-Gather", "allgather"),
        ("neighbor", "halo"),
        ("needed_only", "halo"),
        ("A2AV", "a2a"),
        ("all-to-all", "a2a"),
        ("needed_a2a", "a2a"),
    ],
)
def test_normalize_kv_exchange(spelling, canonical):
    assert state.normalize_kv_exchange(spelling) == canonical


def test_every_canonical_name_is_its_own_synonym():
    for table, norm in ((state.ATTN_BACKEND_SYNONYMS, state.normalize_attn_backend),
                        (state.KV_EXCHANGE_SYNONYMS, state.normalize_kv_exchange)):  # fmt: skip
        for canon, synonyms in table.items():
            assert canon in synonyms
            assert all(norm(s) == canon for s in synonyms)
    assert state.ATTN_BACKEND_VALUES[0] == "auto" and state.KV_EXCHANGE_VALUES == ("allgather", "halo", "a2a")


def test_every_provider_name_is_accepted():
    # The knob accepts every provider of the registry under its own canonical name, and "sdpa" is "dense".
    for name in providers.PROVIDERS:
        assert state.normalize_attn_backend(name) == name
        assert name in state.VARLEN_ATTN_BACKENDS or name == "dense"
    assert state.normalize_attn_backend("sdpa") == "dense"
    assert set(state.ATTN_BACKEND_VALUES) == {"auto", *providers.PROVIDERS}


@pytest.mark.parametrize(
    "func, value, needle",
    [
        (state.normalize_attn_backend, "flash3", "attention backend"),
        (state.normalize_attn_backend, "flash attention", "attention backend"),
        (state.normalize_kv_exchange, "ring", "kv_exchange"),
    ],
)
def test_unknown_names_raise_listing_valid_ones(func, value, needle):
    with pytest.raises(ValueError, match=needle) as info:
        func(value)
    assert repr(value) in str(info.value)
    valid = state.ATTN_BACKEND_VALUES if needle == "attention backend" else state.KV_EXCHANGE_VALUES
    assert all(v in str(info.value) for v in valid)


def test_defaults_and_round_trip():
    assert state.ATTN_BACKEND_DEFAULT == "auto" and state.KV_EXCHANGE_DEFAULT == "allgather"
    state.configure_cp_varlen()
    assert state.cp_varlen_runtime_config() == {"attn_backend": "auto", "kv_exchange": "allgather"}
    previous = state.configure_cp_varlen(attn_backend="FA2", kv_exchange="needed")
    assert previous == {"attn_backend": "auto", "kv_exchange": "allgather"}
    assert state.cp_varlen_runtime_config() == {"attn_backend": "flash", "kv_exchange": "halo"}
    back = state.configure_cp_varlen(**previous)
    assert back == {"attn_backend": "flash", "kv_exchange": "halo"}
    assert state.cp_varlen_runtime_config() == previous
    with pytest.raises(TypeError):
        state.configure_cp_varlen("flash")  # keyword-only


def test_invalid_configure_changes_nothing():
    state.configure_cp_varlen(attn_backend="reference", kv_exchange="a2a")
    before = state.cp_varlen_runtime_config()
    with pytest.raises(ValueError, match="kv_exchange"):
        state.configure_cp_varlen(attn_backend="dense", kv_exchange="bogus")
    with pytest.raises(ValueError, match="attention backend"):
        state.configure_cp_varlen(attn_backend="bogus", kv_exchange="halo")
    assert state.cp_varlen_runtime_config() == before


@pytest.mark.parametrize(
    "timeout", [-1, 0, float("nan"), "5", True, 10**400], ids=["neg", "zero", "nan", "str", "bool", "huge-int"]
)
def test_bad_step_timeout_is_a_value_error(timeout):
    """10**400 raised a bare OverflowError from float()."""
    before = state.cp_varlen_runtime_config()
    with pytest.raises(ValueError, match="step_timeout_s must be a positive number"):
        state.configure_cp_varlen(step_timeout_s=timeout)
    assert state.cp_varlen_runtime_config() == before


def test_known_but_unprovided_backend_is_refused(monkeypatch):
    monkeypatch.setattr(providers, "PROVIDERS", {n: providers.PROVIDERS[n] for n in ("flash", "reference")})
    with pytest.raises(ValueError, match="does not provide"):
        state.configure_cp_varlen(attn_backend="te")


def test_configure_rearms_the_engaged_log(monkeypatch):
    state.configure_cp_varlen(attn_backend="reference")
    monkeypatch.setattr(kernels, "_CP_FLASH_ENGAGED", True)
    state.configure_cp_varlen(attn_backend="reference")  # unchanged: flag untouched
    assert kernels._CP_FLASH_ENGAGED is True
    state.configure_cp_varlen(attn_backend="dense")
    assert kernels._CP_FLASH_ENGAGED is False


def test_thread_shared_var_is_visible_from_other_threads_and_nests():
    var = state._ThreadSharedVar("t")
    assert var.get() is None
    outer = var.set("outer")
    inner = var.set("inner")
    seen = []
    t = threading.Thread(target=lambda: seen.append(var.get()))
    t.start()
    t.join()
    assert seen == ["inner"]
    var.reset(inner)
    assert var.get() == "outer"
    var.reset(outer)
    assert var.get() is None


def test_current_state_accessor_and_fire_count():
    assert state.current_blockdiag_cp_state() is None
    cu = torch.tensor([0, 3, 8])
    model_state = state.BlockdiagCpModelState(None, cu, cu.clone())
    token = state._CP_BLOCKDIAG_STATE.set({"group": None, "doc_ids": torch.ones(1, 8), "row_offset": 0})
    try:
        assert state.current_blockdiag_cp_state() is None  # hand-built state without model_state
        state._CP_BLOCKDIAG_STATE.get()["model_state"] = model_state
        assert state.current_blockdiag_cp_state() is model_state
    finally:
        state._CP_BLOCKDIAG_STATE.reset(token)
    assert state.current_blockdiag_cp_state() is None
    with pytest.raises(AttributeError):
        model_state.group = 1  # frozen
    state._CP_ATTN_FIRE_COUNT[0] = 5
    assert state.cp_attn_fire_count() == 5
    state.reset_cp_attn_fire_count()
    assert state.cp_attn_fire_count() == 0
