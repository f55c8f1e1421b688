"""PrewarmConfig.apply / run_prewarms: order, exact calls, isolation, RNG neutrality, untouched state, report."""

from __future__ import annotations

import logging

import pytest
import torch

import longtrain.prewarm as prewarm
from longtrain.prewarm import PrewarmConfig, PrewarmReport
from tests.prewarm import fakes

WORKERS = {
    "cublas_backward": "_prewarm_cublas_backward",
    "fla_gdn_autotune": "_prewarm_fla_gdn_autotune",
    "mamba_ssd_autotune": "_prewarm_mamba_ssd_autotune",
    "dsa_autotune": "_prewarm_dsa_autotune",
    "blockdiag_autotune": "_prewarm_blockdiag_autotune",
    "comm_groups": "_prewarm_comm_groups",
}
MESSAGES = {
    "cublas_backward": "cuBLAS backward prewarm failed; continuing without it.",
    "fla_gdn_autotune": "fla GDN autotune prewarm failed; continuing without it.",
    "mamba_ssd_autotune": "Mamba SSD autotune prewarm failed; continuing without it.",
    "dsa_autotune": "DSA autotune prewarm failed; continuing without it.",
    "blockdiag_autotune": "Block-diagonal attention autotune prewarm failed; continuing without it.",
    "comm_groups": "Communication-group prewarm failed; continuing without it.",
}
ALL_ON = PrewarmConfig(True, True, True, True, dsa_autotune=True, blockdiag_autotune=True)


@pytest.fixture
def recorded(monkeypatch):
    """Replace every worker on the package with a recorder (returns the call log)."""
    calls: list[tuple[str, tuple, dict]] = []

    def recorder(name, result):
        def worker(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result

        return worker

    for flag, attr in WORKERS.items():
        monkeypatch.setattr(prewarm, attr, recorder(flag, 2 if flag == "comm_groups" else True))
    monkeypatch.setattr(prewarm, "_prewarm_fla_gdn_l2norm_bucket", recorder("fla_gdn_l2norm_bucket", True))
    return calls


def test_all_off_calls_nothing(recorded):
    assert PrewarmConfig().apply([], None) is None
    report = prewarm.run_prewarms(PrewarmConfig(), [], None)
    assert recorded == [] and report.steps == [] and report.format() == "prewarm: nothing enabled"


def test_fixed_order_and_exact_call_shapes(recorded):
    parts, mesh = [torch.nn.Linear(2, 2)], object()
    assert ALL_ON.apply(parts, "cuda:1", batch_size=4, pp_mesh=mesh) is None
    assert [c[0] for c in recorded] == list(WORKERS)
    by_name = {name: (args, kwargs) for name, args, kwargs in recorded}
    assert by_name["cublas_backward"] == (("cuda:1",), {})
    assert by_name["fla_gdn_autotune"] == ((parts, "cuda:1"), {"batch_size": 4})
    assert by_name["mamba_ssd_autotune"] == ((parts, "cuda:1"), {})
    assert by_name["dsa_autotune"] == ((parts, "cuda:1"), {})
    assert by_name["blockdiag_autotune"] == ((parts, "cuda:1"), {})
    assert by_name["comm_groups"] == ((parts, "cuda:1"), {"pp_mesh": mesh})
    assert by_name["fla_gdn_autotune"][0][0] is parts


def test_positional_apply_and_l2norm_bucket_step(recorded):
    cfg = PrewarmConfig(fla_gdn_autotune=True, fla_gdn_seq_len=32768)
    cfg.apply([], 0, 2)
    assert [(c[0], c[1][2:]) for c in recorded] == [("fla_gdn_autotune", ()), ("fla_gdn_l2norm_bucket", (2, 32768))]


@pytest.mark.parametrize("failing", list(WORKERS))
def test_one_failing_prewarm_never_stops_the_others(recorded, monkeypatch, caplog, failing):
    def boom(*args, **kwargs):
        torch.rand(5)  # consumes RNG before failing: the fork must still restore it
        raise RuntimeError(f"{failing} exploded")

    monkeypatch.setattr(prewarm, WORKERS[failing], boom)
    before = fakes.rng_state()
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        ALL_ON.apply([], None)
    assert torch.equal(before, fakes.rng_state())
    assert [c[0] for c in recorded] == [name for name in WORKERS if name != failing]
    (record,) = caplog.records
    assert record.getMessage() == MESSAGES[failing] and record.exc_info is not None
    report = prewarm.run_prewarms(ALL_ON, [], None)
    assert report.failed == [failing] and f"{failing} exploded" in report.step(failing).reason


def test_every_prewarm_failing_at_once(monkeypatch, caplog):
    for attr in WORKERS.values():
        monkeypatch.setattr(prewarm, attr, lambda *a, **k: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        assert ALL_ON.apply([], None) is None
    assert [r.getMessage() for r in caplog.records] == list(MESSAGES.values())


def test_apply_survives_run_prewarms_itself_failing(monkeypatch, caplog):
    monkeypatch.setattr(prewarm, "run_prewarms", lambda *a, **k: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        assert ALL_ON.apply([], None) is None
    assert "Prewarm failed; continuing without it." in caplog.text


def test_keyboard_interrupt_is_not_swallowed(monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prewarm, "_prewarm_cublas_backward", interrupt)
    with pytest.raises(KeyboardInterrupt):
        PrewarmConfig(cublas_backward=True).apply([], None)


@pytest.mark.parametrize("device", [None, "cpu", 0, torch.device("cpu"), "cuda"], ids=str)
def test_real_prewarms_on_cpu_skip_with_reason_and_never_raise(device, caplog):
    model = fakes.ToyModel()
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        report = prewarm.run_prewarms(ALL_ON, [model], device, batch_size=2)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the CUDA prewarms run instead of skipping")
    assert report.failed == []
    assert report.skipped == list(WORKERS)
    for step in report.steps:
        assert step.result in (False, 0) and step.reason
    assert "Skipping comm-group prewarm: torch.distributed is not initialized." in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_bad_device_string_is_logged_not_raised(caplog):
    with caplog.at_level(logging.ERROR, logger="longtrain.prewarm"):
        report = prewarm.run_prewarms(PrewarmConfig(cublas_backward=True), [], "not-a-device")
    assert report.failed == ["cublas_backward"]
    assert "cuBLAS backward prewarm failed; continuing without it." in caplog.text


def test_real_workers_touch_no_parameter_gradient_or_optimizer(monkeypatch, caplog):
    """The real GDN, Mamba and DSA code paths (stub kernels, CPU) leave model, grads and optimizer alone."""
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))
    gdn, mamba, dsa_calls = fakes.GDNOpStub(), fakes.MambaOpStub(), []
    fakes.install_modules(
        monkeypatch,
        {
            "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": gdn},
            "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": mamba},
            "longtrain.dsa.triton": {"warmup": lambda **kw: dsa_calls.append(kw)},
        },
    )
    model = fakes.ToyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    fakes.install_fake_triton(monkeypatch)  # after the optimizer step, which imports the real triton via dynamo
    before, rng = fakes.snapshot_state(model, optimizer), fakes.rng_state()
    with torch.no_grad():
        report = prewarm.run_prewarms(ALL_ON, [model], "cuda", batch_size=2)
    fakes.assert_state_equal(before, fakes.snapshot_state(model, optimizer))
    assert torch.equal(rng, fakes.rng_state())
    assert report.ran == ["fla_gdn_autotune", "mamba_ssd_autotune", "dsa_autotune"]
    assert len(gdn.calls) == 6 and len(mamba.calls) == 2 and len(dsa_calls) == 1
    assert dsa_calls[0]["device"] == torch.device("cpu") and dsa_calls[0]["num_heads"] == 4


