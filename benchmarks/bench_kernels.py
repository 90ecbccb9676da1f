"""``python -m compress bench kernels``: our GEMM kernels against ``torch.matmul`` bf16 and paged decode attention
against ``scaled_dot_product_attention`` bf16, measured in one run.

For Llama-8B/70B-like weights ``[N, K]`` and row counts M it times each op (median of CUDA-graph replays, L2
flushed, see ``compress.kernels.timing``; baselines are timed the same way) and reports TFLOP/s, GB/s of the bytes the
op must move (weight + scales + activations + output), that bandwidth as a share of a device-to-device copy measured in
the same run, the speedup over the dense bf16 baseline in the same run, and the float64 relative error. Writes
``benchmarks/results/kernels-<device>.{json,md}``. Needs a CUDA GPU; ``--smoke`` runs tiny shapes on whatever device
exists (CPU: torch references, or the interpreter with ``COMPRESS_KERNELS=triton TRITON_INTERPRET=1``) to check the
script itself.
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import triton

from compress.base.errors import CompressError
from compress.commands.args import parse_options, usage, wants_help
from compress.kernels import ops
from compress.kernels.accuracy import relative_error
from compress.kernels.fp8_block import dequantize_fp8_blocks, quantize_weight_fp8_blocks
from compress.kernels.packing import pack_int32
from compress.kernels.timing import graph_time_ms
from compress.kernels.w4a16 import repack_n_contiguous

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # weight [N, K]
ROWS = [1, 4, 16, 64, 128, 1024, 4096]
SMOKE_SHAPES = [(96, 256)]
SMOKE_ROWS = [1, 16, 40]
SMOKE_CONTEXT = 64
KERNELS = ["w4a16", "w4a16-disk", "int8", "int8-gemm", "fp8", "fp8-gemm", "act-quant"]
ATTENTION = ["paged-attn-bf16", "paged-attn-int8", "paged-attn-fp8"]  # decode over a paged KV cache
ATTENTION_SHAPE = dict(heads=32, kv_heads=8, head_dim=128, block_size=16)  # Llama-3-8B attention
GROUP_SIZE = 128
COPY_BYTES = 1 << 30

# (description, kernel, rows predicate, metric, threshold): the kernel goals, judged on the worst matching row.
GOALS = [
    ("W4A16 M=1 speedup >= 3.3x", "w4a16", lambda m: m == 1, "speedup", 3.3),
    ("W4A16 M=1 >= 75% of copy bandwidth", "w4a16", lambda m: m == 1, "copy_bandwidth_pct", 75.0),
    ("W4A16 M=16 speedup >= 3x", "w4a16", lambda m: m == 16, "speedup", 3.0),
    ("W4A16 M=128 speedup >= 1x", "w4a16", lambda m: m == 128, "speedup", 1.0),
    ("int8 W8A8 (with act quant) M>=1024 speedup >= 1.6x", "int8", lambda m: m >= 1024, "speedup", 1.6),
    ("FP8 W8A8 (with act quant) M>=1024 speedup >= 1.5x", "fp8", lambda m: m >= 1024, "speedup", 1.5),
    ("act-quant M>=1024 >= 70% of copy bandwidth", "act-quant", lambda m: m >= 1024, "copy_bandwidth_pct", 70.0),
    (
        "int8-KV paged decode attention >= 70% of copy bandwidth",
        "paged-attn-int8",
        lambda m: m >= 16,
        "copy_bandwidth_pct",
        70.0,
    ),
]


@dataclass
class Row:
    kernel: str
    n: int
    k: int
    m: int
    time_us: float
    tflops: float
    gbps: float
    copy_bandwidth_pct: float
    torch_bf16_us: float | None
    speedup: float | None
    relative_error: float | None


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call: CUDA-graph replays with L2 flushed on a GPU (as the engine decodes; eager
    timing would measure Python launch cost), wall clock on CPU (smoke only)."""
    if device.type == "cuda":
        return graph_time_ms

    def cpu_median(fn: Callable[[], object]) -> float:
        fn()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    return cpu_median


def device_slug(device: torch.device, smoke: bool) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine() or "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-smoke" if smoke else slug


