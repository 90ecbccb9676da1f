"""The tiles an H100 takes first (COMPRESS_AUTOTUNE=0, or the fallback when autotuning finds nothing), compiled
for sm90 on this GPU-less machine by ``benchmarks/kernel_static_check.py`` (in a subprocess: the test session runs
Triton's interpreter, whose kernels cannot be compiled): each must fit (no register spills, shared memory within the
227 KiB a block may have) and use the tensor-core instruction it was chosen for."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_MMA = {
    "W4A16_SKINNY": "mma.sync",
    "W4A16_GEMM": "wgmma",
    "SCALED_MM[int8]": "wgmma",
    "SCALED_MM[fp8]": "wgmma",
}


def test_first_hopper_entries_fit_and_use_the_intended_instructions():
    command = [
        sys.executable,
        "-m",
        "benchmarks.kernel_static_check",
        "--first-only",
        "--json",
        "--tables",
        "W4A16_SKINNY,W4A16_GEMM,SCALED_MM",
    ]
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = {result["table"]: result for result in json.loads(run.stdout.strip().splitlines()[-1])}
    assert set(results) == set(EXPECTED_MMA)
    for table, mma in EXPECTED_MMA.items():
        assert results[table]["problems"] == [] and results[table]["mma"] == mma, results[table]
    for table in ("W4A16_SKINNY", "W4A16_GEMM"):  # the pipeline stages each packed word once, not once per code
        config = results[table]["config"]
        rows = config.get("BLOCK_M", 16)
        stage = rows * config["BLOCK_K"] * 2 + config["BLOCK_K"] // 8 * config["BLOCK_N"] * 4  # bf16 x, int32 words
        dequantized = config["BLOCK_K"] * config["BLOCK_N"] * 2
        assert results[table]["shared_bytes"] <= config["num_stages"] * stage + dequantized, results[table]


def test_refuses_under_the_interpreter():
    command = [sys.executable, "-m", "benchmarks.kernel_static_check", "--first-only"]
    run = subprocess.run(
        command, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "TRITON_INTERPRET=0" in run.stderr