def test_report_contents_and_format(monkeypatch, caplog):
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))
    gdn = fakes.GDNOpStub()
    fakes.install_modules(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": gdn}})
    monkeypatch.setattr(prewarm, "_prewarm_cublas_backward", lambda device: False)
    cfg = PrewarmConfig(cublas_backward=True, fla_gdn_autotune=True, comm_groups=True)
    with caplog.at_level(logging.INFO, logger="longtrain.prewarm"):
        report = prewarm.run_prewarms(cfg, [fakes.ToyModel()], "cpu")
    assert isinstance(report, PrewarmReport)
    assert [s.name for s in report.steps] == ["cublas_backward", "fla_gdn_autotune", "comm_groups"]
    assert report.ran == ["fla_gdn_autotune"] and report.skipped == ["cublas_backward", "comm_groups"]
    fla = report.step("fla_gdn_autotune")
    assert fla.result is True and fla.seconds >= 0 and fla.errors == 0
    assert fla.shapes == [
        "H=4 K=16 V=32 torch.float32 (layers.0)",
        "H=2 K=8 V=8 torch.bfloat16 (layers.2)",
    ]
    assert fla.memory_before is None and report.memory_before is None  # no CUDA device: no memory numbers
    assert report.step("cublas_backward").reason == "nothing to do"
    assert "torch.distributed is not initialized" in report.step("comm_groups").reason
    text = report.format()
    assert text.startswith("prewarm: 1 ran, 2 skipped, 0 failed in ")
    assert "fla_gdn_autotune" in text and "H=4 K=16 V=32 torch.float32 (layers.0)" in text
    assert "memory n/a" not in text  # CPU steps print no memory line
    assert text in caplog.text  # logged at INFO


def test_report_counts_inner_failures(monkeypatch):
    monkeypatch.setattr(prewarm, "_resolve_cuda_device", lambda device, label: torch.device("cpu"))
    op = fakes.GDNOpStub(fail_on=lambda call: True)
    fakes.install_modules(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": op}})
    report = prewarm.run_prewarms(PrewarmConfig(fla_gdn_autotune=True), [fakes.ToyModel()], "cpu")
    step = report.step("fla_gdn_autotune")
    assert (
        step.status == "failed"
        and step.errors == 6
        and step.reason == "every warmup failed (last: RuntimeError: stub GDN op failure)"
    )
    assert "(6 error(s) logged)" in report.format()


def test_memory_line_format():
    from longtrain.prewarm.report import MemorySnapshot, _memory_line

    mib = 2**20
    before = MemorySnapshot(allocated=0, reserved=2 * mib, device_used=502 * mib, device_total=1000 * mib)
    after = MemorySnapshot(allocated=0, reserved=4 * mib, device_used=568 * mib, device_total=1000 * mib)
    assert before.outside_allocator == 500 * mib and after.outside_allocator == 564 * mib
    assert _memory_line(before, after) == (
        "allocated 0.0->0.0 MiB (+0.0), reserved 2.0->4.0 MiB (+2.0), outside allocator 500.0->564.0 MiB (+64.0)"
    )


def test_backend_status_rows():
    rows = prewarm.backend_status()
    assert [name for name, _ in rows] == list(WORKERS)
    reasons = dict(rows)
    assert all(r is None or isinstance(r, str) for r in reasons.values())
    assert "process group" in reasons["comm_groups"]
    if not torch.cuda.is_available():
        for name in ("cublas_backward", "fla_gdn_autotune", "mamba_ssd_autotune", "dsa_autotune"):
            assert "needs CUDA" in reasons[name]
