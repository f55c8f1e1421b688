"""Offline compilation of the Gluon SM90 kernels for sm_90a on a CPU-only machine, in a fresh process (the
interpreter tests leave Triton's language patched): shared memory, registers, spills and the instructions used.

For developing a kernel: ``LONGTRAIN_PTX_DUMP=<file>`` writes the PTX there, ``LONGTRAIN_FULL_ERR=1`` keeps the whole
compiler error instead of its last 3000 characters."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

_SCRIPT = """
import importlib, json, os, re, subprocess, sys, tempfile, traceback
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_one(module, name, types, consts, opts, dump):
    kernel = getattr(importlib.import_module(module), name)
    sig = dict(zip(kernel.arg_names, types))
    for param in kernel.params:  # constexpr parameters with a default that the caller left out take it
        if param.name not in sig and param.name not in consts and param.has_default:
            consts[param.name] = param.default
    sig.update({key: "constexpr" for key in consts})
    num_warps = opts.pop("num_warps", 8)
    consts["num_warps"] = num_warps
    sig["num_warps"] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(types) if t.startswith("*")}
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **opts))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\\d+) STACK:(\\d+) SHARED:\\d+ LOCAL:(\\d+)", usage)
    ptx = compiled.asm["ptx"]
    # ptxas says (C7510-C7520) when it serializes the wgmma pipeline, e.g. because other instructions touch an
    # in-flight accumulator: every wgmma then waits for the one before it.
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                              text=True).stderr
    setmaxnreg = [int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)]
    if dump:
        Path(dump).write_text(ptx)
    serialized = [line for line in info.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    return dict(shared=compiled.metadata.shared, regs=int(m[1]), stack=int(m[2]), local=int(m[3]),
                cp_async="cp.async.cg.shared.global" in ptx, wgmma="wgmma.mma_async" in ptx,
                wgmma_serialized=serialized, setmaxnreg=setmaxnreg)


for line in sys.stdin:  # one request per line, one JSON answer per line
    try:
        answer = dict(ok=True, stats=compile_one(*json.loads(line)))
    except BaseException:
        answer = dict(ok=False, error=traceback.format_exc())
    print(json.dumps(answer), flush=True)
"""


def cuobjdump() -> Path | None:
    """Triton's bundled cuobjdump, or None without triton or its NVIDIA toolchain."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.exists() else None


#: The Triton of the lent GPU machine (torch 2.11's), installed beside the test environment by ``make install`` so that
#: the kernels' register use is checked with the compiler that runs them: Triton 3.6 spilled a kernel that Triton 3.9
#: compiled without spills.
GPU_TRITON = "3.6.0"


def gpu_triton_site() -> Path | None:
    """The folder holding the GPU machine's Triton (``LONGTRAIN_GPU_TRITON_SITE``, else ``<env>/triton-gpu``), or None
    where it is not installed."""
    site = Path(os.environ.get("LONGTRAIN_GPU_TRITON_SITE") or Path(sys.prefix) / "triton-gpu")
    dist = site / f"triton-{GPU_TRITON}.dist-info"
    return site if dist.is_dir() and (site / "triton" / "backends" / "nvidia" / "bin" / "cuobjdump").exists() else None


_WORKERS: dict[Path | None, subprocess.Popen] = {}


def _worker(triton_site: Path | None) -> subprocess.Popen:
    """The session's compile worker for ``triton_site`` (started on first use; a new one after a crash)."""
    worker = _WORKERS.get(triton_site)
    if worker is None or worker.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        paths = [str(triton_site)] if triton_site is not None else []
        paths += [str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        # stderr to a file: a pipe nobody reads could fill up and stall the worker; its tail explains a crash
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the worker)
        worker = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True, env=env)  # fmt: skip
        worker.log = log
        _WORKERS[triton_site] = worker
        atexit.register(worker.kill)
    return worker


def compile_sm90(module: str, name: str, types: list[str], consts: dict, triton_site: Path | None = None,
                 **options) -> dict:  # fmt: skip
    """Compile ``module.name`` (a Gluon kernel; ``options`` are compile options, 8 warps unless ``num_warps`` says
    otherwise) for sm_90a, with the Triton in ``triton_site`` if given, else the installed one; its resource usage
    and instruction flags."""
    worker = _worker(triton_site)
    worker.stdin.write(json.dumps([module, name, types, consts, options, os.environ.get("LONGTRAIN_PTX_DUMP")]) + "\n")
    worker.stdin.flush()
    ready, _, _ = select.select([worker.stdout], [], [], 600)
    line = worker.stdout.readline() if ready else ""
    if not line:  # crashed or stuck: kill it, the next compile starts a new one
        worker.kill()
        worker.wait()
        worker.log.seek(0)
        raise AssertionError(f"the compile worker {'timed out' if not ready else 'died'}: {worker.log.read()[-3000:]}")
    answer = json.loads(line)
    full = os.environ.get("LONGTRAIN_FULL_ERR")
    assert answer["ok"], answer.get("error") if full else answer.get("error", "")[-3000:]
    return answer["stats"]
