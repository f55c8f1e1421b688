"""The main job: ``longtrain demo`` end to end, its error paths, and the model's CP == single-rank equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from longtrain import train

LONGTRAIN = [sys.executable, "-m", "longtrain.cli"]


def _cli(args: list[str]) -> int:
    """The ``longtrain`` command in this process (argparse errors exit 2 like the command)."""
    from longtrain import cli

    try:
        return cli.main(args)
    except SystemExit as exc:
        if exc.code not in (0, None) or "--version" not in args:
            return int(exc.code or 0)
        raise


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(LONGTRAIN + args, capture_output=True, text=True, timeout=timeout, env=env)


def test_demo_cp2_runs_and_parity_passes(tmp_path):
    out = tmp_path / "run"
    res = _run(["demo", "--cp", "2", "--steps", "4", "--seq-len", "256", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    parity = [line for line in res.stdout.splitlines() if line.startswith("parity:")]
    assert len(parity) == 1 and parity[0].endswith("OK"), res.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "tokens_per_s"} <= set(r)
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert (out / "loss_curve.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["ok"] and summary["cp"] == 2 and summary["steps"] == 4
    assert "summary:" in res.stdout
    # the measurements: model FLOPs on every step and in the summary; MFU and memory are n/a on a CPU, never made up
    assert summary["preset"] == "tiny" and summary["model_tflops_per_s"] > 0
    assert summary["model_tflops_per_s_per_rank"] == pytest.approx(summary["model_tflops_per_s"] / 2)
    assert summary["mfu"] is None and summary["peak_tflops"] is None
    assert summary["step1_peak_memory_gib"] is None and summary["steady_peak_memory_gib"] is None
    assert "CUDA-only" in summary["peak_memory_note"]
    for r in records:
        assert r["model_flops"] > 0 and r["mfu"] is None and r["peak_memory_gib"] is None
        assert 0 < r["real_tokens"] <= 256
    assert "model TFLOP/s" in res.stdout and "MFU n/a" in res.stdout and "peak memory: n/a" in res.stdout


def test_demo_h200_32k_preset_at_shrunken_width_runs_on_cpu(tmp_path):
    """The h200-32k path end to end (books, full rows, its 12-layer pattern, CP, parity) with CPU-sized widths."""
    cfg = tmp_path / "demo.yaml"
    widths = dict(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, dsa_heads=2,
                  dsa_q_lora_rank=16, dsa_kv_lora_rank=16, dsa_rope_head_dim=8, dsa_nope_head_dim=8, dsa_v_head_dim=8,
                  index_heads=2, index_head_dim=16, index_topk=32)  # fmt: skip
    model = "".join(f"  {k}: {v}\n" for k, v in widths.items())
    cfg.write_text(f"preset: h200-32k\ndevice: cpu\ndtype: float32\nseq_len: 512\nmin_doc: 64\nmodel:\n{model}")
    out = tmp_path / "o"
    res = _run(["demo", "--config", str(cfg), "--steps", "2", "--cp", "2", "--no-prewarm", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    assert "preset=h200-32k" in res.stdout and "documents=books" in res.stdout and "OK" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == "GDSGGDSGGDSG" and summary["documents"] == "books" and summary["parity"]["ok"]
    assert summary["cp"] == 2 and summary["steps"] == 2
    assert summary["real_token_fraction"] >= 1 - 256 / 512 and summary["model_flops_per_step"] > 0


def test_demo_yaml_config_and_flags_override(tmp_path):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(
        "steps: 2\nseq_len: 128\ncp: 2\nkv_exchange: halo\nattn_backend: reference\n"
        "model:\n  hidden_size: 32\n  layers: GDSG\n  dsa:\n    index_topk: 16\nprewarm:\n  cublas_backward: true\n"
    )
    res = _run(["demo", "--config", str(cfg), "--steps", "3", "--out", str(tmp_path / "o")])
    assert res.returncode == 0, res.stderr
    assert "steps=3" in res.stdout and "attn=reference/halo" in res.stdout
    assert len((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()) == 3


def test_demo_with_the_fp8_indexer_keeps_cp_parity(tmp_path):
    """``model.dsa.indexer_fp8`` reaches the DSA layers; its codes are per row, so 2 CP ranks still equal one."""
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("model:\n  dsa:\n    indexer_fp8: true\n")
    out = tmp_path / "o"
    res = _run(["demo", "--config", str(cfg), "--cp", "2", "--steps", "2", "--seq-len", "256", "--out", str(out)])
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["parity"]["ok"]
    from longtrain.demo.config import build_model_config, make_config, read_config_file

    model_cfg = build_model_config(make_config(read_config_file(cfg)), torch.device("cpu"))
    assert model_cfg.dsa_config().indexer_fp8 is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-len", "250", "--cp", "2"], "divisible by 2 * cp"),
        (["--cp", "0"], "positive integer"),
        (["--attn-backend", "nope"], "attention backend"),
        (["--kv-exchange", "ring"], "kv_exchange"),
        (["--dsa-backend", "tilelang"], "--dsa-backend must be one of"),
        (["--dtype", "float8"], "--dtype must be one of"),
        (["--device", "tpu"], "--device must be one of"),
        (["--config", "/nonexistent/demo.yaml"], "no such file"),
        (["--preset", "h200-32k", "--seq-len", "512"], "min_doc=256 is longer than the longest document span"),
        (["--documents", "verses"], "--documents must be one of chapters, books"),
        (["--peak-tflops", "0"], "--peak-tflops must be a positive number"),
    ],
    ids=[
        "seq-not-divisible",
        "cp-zero",
        "unknown-attn",
        "unknown-exchange",
        "unknown-dsa",
        "bad-dtype",
        "bad-device",
        "missing-config",
        "h200-short-rows",
        "bad-documents",
        "bad-peak",
    ],
)
def test_demo_bad_options_fail_fast(args, message, capsys):
    assert _cli(["demo", *args]) == 2
    out = capsys.readouterr()
    assert message in out.err and "parity:" not in out.out


def test_demo_unreadable_config_fails_fast(tmp_path, capsys):
    """A folder or a non-UTF-8 file as --config raised IsADirectoryError / UnicodeDecodeError tracebacks."""
    binary = tmp_path / "demo.yaml"
    binary.write_bytes(b"\xff\xfe\x00steps: 1")
    for path, message in ((tmp_path, "is a folder"), (binary, "not UTF-8 text")):
        assert _cli(["demo", "--config", str(path)]) == 2
        out = capsys.readouterr()
        assert message in out.err and "parity:" not in out.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error messages")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda"], "no CUDA device"),
        (["--attn-backend", "flash"], "needs a CUDA device"),
        (["--dsa-backend", "cudnn"], "not available"),
        (["--dsa-backend", "triton"], "not available"),
    ],
    ids=["cuda", "flash", "cudnn", "triton"],
)
def test_demo_unavailable_backends_fail_fast_on_cpu(args, message):
    # a subprocess: whether Triton interprets is fixed when its kernels are first imported, and this process
    # imported them under TRITON_INTERPRET=1 (the conftest)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(LONGTRAIN + ["demo", *args], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr


def test_demo_config_unknown_key(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("steps: 2\nlearning_rate: 0.1\n")
    assert _cli(["demo", "--config", str(cfg)]) == 2
    assert "unknown key(s) ['learning_rate']" in capsys.readouterr().err


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("prewarm: true\n", "prewarm: true is ambiguous"),
        ("prewarm: {cublas_backwards: true}\n", "prewarm:"),
        ("prewarm: {cublas_backward: 3}\n", "prewarm:"),
        ("model: {hiden_size: 64}\n", "valid keys: ["),
        ("model: {dsa: {backend: cudnn}}\n", "model.dsa.backend cudnn: not available on cpu"),
        ("model: {dsa: 5}\n", "model.dsa must be a mapping"),
        ("seed: abc\n", "seed must be an integer >= 0, got 'abc'"),
        ("seed: true\n", "seed must be an integer >= 0, got True"),
        ("seed: 1.5\n", "seed must be an integer >= 0, got 1.5"),
        ("out:\n", "--out must be a folder path, got None"),
        ("parity: 'false'\n", "parity must be true or false, got 'false'"),
        ("progress: 'no'\n", "progress must be true or false, got 'no'"),
        ("lr: true\n", "--lr must be a positive number, got True"),
        ("max_pad: true\n", "max_pad must be null or an integer >= 0, got True"),
        ("min_doc: 600\nmax_doc: 2000\n", "min_doc=600 is longer than the shortest chapters document (503 tokens)"),
        ("documents: books\nmin_doc: 7000\nmax_doc: 9000\n", "min_doc=7000 is longer than the shortest books"),
        ("dtype: [bf16]\n", "--dtype must be one of auto, float32, bfloat16; got ['bf16']"),
        ("model: {dsa: {topk: 4}}\n", "unknown DSAConfig key(s) ['topk']; valid keys: ["),
    ],
    ids=[
        "prewarm-true",
        "prewarm-bad-key",
        "prewarm-bad-value",
        "model-bad-key",
        "dsa-backend-cpu",
        "dsa-not-mapping",
        "seed-str",
        "seed-bool",
        "seed-float",
        "out-null",
        "parity-str",
        "progress-str",
        "lr-bool",
        "max-pad-bool",
        "min-doc-over-a-chapter",
        "min-doc-over-a-book",
        "dtype-list",
        "model-dsa-bad-key",
    ],  # fmt: skip
)
def test_demo_config_sections_checked_before_any_rank_starts(tmp_path, capsys, yaml_text, message, monkeypatch):
    started = []
    monkeypatch.setattr(train, "launch", lambda cfg: started.append(cfg))
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    assert _cli(["demo", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not started


def test_demo_out_that_is_a_file_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(train, "launch", lambda cfg: started.append(cfg))
    (tmp_path / "taken").write_text("")
    assert _cli(["demo", "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a folder" in err and "Traceback" not in err and not started


@pytest.mark.parametrize(
    "argv, yaml_text",
    [(["--preset", "h200"], None), ([], "preset: large\n"), (["--preset", "h200"], "preset: tiny\n")],
    ids=["flag", "config", "flag-over-config"],
)
def test_demo_unknown_preset_lists_the_valid_ones(tmp_path, capsys, monkeypatch, argv, yaml_text):
    started = []
    monkeypatch.setattr(train, "launch", lambda cfg: started.append(cfg))
    if yaml_text is not None:
        (tmp_path / "demo.yaml").write_text(yaml_text)
        argv = [*argv, "--config", str(tmp_path / "demo.yaml")]
    assert _cli(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert "unknown preset; valid presets: tiny, h200-32k" in err and "Traceback" not in err and not started


def test_demo_preset_values_are_overridden_by_config_then_flags(tmp_path):
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(
        "preset: h200-32k\nseq_len: 8192\nsteps: 7\nmodel:\n  layers: GDSG\n  dsa:\n    rope_scaling: null\n"
    )
    args = _parse(["demo", "--config", str(cfg), "--steps", "5", "--attn-backend", "dense", "--dsa-backend", "torch"])
    got = train.config_from_args(args)
    assert got.preset == "h200-32k" and got.seq_len == 8192 and got.steps == 5  # file over preset, flag over file
    assert (got.attn_backend, got.dsa_backend, got.documents, got.dtype) == ("dense", "torch", "books", "bfloat16")
    assert got.model["layers"] == "GDSG" and got.model["hidden_size"] == 2048  # model keys one by one
    assert got.model["dsa"] == {"rope_scaling": None}


def test_demo_default_preset_follows_the_device():
    from longtrain.demo.config import make_config
    from longtrain.demo.presets import default_preset

    assert default_preset("cuda", cuda_available=False) == "h200-32k"
    assert default_preset("auto", cuda_available=True) == "h200-32k"
    assert default_preset("auto", cuda_available=False) == "tiny"
    assert default_preset("cpu", cuda_available=True) == "tiny"
    cuda = make_config({"device": "cuda"})
    assert cuda.preset == "h200-32k" and cuda.seq_len == 32768 and cuda.cp == 1 and cuda.model["hidden_size"] == 2048
    assert make_config({"device": "auto"}, cuda_available=True).preset == "h200-32k"
    assert make_config({"device": "cuda", "preset": "tiny"}).model == {}  # a named preset wins over the device's
    assert make_config({"preset": "h200-32k"}).device == "cuda"
    assert make_config({}) == train.DemoConfig()  # no preset, no device: tiny, today's defaults


def test_tiny_preset_is_the_dataclass_default():
    from longtrain.demo.presets import PRESETS

    d = train.DemoConfig()
    assert d.preset == "tiny"
    assert {k: getattr(d, k) for k in PRESETS["tiny"].defaults()} == PRESETS["tiny"].defaults()
    with pytest.raises(train.DemoConfigError, match="unknown preset; valid presets"):  # not "unhashable type"
        train.DemoConfig(preset=["tiny"])


def test_dense_baseline_backends_are_accepted_with_h200_32k():
    """What the GPU sweep runs: the h200-32k model with the plain-PyTorch attention paths at shorter rows (checked
    here on the CPU, where every check but the device's runs)."""
    from longtrain.demo.config import build_model_config, check_environment, make_config

    for seq_len in (4096, 8192, 16384, 32768):
        cfg = make_config({"preset": "h200-32k", "device": "cpu", "attn_backend": "dense", "dsa_backend": "torch",
                           "seq_len": seq_len})  # fmt: skip
        check_environment(cfg)
        assert build_model_config(cfg, torch.device("cpu")).dsa_config().backend == "torch"
        assert cfg.doc_span_max == seq_len // 3


def test_readme_presets_table_is_the_registry():
    from pathlib import Path

    from longtrain.demo.presets import presets_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert presets_markdown() in readme


def test_demo_config_without_pyyaml_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("steps: 2\n")
    assert _cli(["demo", "--config", str(cfg)]) == 2
    assert "pip install pyyaml" in capsys.readouterr().err


def test_version_and_python_m(capsys):
    from longtrain import __version__

    with pytest.raises(SystemExit) as exc:
        _cli(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"longtrain {__version__}"
    res = subprocess.run([sys.executable, "-m", "longtrain", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"longtrain {__version__}"


def test_packaging_metadata():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in text and "Apache License" in (root / "LICENSE").read_text()
    assert (root / "src" / "longtrain" / "py.typed").exists()


def test_demo_help_explains_options():
    res = _run(["demo", "--help"], timeout=60)
    assert res.returncode == 0
    for flag in (
        "--preset",
        "h200-32k",
        "--documents",
        "--peak-tflops",
        "--steps",
        "--seq-len",
        "--cp",
        "--device",
        "--dtype",
        "--attn-backend",
        "--dsa-backend",
        "--seed",
        "--out",
        "--config",
    ):
        assert flag in res.stdout


def test_failed_parity_exits_nonzero(monkeypatch, capsys):
    def fail(cfg):
        raise train.ParityError("step-1 parity failed: loss rel diff 1.0e-01, grad norm rel diff 0.0e+00")

    monkeypatch.setattr(train, "launch", fail)
    args = _parse(["demo", "--steps", "1", "--seq-len", "64", "--cp", "1", "--no-prewarm"])
    assert train.main(args) == 1
    assert "parity failed" in capsys.readouterr().err


def test_parity_verdict_is_checked():
    ok = train._parity(0, 2.0, 3.0, 2.0 * (1 + 1e-7), 3.0, torch.float32, torch.device("cpu"), False)
    assert ok["ok"] and ok["rtol"] == train._PARITY_RTOL[torch.float32]
    with pytest.raises(train.ParityError):
        train._parity(0, 2.0, 3.0, 2.1, 3.0, torch.float32, torch.device("cpu"), False)


def _parse(argv):
    from longtrain.cli import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_all_ranks(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        LONGTRAIN + ["demo", "--cp", "2", "--steps", "100000", "--seq-len", "128", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        # as in a terminal: a job started in the background of a non-interactive shell (some CI runners) inherits
        # SIGINT ignored, and Python then never raises KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "o" / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the whole process group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    # Every rank (and multiprocessing's helper processes) must be gone shortly after the parent returns.
    deadline = time.monotonic() + 15
    while True:
        leftover = subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True, text=True).stdout
        if not leftover.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert leftover.strip() == "", leftover


def test_torchrun_launch(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "longtrain.cli",
        "demo",
        "--steps",
        "2",
        "--seq-len",
        "128",
        "--out",
        str(tmp_path / "o"),
        "--no-prewarm",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "parity:" in res.stdout and "OK" in res.stdout


def test_demo_balanced_sharding_parity_passes(tmp_path):
    """--sharding balanced: the GQA and DSA layers on the planned pieces, GDN on the whole row; step 1 equals one
    rank."""
    out = tmp_path / "run"
    res = _run(["demo", "--cp", "2", "--steps", "2", "--seq-len", "512", "--sharding", "balanced", "--out", str(out),
                "--no-prewarm"])  # fmt: skip
    assert res.returncode == 0, res.stderr
    parity = [line for line in res.stdout.splitlines() if line.startswith("parity:")]
    assert len(parity) == 1 and parity[0].endswith("OK"), res.stdout
    assert json.loads((out / "summary.json").read_text())["sharding"] == "balanced"


def test_torchrun_world_that_does_not_divide_seq_len_exits_2_before_launch(monkeypatch, capsys):
    """Under torchrun the WORLD_SIZE ranks are the CP group: a world that does not divide the row is a clean exit 2
    naming WORLD_SIZE, not a DemoConfigError traceback from inside launch on every rank."""
    started = []
    monkeypatch.setattr(train, "launch", lambda cfg: started.append(cfg))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert _cli(["demo", "--steps", "1", "--seq-len", "256", "--no-prewarm"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=3" in err and "not divisible by 2 * cp = 6" in err and not started


def test_torchrun_world_is_the_cp_size_in_the_header_and_summary(tmp_path, monkeypatch, capsys):
    """torchrun with 4 ranks and the tiny preset's cp=2: the header, summary.json and the per-rank TFLOP/s say 4."""
    seen = []

    def fake_launch(cfg):
        seen.append(cfg.cp)
        record = {"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "step_time_s": 1.0, "real_tokens": 200,
                  "model_flops": 4e12}  # fmt: skip
        return {"rank": 0, "world": 4, "history": [record], "parity": None, "device": "cpu", "device_name": "cpu",
                "dtype": "float32", "layers": "GDSG", "parameters": 1, "peak_tflops": None, "peak_source": "n/a",
                "step1_peak_memory_gib": None, "steady_peak_memory_gib": None}  # fmt: skip

    monkeypatch.setattr(train, "launch", fake_launch)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "o"
    assert _cli(["demo", "--steps", "1", "--seq-len", "256", "--out", str(out), "--no-prewarm"]) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert seen == [4] and " cp=4 " in stdout and "on 4 rank(s)" in stdout
    assert summary["cp"] == 4 and summary["model_tflops_per_s_per_rank"] == pytest.approx(4.0 / 4)
