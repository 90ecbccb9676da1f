"""Tile configurations as data, one table per kernel and GPU family, and the tiny autotuner that picks one.

Each entry is a dict of the kernel's block-size constexprs plus ``num_warps``/``num_stages``.
On a GPU the first call for a (kernel, M bucket, N, K, dtype) key times every candidate of the
family's table with the same launch the op uses (L2 flushed between runs) and caches the fastest;
``COMPRESS_AUTOTUNE=0`` skips timing and takes the first entry that runs. Under the Triton interpreter only the
first ``interpreter`` entry runs (multi-config timing does not work there). The tables are untuned
starting points for Hopper (H100/H200) and Ampere: check them with ``python -m compress bench kernels``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from compress.kernels.backend import interpreter_active

Config = dict[str, int | str]  # block sizes, num_warps/num_stages, and KIND for kernel variants

# Decode / skinny W4A16 (M <= SKINNY_MAX_M): one 16-row dot tile, split-K so that even N=4096 launches enough
# programs to keep every SM streaming weights (132 SMs on H100 need >= ~264 programs).
# ``KIND="gemv"`` entries run the tensor-core-free kernel (M <= GEMV_MAX_M, one row per program): at M=1 a
# 16-row dot tile wastes 15/16 of its work and routes every dequantized tile through shared memory.
W4A16_SKINNY: dict[str, list[Config]] = {
    "hopper": [
        # gemv tiles: the fastest of `python -m benchmarks.gemv_sweep` on an H100 (2026-11-26, M = 1 and 4 on the
        # 4096x4096, 14336x4096 and 4096x14336 weights): narrow N tiles, long K tiles, 8 warps, few splits.
        dict(KIND="gemv", BLOCK_N=32, BLOCK_K=512, SPLIT_K=1, num_warps=8, num_stages=1),
        dict(KIND="gemv", BLOCK_N=32, BLOCK_K=512, SPLIT_K=4, num_warps=8, num_stages=1),
        dict(KIND="gemv", BLOCK_N=32, BLOCK_K=512, SPLIT_K=2, num_warps=8, num_stages=1),
        dict(KIND="gemv", BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=1),
        dict(KIND="gemv", BLOCK_N=32, BLOCK_K=256, SPLIT_K=8, num_warps=4, num_stages=1),
        dict(KIND="gemv", BLOCK_N=64, BLOCK_K=512, SPLIT_K=1, num_warps=8, num_stages=1),
        dict(KIND="gemv", BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, num_warps=8, num_stages=1),
        dict(KIND="gemv", BLOCK_N=128, BLOCK_K=128, SPLIT_K=16, num_warps=2, num_stages=1),
        dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),
        dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),
        dict(BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3),
        dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=8, num_warps=4, num_stages=3),
        dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=8, num_warps=2, num_stages=5),
        dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=4),
        dict(BLOCK_N=256, BLOCK_K=64, SPLIT_K=2, num_warps=8, num_stages=4),
        # gemlite 0.6's H100 tile cache at M = 2..16 (its split-K dot kernel, same shapes): 15-24 % faster than ours
        dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=16, num_warps=4, num_stages=1),
        dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=16, num_warps=4, num_stages=3),
        dict(BLOCK_N=256, BLOCK_K=64, SPLIT_K=8, num_warps=4, num_stages=1),
    ],
    "ampere": [
        dict(KIND="gemv", BLOCK_N=64, BLOCK_K=256, SPLIT_K=8, num_warps=4, num_stages=3),
        dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=8, num_warps=4, num_stages=4),
        dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3),
    ],
    # SPLIT_K=2 with BLOCK_K=32 exercises the atomic split-K epilogue and the per-tile scale load in tests.
    "interpreter": [dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2, num_warps=4, num_stages=1)],
}

# Prefill W4A16 (M > SKINNY_MAX_M): tiled GEMM, grouped program order for L2 reuse of the activation rows.
W4A16_GEMM: dict[str, list[Config]] = {
    "hopper": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
        # gemlite 0.6's H100 tile cache at M = 128..256 (narrow N tiles, no pipelining)
        dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=1),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=1),
        dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=1),
    ],
    "ampere": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    ],
    # BLOCK_K=64 above group size 32 exercises the per-column (gathered) scale path.
    "interpreter": [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)],
}

# Large-M W4A16: dequantize the packed weight once per call into a scratch W.T in the activation dtype (Triton), then
# cuBLAS. The pass moves the int4 weight plus the dense one (14336x4096: 29 MB read + 117 MB written, ~50 us at the
# H100's 3 TB/s copy rate) on top of a bf16 GEMM. The tiled kernel measured 0.33-0.39x bf16 at M=1024 on an H100
# (14336x4096: 496 us against 170 us), so there the pass wins (~50 + 170 us); at M=128 it loses (~50 + 57 us against
# 77 us). M=512 is the conservative crossover from that arithmetic, not a measurement: tune it on the GPU
# (`bench kernels --kernels w4a16 --rows 128,256,512,1024`). One pass per program tile: no K loop, so no stages.
W4A16_DEQUANT_MIN_M: dict[str, int] = {"hopper": 512, "ampere": 512, "interpreter": 512}
W4A16_DEQUANT: dict[str, list[Config]] = {
    "hopper": [
        dict(KIND="dequant", BLOCK_K=64, BLOCK_N=256, num_warps=8, num_stages=1),
        dict(KIND="dequant", BLOCK_K=64, BLOCK_N=128, num_warps=4, num_stages=1),
        dict(KIND="dequant", BLOCK_K=128, BLOCK_N=128, num_warps=8, num_stages=1),
        dict(KIND="dequant", BLOCK_K=32, BLOCK_N=256, num_warps=4, num_stages=1),
        dict(KIND="dequant", BLOCK_K=128, BLOCK_N=256, num_warps=8, num_stages=1),
    ],
    "ampere": [
        dict(KIND="dequant", BLOCK_K=64, BLOCK_N=128, num_warps=4, num_stages=1),
        dict(KIND="dequant", BLOCK_K=64, BLOCK_N=256, num_warps=8, num_stages=1),
    ],
    # BLOCK_K=64 above group size 32 exercises the per-column (gathered) scale path.
    "interpreter": [dict(KIND="dequant", BLOCK_K=64, BLOCK_N=32, num_warps=4, num_stages=1)],
}

# W8A8 int8 and FP8 GEMM (8-bit dot tiles need BLOCK_K >= 32). Small-M entries keep the weight stream wide.
# Hopper: 128-wide K tiles (one wgmma K step is 32 bytes), 8 warps (two warpgroups) on the 128x128/128x256 tiles,
# 3-5 stages; the 128x256x128 4-stage tile (192 KiB of shared memory) and the small-M tiles are gemlite 0.6's H100
# picks for 8-bit operands at these shapes (1.2-1.4x faster than ours at M >= 1024). Compiled for sm90 without a
# GPU (Triton 3.9): every entry uses wgmma (BLOCK_M >= 64) or mma.sync and fits in shared memory, but for FP8 the
# 128x256 tiles spill (255 registers: the once-per-K-tile promotion keeps a second fp32 accumulator) while int8
# fits in 195. The first entry, taken under COMPRESS_AUTOTUNE=0, fits both.
SCALED_MM: dict[str, list[Config]] = {
    "hopper": [
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=5),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
        dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
    ],
    "ampere": [
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=3),
    ],
    "interpreter": [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)],
}

# Per-token activation quantization: one program per row, two passes over the row in BLOCK_K chunks.
ACT_QUANT: dict[str, list[Config]] = {
    "hopper": [
        dict(BLOCK_K=4096, num_warps=8, num_stages=1),
        dict(BLOCK_K=2048, num_warps=4, num_stages=1),
        dict(BLOCK_K=8192, num_warps=16, num_stages=1),
        dict(BLOCK_K=1024, num_warps=4, num_stages=1),
    ],
    "ampere": [dict(BLOCK_K=2048, num_warps=8, num_stages=1), dict(BLOCK_K=1024, num_warps=4, num_stages=1)],
    "interpreter": [dict(BLOCK_K=64, num_warps=4, num_stages=1)],
}

SKINNY_MAX_M = 16
GEMV_MAX_M = 4


def gpu_family(device: torch.device) -> str:
    """Table to use: ``interpreter`` on CPU, ``hopper`` for sm90 and newer, ``ampere`` otherwise."""
    if device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return "hopper" if major >= 9 else "ampere"


@functools.cache
def supports_native_fp8(device_index: int) -> bool:
    """FP8 (e4m3) tensor-core dots need sm89 (Ada) or newer."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def m_bucket(m: int) -> int:
    """Autotune key for the row count: next power of two, so every decode/prefill size does not retune."""
    return 1 << max(0, (m - 1).bit_length())


