"""The SM90 (Gluon) indexer scoring kernel on a CPU-only machine: its config, its route, its sm_90a compilation.

Its numbers are checked on the GPU (tests/gpu/test_dsa_triton_gpu.py: the score scratch equal to the portable
kernel's bit for bit); Gluon kernels do not run in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from longtrain.dsa.triton import IndexerConfig
from tests.dsa._sm90_compile import compile_sm90, cuobjdump


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("scores_impl", "gluon", "scores_impl must be one of 'auto', 'sm90', 'triton'"),
        ("sm90_block_n", 64, "sm90_block_n must be 128 or 256"),
        ("sm90_num_buf", 2, r"sm90_num_buf must be an int in \[3, 8\]"),
        ("sm90_num_buf", True, r"sm90_num_buf must be an int in \[3, 8\]"),
        ("sm90_group", 0, r"sm90_group must be an int in \[1, 16\]"),
        ("sm90_group", 32, r"sm90_group must be an int in \[1, 16\]"),
        ("sm90_loader", "bulk", "sm90_loader must be one of 'auto', 'cp_async', 'tma'"),
    ],
    ids=["impl", "block_n", "ring-2", "ring-bool", "group-0", "group-32", "loader"],
)
def test_indexer_config_refuses_bad_sm90_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        IndexerConfig(**{field: value})


def test_scores_route_on_cpu():
    """``auto`` falls back to the portable kernel off SM90; a forced ``sm90`` says why it cannot run and what to use."""
    from longtrain.dsa.triton.indexer_topk import scores_route

    q = torch.zeros((4, 2, 128), dtype=torch.bfloat16)
    assert scores_route(q, IndexerConfig(), False) == "triton"
    assert scores_route(q, IndexerConfig(scores_impl="triton"), False) == "triton"
    with pytest.raises(ValueError, match=r"scores_impl='sm90'.*CUDA SM90.*scores_impl='auto'"):
        scores_route(q, IndexerConfig(scores_impl="sm90"), False)


def test_sm90_scores_unfit_reasons_and_shared_memory():
    from longtrain.dsa.triton.indexer_topk_sm90 import sm90_scores_smem_bytes, sm90_scores_unfit
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES

    assert "CUDA SM90" in sm90_scores_unfit(torch.device("cpu"), torch.bfloat16, 128, False, 256, 5)
    # The key tile and the ring of query tiles: 256 keys + 5 x 64 queries of 128 bf16 = 144 KiB.
    assert sm90_scores_smem_bytes(256, 5, 128) == (256 + 320) * 256
    assert sm90_scores_smem_bytes(256, 8, 128) <= SM90_SMEM_BYTES
    assert sm90_scores_smem_bytes(256, 3, 256) > SM90_SMEM_BYTES  # D_I = 256 needs 128-key tiles
    assert sm90_scores_smem_bytes(128, 4, 256) <= SM90_SMEM_BYTES


def test_head_group_divides_the_heads():
    from longtrain.dsa.triton.indexer_topk_sm90 import head_group

    assert head_group(32, 8) == 8 and head_group(64, 8) == 8 and head_group(48, 16) == 16
    assert head_group(3, 8) == 3 and head_group(16, 4) == 16  # up to 16 heads: one group
    assert head_group(17, 8) == 1 and head_group(18, 8) == 6


@pytest.mark.skipif(cuobjdump() is None, reason="needs triton with its bundled NVIDIA toolchain (ptxas, cuobjdump)")
@pytest.mark.parametrize(
    ("H_I", "block_n", "group", "tma", "fp8"),
    [(32, 256, 16, False, False), (32, 256, 8, True, False), (32, 256, 8, False, False), (32, 128, 8, False, False),
     (3, 256, 3, True, False), (32, 256, 8, True, True)],
    ids=["glm-64x256-group16", "glm-64x256-group8-tma", "glm-64x256-group8", "glm-64x128", "3heads-tma",
         "glm-fp8-tma"],
)  # fmt: skip
def test_sm90_scores_kernel_compiles_for_hopper_without_spills(H_I, block_n, group, tma, fp8):
    """The GLM-5.2 indexer dims, compiled for sm_90a here: cp.async + wgmma, no spills, shared memory within what
    an SM90 block can have, and the wgmma pipeline kept (ptxas serializes every wgmma when another instruction
    touches an accumulator in flight: it did with a head loop that carried a tile in flight across its back
    edge)."""
    import triton

    # FP8 codes (E4M3, the key scales applied after the head sum) run with the TMA loader only, and the library does
    # not route them to this kernel yet: benchmarks/dsa_indexer_variants.py --sm90-sweep measures it first.
    el, bits = ("fp8e4nv", 8) if fp8 else ("bf16", 16)
    swizzled = (
        f"NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth={bits}, rank=2, transposed=False, "
        "fp4_padded=False, cga_layout=[])"
    )
    descs = [f"tensordesc<{el}[64, 128],{swizzled}>", f"tensordesc<{el}[{block_n}, 128],{swizzled}>"]
    types = [f"*{el}", f"*{el}", "*fp32", "*fp32", "*i32", "*i32", "*i32", *(descs if tma else [f"*{el}"] * 2),
             "i32", "i32", "i32", "i32", "i32"]  # fmt: skip
    consts = dict(H_I=H_I, D_I=128, BLOCK_M=64, BLOCK_N=block_n, NUM_BUF=5, GROUP=group, TMA=tma, K_SCALE=fp8)
    stats = compile_sm90("longtrain.dsa.triton.indexer_topk_sm90", "indexer_topk_fwd_sm90_kernel_scores", types, consts)
    assert stats["cp_async"] != tma and stats["wgmma"], stats
    assert stats["shared"] <= 232448, stats
    assert stats["wgmma_serialized"] == [], stats
    # Triton 3.6 (the H200 machine's) allocates every tile without spills; Triton 3.9 spills 16-24 bytes of the
    # 64 x 256 tile (255 registers either way).
    if block_n == 128 or H_I < 32 or triton.__version__.startswith("3.6."):
        assert stats["stack"] == 0 and stats["local"] == 0, stats


def test_tma_descriptors_describe_one_head_and_one_key_tile():
    """The host side of the TMA loader (built here on CPU tensors: the descriptors only validate and record):
    q as ``[T_q, H_I * D_I]`` with a box of one head's 64 rows, k with a box of ``block_n`` rows."""
    from longtrain.dsa.triton.indexer_topk_sm90 import tma_descriptors

    q = torch.zeros((100, 32, 128), dtype=torch.bfloat16)
    k = torch.zeros((100, 128), dtype=torch.bfloat16)
    q_desc, k_desc = tma_descriptors(q, k, 256)
    assert list(q_desc.shape) == [100, 32 * 128] and list(q_desc.block_shape) == [64, 128]
    assert list(k_desc.shape) == [100, 128] and list(k_desc.block_shape) == [256, 128]
    assert q_desc.layout.swizzle_byte_width == 128


def test_cpu_route_does_not_import_the_gluon_module():
    """Off CUDA the route is decided without importing the Gluon kernel's module (a Triton without Gluon still runs
    the portable kernel)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from longtrain.dsa.triton import IndexerConfig\n"
        "from longtrain.dsa.triton.indexer_topk import scores_route\n"
        "assert scores_route(torch.zeros((4, 2, 128), dtype=torch.bfloat16), IndexerConfig(), False) == 'triton'\n"
        "assert 'longtrain.dsa.triton.indexer_topk_sm90' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
