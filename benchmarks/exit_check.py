"""Clean exit after ``destroy_process_group()``: repeated multi-rank gloo runs that used the library (CPU).

Scenarios, each launched ``--repeats`` times with ``torchrun --standalone --nproc-per-node W``:

- ``cp_step``: a CP step over THD shards (all-to-all-v exchange, forward and backward), with the step and the output
  (and so its autograd graph) still referenced by module globals when the process group is destroyed and the
  interpreter exits;
- ``comm_prewarm``: the comm-group prewarm on a ``W/2 x 2`` DeviceMesh with DTensor parameters sharded over both dims;
- ``control_allreduce`` / ``control_mesh_only``: the same without the library (its all-reduces written by hand; the
  mesh and parameter alone), to tell our objects from torch's;
- ``*_barrier``: the same with ``dist.barrier()`` before ``destroy_process_group()``; ``*_no_destroy``: the process
  exits without ``destroy_process_group()``; ``*_os_exit``: ``os._exit(0)`` after it, skipping the interpreter's
  teardown (workarounds).

A run is clean when every rank exits with status 0; the report counts the runs that died (SIGABRT: "terminate called
without an active exception") per scenario and world size. Run from the repository root::

    PYTHONPATH=src python benchmarks/exit_check.py [--repeats 50] [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_header, write_report  # noqa: E402

SCENARIOS = {
    "cp_step": """
import torch
import torch.distributed as dist

from longtrain.blockdiag_cp import build_cp_step, cp_varlen_attention

dist.init_process_group("gloo")
ids = torch.tensor([1] * 300 + [2] * 500 + [3] * 150 + [0] * 74)
step = build_cp_step(ids, dist.group.WORLD, kv_exchange="a2a")
q = torch.randn(step.local_len, 8, 64, requires_grad=True)
k = torch.randn(step.local_len, 2, 64, requires_grad=True)
out = cp_varlen_attention(q, k, k, step)
out.sum().backward()
dist.destroy_process_group()  # step and out (with its graph) are still alive here
""",
}

# A W/2 x 2 DeviceMesh with a DTensor parameter sharded over both dims; the scenarios below add their steps.
_MESH = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "cp"))
model = torch.nn.Linear(8, 8)
model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0), Shard(1)]))
"""
_PREWARM = """
from longtrain.prewarm import PrewarmConfig
PrewarmConfig(comm_groups=True).apply([model], torch.device("cpu"))
"""
# the controls: the prewarm's one-element all-reduces on both mesh dims written by hand, without the library
_BY_HAND = """
for dim in range(2):
    dist.all_reduce(torch.zeros(()), group=mesh.get_group(mesh_dim=dim))
"""
_BARRIER = "dist.barrier()  # every rank is done with every group before any rank tears one down\n"
# leave without the interpreter's teardown (flush what you print first)
_OS_EXIT = "import os, sys\nsys.stdout.flush()\nos._exit(0)\n"
_DESTROY = "dist.destroy_process_group()  # the mesh and the DTensor parameter are still alive here\n"
# The README's training loop (3 steps: shard, forward + backward in the step, all-reduce the gradients, AdamW),
# with the library's attention or, as the control, every rank attending over the whole row with plain SDPA.
_LOOP = """
import torch
import torch.distributed as dist
import torch.nn.functional as F

from longtrain.blockdiag_cp import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

USE_LIBRARY = {library}
dist.init_process_group("gloo")
torch.manual_seed(0)
qkv, o = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)
params = list(qkv.parameters()) + list(o.parameters())
opt = torch.optim.AdamW(params, lr=1e-3)
for step in range(3):
    ids = torch.tensor([1] * 300 + [2] * 500 + [3] * 150 + [0] * 74)[None]
    x = torch.randn(1, ids.shape[1], 64)
    if USE_LIBRARY:
        ctx, local, layout = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None,
                                                             {{"inputs_embeds": x, "_packed_seq_ids": ids}})
    with ctx() if USE_LIBRARY else torch.enable_grad():
        h = local["inputs_embeds"] if USE_LIBRARY else x
        q, k, v = qkv(h).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        attend = cp_blockdiag_sdpa if USE_LIBRARY else F.scaled_dot_product_attention
        loss = o(attend(q, k, v, is_causal=True).transpose(1, 2).flatten(2)).square().mean()
        loss.backward()
    for p in params:
        dist.all_reduce(p.grad)
    opt.step(), opt.zero_grad()
    dist.all_reduce(loss := loss.detach())
"""
_GC = "import gc\ngc.collect()  # cyclic garbage freed while the groups are still up\n"
SCENARIOS.update({
    "cp_training_loop": _LOOP.format(library=True) + "dist.destroy_process_group()\n",
    "cp_training_loop_gc": _LOOP.format(library=True) + _GC + "dist.destroy_process_group()\n",
    "control_training_loop": _LOOP.format(library=False) + "dist.destroy_process_group()\n",
    "comm_prewarm": _MESH + _PREWARM + _DESTROY,
    "control_allreduce": _MESH + _BY_HAND + _DESTROY,
    "control_mesh_only": _MESH + _DESTROY,
    "comm_prewarm_barrier": _MESH + _PREWARM + _BARRIER + _DESTROY,
    "control_allreduce_barrier": _MESH + _BY_HAND + _BARRIER + _DESTROY,
    "control_allreduce_no_destroy": _MESH + _BY_HAND,
    "control_allreduce_os_exit": _MESH + _BY_HAND + _DESTROY + _OS_EXIT,
    "comm_prewarm_os_exit": _MESH + _PREWARM + _DESTROY + _OS_EXIT,
})  # fmt: skip


def run_once(script: Path, world: int) -> tuple[bool, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    text = res.stdout + res.stderr
    return res.returncode == 0, "terminate called" if "terminate called" in text else text[-300:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default="exit_check")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios:
            script = Path(tmp) / f"{name}.py"
            script.write_text(SCENARIOS[name])
            for world in args.worlds:
                failures = [run_once(script, world) for _ in range(args.repeats)]
                bad = [why for ok, why in failures if not ok]
                rows.append({"scenario": name, "W": world, "runs": args.repeats, "failed": len(bad),
                             "sigabrt": sum(1 for why in bad if why == "terminate called"),
                             "first failure": bad[0][:120] if bad else ""})  # fmt: skip
                print(rows[-1], flush=True)
    columns = [("scenario", "scenario"), ("W", "ranks"), ("runs", "runs"), ("failed", "failed runs"),
               ("sigabrt", "of which SIGABRT at exit"), ("first failure", "first failure")]  # fmt: skip
    notes = (
        "Each run is a fresh torchrun job of gloo ranks on this CPU machine; a failed run is one where any rank exited "
        "non-zero. The scenarios keep the library's objects (step, autograd graph; DeviceMesh, DTensor) alive past "
        "destroy_process_group()."
    )
    md, js = write_report(args.name, rows, columns, notes, header=machine_header(), out_dir=args.out_dir,
                          title="Clean exit after destroy_process_group() (gloo, CPU)")  # fmt: skip
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