_chosen: dict[tuple, Config] = {}


def autotune_enabled() -> bool:
    return os.environ.get("COMPRESS_AUTOTUNE", "1") != "0"


def pick_config(
    table: dict[str, list[Config]], key: tuple, device: torch.device, launch: Callable[[Config], Any]
) -> Config:
    """Fastest entry of ``table[family]`` for ``key``; ``launch(config)`` runs the op once with ``config``."""
    family = gpu_family(device)
    candidates = table.get(family, table["ampere"])
    if family == "interpreter" or interpreter_active():
        return candidates[0]
    cache_key = (id(table), family, key)
    if cache_key not in _chosen:
        from compress.kernels.timing import graph_time_ms

        timings = []
        for config in candidates:
            try:
                if not autotune_enabled():  # the first entry that compiles, fits and takes this input
                    launch(config)
                    timings.append((0.0, config))
                    break
                milliseconds = graph_time_ms(lambda c=config: launch(c), warmup=5, rep=20)
                timings.append((milliseconds, config))
            except Exception:  # a config that does not compile, fit in shared memory or take the input
                continue
        if not timings:
            raise RuntimeError(f"no tile config of {family} compiled for key {key}; extend the table")
        _chosen[cache_key] = min(timings, key=lambda pair: pair[0])[1]
    return _chosen[cache_key]


def launch_options(config: Config) -> tuple[dict[str, int], dict[str, int]]:
    """Split a config into kernel constexprs and launch options (num_warps, num_stages)."""
    meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    return meta, {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