def copy_bandwidth_gbps(device: torch.device, measure, size: int) -> float:
    """Bytes read + written per second by a large device-to-device copy. Timed eagerly on a GPU: a graph-replayed
    1 GiB copy read ~20 % slower on an H100 (2427 against 3006 GB/s), which would flatter every percentage."""
    source = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    if device.type == "cuda":
        milliseconds = triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=100, return_mode="median")
    else:
        milliseconds = measure(lambda: target.copy_(source))
    return 2 * size / (milliseconds * 1e-3) / 1e9


@dataclass
class QuantizedWeight:
    """One random weight ``[N, K]`` in a kernel's format, and the float64 dense weight it stands for."""

    values: torch.Tensor  # w4a16: int8 codes in [-8, 7]; int8/fp8: the 8-bit weight
    scale: torch.Tensor  # w4a16: [N, K / GROUP_SIZE] in the activation dtype; int8/fp8: [N, 1] fp32
    dense: torch.Tensor  # float64 [N, K]: what every implementation should compute with


def quantized_weight(kind: str, n: int, k: int, device: torch.device, dtype: torch.dtype) -> QuantizedWeight:
    """``kind`` is ``w4a16`` (symmetric int4, group GROUP_SIZE), ``int8`` or ``fp8`` (per-channel scales), or
    ``fp8_block`` (e4m3, one scale per 128x128 block: ``FP8_BLOCK``)."""
    generator = torch.Generator(device=device).manual_seed(0)
    if kind == "fp8_block":
        codes, scale = quantize_weight_fp8_blocks(torch.randn(n, k, device=device, generator=generator) * 0.02)
        return QuantizedWeight(codes, scale, dequantize_fp8_blocks(codes, scale).double())
    if kind == "w4a16":
        codes = torch.randint(-8, 8, (n, k), device=device, dtype=torch.int8, generator=generator)
        scale = (torch.rand(n, k // GROUP_SIZE, device=device, generator=generator) * 0.01 + 0.001).to(dtype)
        return QuantizedWeight(codes, scale, codes.double() * scale.double().repeat_interleave(GROUP_SIZE, dim=1))
    weight_dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    qmax = 127 if weight_dtype == torch.int8 else 448
    values = torch.randn(n, k, device=device, generator=generator) * 0.02
    weight_scale = values.abs().amax(dim=1, keepdim=True) / qmax
    scaled = (values / weight_scale).clamp(-qmax, qmax)
    weight = torch.round(scaled).to(torch.int8) if weight_dtype == torch.int8 else scaled.to(weight_dtype)
    return QuantizedWeight(weight, weight_scale, weight.double() * weight_scale.double())


def weight_cases(kernel: str, n: int, k: int, device: torch.device, dtype: torch.dtype):
    """(op taking x, float64 dense weight it computes with, bytes of weight + scales) for one kernel."""
    weight = quantized_weight(kernel.split("-")[0], n, k, device, dtype)
    op = our_op(kernel, weight)
    if kernel.startswith("w4a16"):
        return op, weight.dense, weight.values.numel() // 2 + weight.scale.numel() * weight.scale.element_size()
    return op, weight.dense, weight.values.numel() + weight.scale.numel() * 4


def our_op(kernel: str, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    """Our kernel for ``kernel`` (a name of KERNELS other than act-quant) on ``weight``, as the modules call it."""
    if kernel.startswith("w4a16"):
        packed = pack_int32(weight.values, 4)
        k = weight.values.shape[1]
        repacked = repack_n_contiguous(packed) if kernel == "w4a16" else None
        scale = weight.scale.t().contiguous().t() if kernel == "w4a16" else weight.scale  # as QuantizedLinear keeps it

        def op(x):
            return ops.weight_only_linear(x, packed, scale, None, 4, k, GROUP_SIZE, None, None, repacked)

        return op
    if kernel.startswith("fp8_block"):
        return fp8_block_op(weight, quantize_activations=not kernel.endswith("-gemm"))
    if kernel.endswith("-gemm"):
        quantized = quantized_once(lambda x: ops.quantize_per_token(x, weight.values.dtype))

        def op(x):
            codes, a_scale = quantized(x)
            return ops.scaled_mm(codes, a_scale, weight.values, weight.scale, None, x.dtype)

        return op
    linear = ops.int8_linear if weight.values.dtype == torch.int8 else ops.fp8_linear
    return lambda x: linear(x, weight.values, weight.scale)


def fp8_block_op(weight: QuantizedWeight, quantize_activations: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Our FP8-block linear as the modules call it, or (``quantize_activations=False``) its GEMM alone, the
    activations quantized per token and group of 128 once, outside the timed call."""
    if quantize_activations:
        return lambda x: ops.fp8_block_linear(x, weight.values, weight.scale)
    quantized = quantized_once(ops.quantize_per_token_group)

    def op(x):
        codes, a_scale = quantized(x)
        return ops.fp8_block_matmul(codes, a_scale, weight.values, weight.scale, None, x.dtype)

    return op


def quantized_once(quantize: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``quantize`` kept for the last input it saw (by its storage): a ``-gemm`` row times the GEMM alone, the
    activations quantized once, outside the timed call."""
    cache: dict[int, Any] = {}

    def cached(x: torch.Tensor) -> Any:
        if x.data_ptr() not in cache:
            cache.clear()
            cache[x.data_ptr()] = quantize(x)
        return cache[x.data_ptr()]

    return cached


def run(args: BenchOptions, device: torch.device) -> tuple[list[Row], float]:
    measure = timer(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    copy_gbps = copy_bandwidth_gbps(device, measure, COPY_BYTES if device.type == "cuda" else 1 << 24)
    rows: list[Row] = []
    for n, k in args.shapes if any(k in KERNELS for k in args.kernels) else []:
        dense_weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for kernel in [k for k in args.kernels if k in KERNELS]:
            if kernel == "act-quant":
                op, dense, weight_bytes = None, None, 0
            else:
                op, dense, weight_bytes = weight_cases(kernel, n, k, device, dtype)
            for m in args.rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                if kernel == "act-quant":
                    if (n, k) != next(shape for shape in args.shapes if shape[1] == k):
                        continue  # once per distinct K
                    seconds = measure(lambda x=x: ops.quantize_per_token(x, torch.int8)) * 1e-3
                    moved = m * k * (x.element_size() + 1) + m * 4
                    rows.append(
                        Row(
                            kernel,
                            0,
                            k,
                            m,
                            seconds * 1e6,
                            0.0,
                            moved / seconds / 1e9,
                            100 * moved / seconds / 1e9 / copy_gbps,
                            None,
                            None,
                            None,
                        )
                    )
                    print(
                        f"{kernel:>10} K={k:<6} M={m:<5} {seconds * 1e6:9.1f} us  "
                        f"{rows[-1].copy_bandwidth_pct:5.1f}% copy BW",
                        flush=True,
                    )
                    continue
                x_bf16 = x.to(torch.bfloat16)
                baseline = measure(lambda a=x_bf16, w=dense_weight: torch.matmul(a, w.T)) * 1e-3
                out = op(x)  # first call also autotunes, outside the timed region
                seconds = measure(lambda x=x, op=op: op(x)) * 1e-3
                moved = weight_bytes + m * k * x.element_size() + m * n * x.element_size()
                error = relative_error(out, x.double() @ dense.T)
                rows.append(
                    Row(
                        kernel,
                        n,
                        k,
                        m,
                        seconds * 1e6,
                        2 * m * n * k / seconds / 1e12,
                        moved / seconds / 1e9,
                        100 * moved / seconds / 1e9 / copy_gbps,
                        baseline * 1e6,
                        baseline / seconds,
                        error,
                    )
                )
                print(
                    f"{kernel:>10} N={n:<6} K={k:<6} M={m:<5} {seconds * 1e6:9.1f} us  "
                    f"x{baseline / seconds:5.2f} vs bf16  {rows[-1].copy_bandwidth_pct:5.1f}% copy BW",
                    flush=True,
                )
        del dense_weight
    rows += attention_rows(args, device, measure, copy_gbps)
    return rows, copy_gbps


def attention_rows(args: BenchOptions, device: torch.device, measure, copy_gbps: float) -> list[Row]:
    """Decode attention (one query per sequence) over ``args.context`` cached tokens per sequence, blocks
    scattered in the pool. Baseline: ``scaled_dot_product_attention`` in bf16 on a contiguous cache."""
    from compress.kernels.kv_cache import QUANT_MAX, quantize_reference
    from compress.kernels.paged_attention import paged_attention, paged_attention_reference

    heads, kv_heads, dim, block = (ATTENTION_SHAPE[k] for k in ("heads", "kv_heads", "head_dim", "block_size"))
    context = args.context
    rows: list[Row] = []
    for kernel in [k for k in args.kernels if k in ATTENTION]:
        cache_dtype = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kernel.rsplit("-")[-1]]
        for batch in args.rows:
            if batch > (4 if args.smoke else 256):
                continue  # 256 x 4k tokens is already 4 GiB of bf16 cache; the interpreter is slow
            blocks_per_seq = -(-context // block)
            pool = batch * blocks_per_seq
            keys = torch.randn(pool, block, kv_heads, dim, device=device, dtype=torch.bfloat16)
            values = torch.randn_like(keys)
            scales = None
            if cache_dtype in QUANT_MAX:  # per-head static scales, as the KV-cache stage calibrates them
                scales = torch.full((kv_heads,), 4.0 / QUANT_MAX[cache_dtype], device=device)
                k_cache = quantize_reference(keys, scales[:, None], cache_dtype)
                v_cache = quantize_reference(values, scales[:, None], cache_dtype)
            else:
                k_cache, v_cache = keys, values
            tables = torch.randperm(pool, device=device, dtype=torch.int32).reshape(batch, blocks_per_seq)
            lens = torch.full((batch,), context, device=device, dtype=torch.int32)
            starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
            q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
            args_ = (q, k_cache, v_cache, tables, lens, starts, 1, scales, scales)
            out = paged_attention(*args_)
            seconds = measure(lambda a=args_: paged_attention(*a)) * 1e-3
            error = None
            if batch <= 16:
                error = relative_error(out, paged_attention_reference(*args_))
            dense_k = keys[tables.long()].reshape(batch, -1, kv_heads, dim)[:, :context].transpose(1, 2)
            dense_v = values[tables.long()].reshape(batch, -1, kv_heads, dim)[:, :context].transpose(1, 2)
            sdpa_q = q[:, :, None, :]

            def sdpa(q=sdpa_q, k=dense_k, v=dense_v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            baseline = measure(sdpa) * 1e-3
            del dense_k, dense_v
            moved = 2 * batch * context * kv_heads * dim * k_cache.element_size() + 2 * q.numel() * q.element_size()
            rows.append(
                Row(
                    kernel,
                    heads,
                    context,
                    batch,
                    seconds * 1e6,
                    4 * batch * heads * context * dim / seconds / 1e12,
                    moved / seconds / 1e9,
                    100 * moved / seconds / 1e9 / copy_gbps,
                    baseline * 1e6,
                    baseline / seconds,
                    error,
                )
            )
            print(
                f"{kernel:>15} ctx={context:<6} batch={batch:<5} {seconds * 1e6:9.1f} us  x{baseline / seconds:5.2f} "
                f"vs SDPA bf16  {rows[-1].copy_bandwidth_pct:5.1f}% copy BW",
                flush=True,
            )
            del keys, values, k_cache, v_cache
    return rows


def judge_goals(rows: list[Row]) -> list[dict]:
    verdicts = []
    for description, kernel, wanted_rows, metric, threshold in GOALS:
        values = [getattr(row, metric) for row in rows if row.kernel == kernel and wanted_rows(row.m)]
        worst = min(values) if values else None
        verdicts.append(
            dict(goal=description, worst=worst, threshold=threshold, met=None if worst is None else worst >= threshold)
        )
    return verdicts


def markdown(meta: dict, rows: list[Row], goals: list[dict]) -> str:
    lines = [f"# Kernel benchmark: {meta['device_name']}", ""]
    if meta["smoke"]:
        lines += ["**Smoke run (tiny shapes): checks the script only; goals not judged.**", ""]
    lines += [
        f"torch {meta['torch']}, triton {meta['triton']}, activations {meta['dtype']}, W4A16 group size "
        f"{GROUP_SIZE} (symmetric). Device-to-device copy: **{meta['copy_gbps']:.0f} GB/s** (same run). "
        "Speedup = dense bf16 `torch.matmul` time / kernel time, same run. int8/fp8 include the dynamic "
        "per-token activation quantization; `-gemm` rows exclude it; `w4a16-disk` reads the on-disk layout.",
        "",
        "| goal | worst row | threshold | met |",
        "|---|---|---|---|",
    ]
    for goal in goals:
        worst = "-" if goal["worst"] is None else f"{goal['worst']:.2f}"
        met = "-" if goal["met"] is None else ("yes" if goal["met"] else "**no**")
        lines.append(f"| {goal['goal']} | {worst} | {goal['threshold']} | {met} |")
    lines += [
        "",
        "| kernel | N | K | M | time (us) | TFLOP/s | GB/s | % copy BW | torch bf16 (us) | speedup | rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        baseline = "-" if row.torch_bf16_us is None else f"{row.torch_bf16_us:.1f}"
        speedup = "-" if row.speedup is None else f"{row.speedup:.2f}x"
        error = "-" if row.relative_error is None else f"{row.relative_error:.1e}"
        lines.append(
            f"| {row.kernel} | {row.n or '-'} | {row.k} | {row.m} | {row.time_us:.1f} | {row.tflops:.1f} | "
            f"{row.gbps:.0f} | {row.copy_bandwidth_pct:.1f} | {baseline} | {speedup} | {error} |"
        )
    return "\n".join(lines) + "\n"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise ValueError("give N x K pairs like 4096x4096,4096x14336") from None


SYNOPSIS = "python -m compress bench kernels [smoke=true kernels=w4a16,... rows=1,16 shapes=4096x4096 ...]"


@dataclass
class BenchOptions:
    smoke: bool = False  # tiny shapes, any device: checks the script only
    shapes: list[tuple[int, int]] | None = field(default=None, metadata={"parse": parse_shapes})  # N x K pairs
    rows: list[int] | None = None  # M values
    kernels: list[str] = field(default_factory=lambda: KERNELS + ATTENTION)
    context: int | None = None  # cached tokens per sequence for attention (default 4096; smoke 64)
    dtype: Literal["bf16", "fp16"] = "bf16"  # activation dtype
    out: Path = Path("benchmarks/results")


def parse_args(argv: list[str]) -> BenchOptions:
    args, _ = parse_options(BenchOptions, argv, SYNOPSIS)
    unknown = sorted(set(args.kernels) - set(KERNELS) - set(ATTENTION))
    if unknown:
        raise CompressError(f"unknown kernels {unknown}; choose from {','.join(KERNELS + ATTENTION)}")
    args.shapes = args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)
    args.rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    args.context = args.context or (SMOKE_CONTEXT if args.smoke else 4096)
    return args


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(usage(BenchOptions, SYNOPSIS))
        return 0
    try:
        args = parse_args(argv)
    except CompressError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print(
            "error: the kernel benchmark needs a CUDA GPU and none is visible. GPU numbers are still missing; "
            "run it on an H100 with `python -m compress bench kernels`, or check the script on CPU with "
            "`smoke=true`.",
            file=sys.stderr,
        )
        return 2
    rows, copy_gbps = run(args, device)
    goals = [] if args.smoke else judge_goals(rows)  # tiny shapes say nothing about the goals
    meta = dict(
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        smoke=args.smoke,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=args.dtype,
        copy_gbps=copy_gbps,
        group_size=GROUP_SIZE,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernels-{device_slug(device, args.smoke)}"
    stem.with_suffix(".json").write_text(
        json.dumps(dict(meta=meta, goals=goals, rows=[asdict(row) for row in rows]), indent=2) + "\n"
    )
    stem.with_suffix(".md").write_text(markdown(meta, rows, goals))
    print(f"wrote {stem}.json and {stem}.md")
    for goal in goals:
        print(
            f"  {'MET ' if goal['met'] else 'MISS' if goal['met'] is False else '  - '} {goal['goal']}: "
            f"worst {goal['worst'] if goal['worst'] is None else round(goal['worst'], 2)}"
        )
    return 0
