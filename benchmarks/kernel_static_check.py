"""Compile every Hopper tile entry for sm90 without a GPU and say what the hardware would get: registers, spills,
shared memory, which MMA instruction (``wgmma`` or ``mma.sync``) and how wide the global loads are.

``python -m benchmarks.kernel_static_check [--family hopper] [--first-only]``. Triton compiles to PTX and ptxas
(both in the triton wheel) assembles it for any target, so a tile that spills, overflows shared memory or misses
the tensor-core instruction it was meant for shows up here before a GPU is lent. It does not time anything.
Launch arguments are modelled as the runtime specialises them: unit strides are constants, every other
integer and pointer is 16-byte aligned (N and K multiples of 16), activations bf16, int4 weights in groups of 128.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from compress.kernels import configs, w4a16_kernels, w8a8

SHARED_MEMORY_LIMIT = 232448  # bytes of dynamic shared memory per block on sm90 (227 KiB)
UNIT_STRIDES = ("stride_xk", "stride_pn", "stride_sn", "stride_zn", "stride_on", "stride_ak", "stride_bk", "stride_bsn")
W4A16_FLAGS = dict(
    BITS=4,
    GROUP_SIZE=128,
    HAS_ZERO=False,
    HAS_G_IDX=False,
    HAS_BIAS=False,
    ONE_GROUP_PER_TILE=True,
    DOT_PRECISION="tf32",
)


@dataclass
class Compiled:
    table: str
    config: dict
    registers: int
    spill_bytes: int
    shared_bytes: int
    mma: str
    global_loads: dict[str, int]

    def problems(self) -> list[str]:
        found = []
        if self.spill_bytes:
            found.append(f"spills {self.spill_bytes} bytes")
        if self.shared_bytes > SHARED_MEMORY_LIMIT:
            found.append(f"needs {self.shared_bytes} bytes of shared memory (limit {SHARED_MEMORY_LIMIT})")
        return found


def kernel_cases(table: str, dtype: str) -> tuple[triton.JITFunction, dict[str, str], dict]:
    """(kernel, pointer dtypes, fixed constexprs) for a table name; ``dtype`` is fp8 or int8 for SCALED_MM."""
    w4 = dict(
        x_ptr="bf16",
        packed_ptr="i32",
        scale_ptr="bf16",
        zero_ptr="bf16",
        bias_ptr="bf16",
        g_idx_ptr="i32",
        out_ptr="bf16",
    )
    if table == "W4A16_SKINNY":
        return w4a16_kernels.skinny_kernel, w4, dict(W4A16_FLAGS, BLOCK_M=16)
    if table == "W4A16_GEMV":
        flags = {k: v for k, v in W4A16_FLAGS.items() if k not in ("HAS_G_IDX", "DOT_PRECISION")}
        return w4a16_kernels.gemv_kernel, w4, flags
    if table == "W4A16_GEMM":
        return w4a16_kernels.gemm_kernel, w4, dict(W4A16_FLAGS)
    if table == "W4A16_DEQUANT":
        flags = {k: v for k, v in W4A16_FLAGS.items() if k not in ("HAS_BIAS", "DOT_PRECISION")}
        return w4a16_kernels.dequantize_kernel, w4, flags
    operand = "fp8e4nv" if dtype == "fp8" else "i8"
    pointers = dict(
        a_ptr=operand, b_ptr=operand, a_scale_ptr="fp32", b_scale_ptr="fp32", bias_ptr="bf16", out_ptr="bf16"
    )
    return w8a8._scaled_mm_kernel, pointers, dict(INT8=dtype == "int8", DECODE_FP8=False, HAS_BIAS=False)


def compile_for_sm90(kernel: triton.JITFunction, pointers: dict[str, str], constexprs: dict, config: dict):
    """``kernel`` compiled for sm90, specialised as the launcher would."""
    meta, options = configs.launch_options({k: v for k, v in config.items() if k != "KIND"})
    constants = {**constexprs, **meta, **{name: 1 for name in UNIT_STRIDES if name in kernel.arg_names}}
    signature, aligned = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = f"*{pointers[name]}" if name.endswith("_ptr") else "i32"
            aligned[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_path() -> str:
    from triton.backends.nvidia import compiler

    try:
        return compiler.get_ptxas(90).path
    except TypeError:  # older Triton: one ptxas for every architecture
        return compiler.get_ptxas().path


def inspect(table: str, config: dict, dtype: str = "") -> Compiled:
    kernel, pointers, constexprs = kernel_cases(table, dtype)
    compiled = compile_for_sm90(kernel, pointers, constexprs, config)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run(
            [ptxas_path(), "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".o"))],
            capture_output=True,
            text=True,
            check=True,
        )
    text = report.stdout + report.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    loads = Counter(re.sub(r"\.L1::\w+|\.L2::\w+(::\w+)?", "", op) for op in re.findall(r"ld\.global[^ ]*", ptx))
    label = f"{table}[{dtype}]" if dtype else table
    return Compiled(label, config, registers, spills, compiled.metadata.shared, mma, dict(loads))


def tables(family: str) -> list[tuple[str, dict, str]]:
    """(table name, entry, operand dtype) for every entry of ``family``; gemv entries of the skinny table apart."""
    entries = []
    for config in configs.W4A16_SKINNY[family]:
        entries.append(("W4A16_GEMV" if config.get("KIND") == "gemv" else "W4A16_SKINNY", config, ""))
    entries += [("W4A16_GEMM", config, "") for config in configs.W4A16_GEMM[family]]
    entries += [("W4A16_DEQUANT", config, "") for config in configs.W4A16_DEQUANT[family]]
    for dtype in ("int8", "fp8"):
        entries += [("SCALED_MM", config, dtype) for config in configs.SCALED_MM[family]]
    return entries


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_static_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--family", default="hopper", choices=["hopper", "ampere"])
    parser.add_argument(
        "--tables",
        type=lambda t: t.split(","),
        help="only these (W4A16_GEMV, W4A16_SKINNY, W4A16_GEMM, W4A16_DEQUANT, SCALED_MM), comma separated",
    )
    parser.add_argument("--first-only", action="store_true", help="only the entry COMPRESS_AUTOTUNE=0 takes")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of the Markdown table")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "error: TRITON_INTERPRET=1 turns the kernels into interpreted functions that cannot be compiled; "
            "run with TRITON_INTERPRET=0",
            file=sys.stderr,
        )
        return 2
    seen: set[tuple[str, str]] = set()
    results = []
    for table, config, dtype in tables(args.family):
        if (args.tables and table not in args.tables) or (args.first_only and (table, dtype) in seen):
            continue
        seen.add((table, dtype))
        results.append(inspect(table, config, dtype))
    if args.json:
        print(json.dumps([dict(asdict(r), problems=r.problems()) for r in results]))
        return 0
    print("| table | config | registers | spill bytes | shared bytes | mma | global loads | problems |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        entry = " ".join(f"{k}={v}" for k, v in result.config.items())
        print(
            f"| {result.table} | {entry} | {result.registers} | {result.spill_bytes} | {result.shared_bytes} | "
            f"{result.mma} | {result.global_loads} | {'; '.join(result.problems()) or '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
