"""``python -m compress bench peers``: our quantized GEMMs against the peers an H100 user would reach for, in one
run, every implementation timed the same way (CUDA-graph replays, L2 flushed: ``compress.kernels.timing``).

Per format, on the same random weight (``benchmarks.bench_kernels.quantized_weight``):

* ``w4a16`` (symmetric int4, group 128): ours; torch's tinygemm (``aten._convert_weight_to_int4pack`` +
  ``aten._weight_int4pack_mm``); gemlite ``A16W4_HQQ_INT``.
* ``int8`` (per-channel weight, dynamic per-token activations): ours with and without (``-gemm``) the activation
  quantization; ``torch._int_mm`` with the plain-torch per-token quantization and scale epilogue, and without the
  quantization (``-gemm``); gemlite ``A8W8_INT8_dynamic``.
* ``fp8`` (e4m3, same scales): ours, ours ``-gemm``; ``torch._scaled_mm`` with row-wise scales after the plain-torch
  quantization, and without it; gemlite ``A8W8_FP8_dynamic``.
* ``fp8_block`` (e4m3, one scale per 128x128 weight block, activations per token and group of 128: ``FP8_BLOCK``):
  ours, ours ``-gemm``; ``torch._scaled_mm`` with its block-wise scaling (1x128 activation scales, outer-dim-major,
  and 128x128 weight scales; CUDA 12.9+ on Hopper) after the plain-torch group quantization, and without it. Where
  a torch build lacks block-wise scaling, its cells say why.

Every row also has ``torch.matmul`` on the bf16 dequantized weight and the float64 relative error against the
quantized weight (a peer wired up wrongly shows as ``WRONG``). Prints each time, its ratio to bf16 and, for ours,
the best peer's time over ours; writes ``benchmarks/results/kernel-peers-<device>.{json,md}``.
gemlite (pure Python + Triton) is optional: when it does not import its columns say why (``fetch_gemlite.sh`` carries
it to a GPU box). Needs a CUDA GPU; ``--smoke`` runs tiny shapes on the CPU, with torch's CPU variants of the peers.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import triton
import triton.testing

from benchmarks.bench_kernels import (
    GROUP_SIZE,
    QuantizedWeight,
    device_slug,
    our_op,
    parse_shapes,
    quantized_once,
    quantized_weight,
    timer,
)
from compress.base.errors import CompressError
from compress.commands.args import parse_options, usage, wants_help
from compress.kernels.accuracy import relative_error
from compress.kernels.fp8_block import quantize_per_token_group_reference
from compress.kernels.timing import NotCapturable, graph_time_ms
from compress.kernels.w8a8 import quantize_per_token_reference

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # weight [N, K]
ROWS = [1, 16, 128, 1024, 4096]
SMOKE_SHAPES = [(64, 256)]
SMOKE_ROWS = [1, 17]
FORMATS = ("w4a16", "int8", "fp8", "fp8_block")
TINYGEMM_INNER_K_TILES = 8
# Above these errors against the float64 product an implementation is computing something else (see bench_kernels).
WRONG_ABOVE = {"w4a16": 2e-2, "int8": 4e-2, "fp8": 1e-1, "fp8_block": 1e-1}
BASELINE = "torch.matmul"  # on the dequantized weight in the activation dtype (bf16 by default)

Op = Callable[[torch.Tensor], torch.Tensor]


class Unavailable(Exception):
    """A peer that cannot run here (not installed, no kernel for this device); the message says why."""


@dataclass
class Row:
    format: str
    impl: str
    n: int
    k: int
    m: int
    time_us: float | None
    vs_bf16: float | None  # bf16 time / this time: > 1 is faster than dense bf16
    relative_error: float | None
    note: str = ""


def tinygemm_op(weight: QuantizedWeight, dtype: torch.dtype) -> Op:
    """torch's int4 kernel: ``w = (u - 8) * scale + zero`` with ``u = code + 8`` and zero 0 (symmetric codes)."""
    unsigned = weight.values.to(torch.int32) + 8
    scale = weight.scale.to(dtype)
    scale_and_zero = torch.stack([scale, torch.zeros_like(scale)], dim=2).transpose(0, 1).contiguous()
    if unsigned.is_cuda:  # CUDA takes two codes per byte, even column in the high nibble
        nibbles = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, TINYGEMM_INNER_K_TILES)
        matmul = torch.ops.aten._weight_int4pack_mm
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, TINYGEMM_INNER_K_TILES)
        matmul = torch.ops.aten._weight_int4pack_mm_for_cpu
    return lambda x: matmul(x, packed, GROUP_SIZE, scale_and_zero)


def torch_w8a8_op(weight: QuantizedWeight, quantize_activations: bool) -> Op:
    """``torch._int_mm`` (int8, scales applied after) or ``torch._scaled_mm`` (FP8, row-wise scales fused), fed by
    the plain-torch per-token quantization; without it, the activations are quantized once outside the timing."""
    w_t, w_scale = weight.values.t(), weight.scale.float()

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_token_reference(x, weight.values.dtype)

    quantized = quantize if quantize_activations else quantized_once(quantize)

    if weight.values.dtype == torch.int8:

        def op(x):
            codes, a_scale = quantized(x)
            return (torch._int_mm(codes, w_t).float() * a_scale * w_scale.T).to(x.dtype)
    else:

        def op(x):
            codes, a_scale = quantized(x)
            return torch._scaled_mm(codes, w_t, scale_a=a_scale, scale_b=w_scale.T, out_dtype=x.dtype)

    return op


def torch_fp8_block_op(weight: QuantizedWeight, quantize_activations: bool) -> Op:
    """``torch._scaled_mm`` with block-wise scales: ``a [M, K]`` row-major with ``[M, K/128]`` scales laid out
    outer-dim-major, ``b = w.T`` (column-major) with ``[K/128, N/128]`` scales; fed by the plain-torch per-token-group
    quantization, or (``quantize_activations=False``) with the activations quantized once outside the timing."""
    w_t, w_scale = weight.values.t(), weight.scale.float().t()

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = quantize_per_token_group_reference(x)
        return codes, scale.t().contiguous().t()  # outer-dim-major, as the block-wise kernel reads it

    quantized = quantize if quantize_activations else quantized_once(quantize)

    def op(x):
        codes, a_scale = quantized(x)
        return torch._scaled_mm(codes, w_t, scale_a=a_scale, scale_b=w_scale, out_dtype=x.dtype)

    return op


def gemlite_op(fmt: str, weight: QuantizedWeight, dtype: torch.dtype) -> Op:
    """gemlite's layer for ``fmt`` built from the same codes and scales (its bundled H100 tile cache loads on
    import, so no autotuning happens inside the timed runs)."""
    if not weight.values.is_cuda:
        raise Unavailable("gemlite needs CUDA")
    try:
        from gemlite import helper
    except Exception as error:  # not installed, or a version whose import fails here
        raise Unavailable(f"gemlite does not import ({type(error).__name__}: {error}); see fetch_gemlite.sh") from None
    device = weight.values.device
    if fmt == "w4a16":  # HQQ layout: (u - zero) * scale with u = code + 8
        unsigned = (weight.values.to(torch.int16) + 8).to(torch.uint8)
        zeros = torch.full_like(weight.scale, 8, dtype=dtype)
        layer = helper.A16W4_HQQ_INT(device=device, dtype=dtype).from_weights(unsigned, weight.scale.to(dtype), zeros)
    else:
        build = helper.A8W8_INT8_dynamic if fmt == "int8" else helper.A8W8_FP8_dynamic
        layer = build(device=device, dtype=dtype).from_weights(weight.values, scales=weight.scale.float())
    return lambda x: layer(x)


def implementations(fmt: str) -> dict[str, Callable[[QuantizedWeight, torch.dtype], Op]]:
    """Name -> builder for every implementation of ``fmt``; names starting with ``ours`` are ours."""
    if fmt == "w4a16":
        return {
            "ours": lambda w, d: our_op("w4a16", w),
            "tinygemm": tinygemm_op,
            "gemlite": lambda w, d: gemlite_op(fmt, w, d),
        }
    if fmt == "fp8_block":  # gemlite has no block-scaled FP8 format
        return {
            "ours": lambda w, d: our_op(fmt, w),
            "ours-gemm": lambda w, d: our_op(f"{fmt}-gemm", w),
            "torch._scaled_mm": lambda w, d: torch_fp8_block_op(w, quantize_activations=True),
            "torch._scaled_mm-gemm": lambda w, d: torch_fp8_block_op(w, quantize_activations=False),
        }
    torch_name = "torch._int_mm" if fmt == "int8" else "torch._scaled_mm"
    return {
        "ours": lambda w, d: our_op(fmt, w),
        "ours-gemm": lambda w, d: our_op(f"{fmt}-gemm", w),
        torch_name: lambda w, d: torch_w8a8_op(w, quantize_activations=True),
        f"{torch_name}-gemm": lambda w, d: torch_w8a8_op(w, quantize_activations=False),
        "gemlite": lambda w, d: gemlite_op(fmt, w, d),
    }


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def run(args: BenchOptions, device: torch.device) -> list[Row]:
    measure = partial(graph_time_ms, eager_fallback=False) if device.type == "cuda" else timer(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows: list[Row] = []
    for n, k in args.shapes:
        for fmt in args.formats:
            weight = quantized_weight(fmt, n, k, device, dtype)
            dense = weight.dense.to(dtype)
            ops: dict[str, Op | str] = {}
            for name, build in implementations(fmt).items():
                try:
                    ops[name] = build(weight, dtype)
                except Exception as error:  # a peer that cannot be built here: its column says why
                    ops[name] = error.args[0] if isinstance(error, Unavailable) else first_line(error)
            for m in args.rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                expected = x.double() @ weight.dense.T
                baseline = measure(lambda x=x, w=dense: torch.matmul(x, w.T)) * 1e3
                rows.append(Row(fmt, BASELINE, n, k, m, baseline, 1.0, relative_error(x @ dense.T, expected)))
                for name, op in ops.items():
                    rows.append(timed_row(fmt, name, n, k, x, op, expected, baseline, measure))
                    report(rows[-1])
            del weight, dense, ops
    return rows


def timed_row(fmt, name, n, k, x, op, expected, baseline_us, measure) -> Row:
    """One implementation at one M: first call outside the timing (compiles, autotunes), then the timed replays."""
    m = x.shape[0]
    if isinstance(op, str):
        return Row(fmt, name, n, k, m, None, None, None, op)
    note = ""
    try:
        error = relative_error(op(x), expected)
        try:
            microseconds = measure(lambda: op(x)) * 1e3
        except NotCapturable:  # still a number, but not the same method: the cell says so
            microseconds = triton.testing.do_bench(lambda: op(x), return_mode="median") * 1e3
            note = "timed eagerly: not capturable in a CUDA graph"
    except Exception as failure:  # e.g. a shape the peer's kernel refuses (torch._int_mm and small M)
        return Row(fmt, name, n, k, m, None, None, None, first_line(failure))
    if error > WRONG_ABOVE[fmt]:
        note = f"WRONG: error {error:.1e}"
    return Row(fmt, name, n, k, m, microseconds, baseline_us / microseconds, error, note)


def report(row: Row) -> None:
    if row.time_us is None:
        print(f"{row.format:>5} {row.impl:<22} N={row.n:<6} K={row.k:<6} M={row.m:<5} n/a: {row.note}", flush=True)
    else:
        print(
            f"{row.format:>5} {row.impl:<22} N={row.n:<6} K={row.k:<6} M={row.m:<5} {row.time_us:9.1f} us  "
            f"x{row.vs_bf16:5.2f} vs bf16 {row.note}",
            flush=True,
        )


def best_peer_ratios(rows: list[Row]) -> dict[tuple[str, int, int, int], dict]:
    """Per (format, N, K, M): the fastest peer (neither ours nor the bf16 baseline) and, for each of our
    implementations, that peer's time over ours (> 1: ours is faster)."""
    groups: dict[tuple[str, int, int, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.format, row.n, row.k, row.m), []).append(row)
    summary = {}
    for key, group in groups.items():
        peers = [
            r
            for r in group
            if r.time_us is not None
            and not r.impl.startswith("ours")
            and r.impl != BASELINE
            and not r.note.startswith("WRONG")
        ]
        best = min(peers, key=lambda r: r.time_us, default=None)
        summary[key] = dict(
            best_peer=None if best is None else best.impl,
            best_peer_us=None if best is None else best.time_us,
            ours_vs_best_peer={
                r.impl: None if best is None or r.time_us is None else best.time_us / r.time_us
                for r in group
                if r.impl.startswith("ours")
            },
        )
    return summary


def markdown(meta: dict, rows: list[Row], summary: dict) -> str:
    lines = [f"# Quantized GEMMs against peers: {meta['device_name']}", ""]
    if meta["smoke"]:
        lines += ["**Smoke run (tiny shapes, CPU variants of the peers, wall clock): checks the script only.**", ""]
    lines += [
        f"torch {meta['torch']}, triton {meta['triton']}, gemlite {meta['gemlite']}, activations {meta['dtype']}. "
        "Every implementation timed the same way in the same run (median of CUDA-graph replays, L2 flushed). "
        "Cells: time in us and speedup over `torch.matmul` on the bf16 weight; `ours/best` is the fastest peer's "
        "time over ours (> 1: ours faster). Rows ending in `-gemm` exclude the per-token activation quantization; "
        "the others include it (torch peers: the plain-torch quantization, as a torch user would write it).",
        "",
    ]
    for fmt in meta["formats"]:
        names = list(dict.fromkeys(r.impl for r in rows if r.format == fmt))
        ours = [name for name in names if name.startswith("ours")]
        lines += [
            f"## {fmt}",
            "",
            "| N | K | M | "
            + " | ".join(names)
            + " | best peer | "
            + " | ".join(f"{name}/best" for name in ours)
            + " |",
            "|" + "---|" * (4 + len(names) + len(ours)),
        ]
        for (row_fmt, n, k, m), entry in summary.items():
            if row_fmt != fmt:
                continue
            by_name = {r.impl: r for r in rows if (r.format, r.n, r.k, r.m) == (fmt, n, k, m)}
            cells = [cell(by_name.get(name)) for name in names]
            ratios = [
                "-" if entry["ours_vs_best_peer"].get(name) is None else f"{entry['ours_vs_best_peer'][name]:.2f}"
                for name in ours
            ]
            lines.append(
                f"| {n} | {k} | {m} | "
                + " | ".join(cells)
                + f" | {entry['best_peer'] or '-'} | "
                + " | ".join(ratios)
                + " |"
            )
        lines.append("")
    notes = sorted({f"{r.impl}: {r.note}" for r in rows if r.note})
    if notes:
        lines += ["Notes (n/a cells and flagged results):", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(lines)


def cell(row: Row | None) -> str:
    if row is None or row.time_us is None:
        return "n/a"
    flag = " WRONG" if row.note.startswith("WRONG") else ""
    return f"{row.time_us:.1f} ({row.vs_bf16:.2f}x){flag}"


def gemlite_version() -> str:
    try:
        from importlib.metadata import version

        return version("gemlite")
    except Exception:  # not installed (or carried as a bare source tree)
        return "absent"


SYNOPSIS = "python -m compress bench peers [smoke=true formats=w4a16,... rows=1,16 shapes=4096x4096 ...]"


@dataclass
class BenchOptions:
    smoke: bool = False  # tiny shapes on the CPU: checks the script only
    shapes: list[tuple[int, int]] | None = field(default=None, metadata={"parse": parse_shapes})  # N x K pairs
    rows: list[int] | None = None  # M values
    formats: list[str] = field(default_factory=lambda: list(FORMATS))
    dtype: Literal["bf16", "fp16"] = "bf16"  # activation dtype
    out: Path = Path("benchmarks/results")


def parse_args(argv: list[str]) -> BenchOptions:
    args, _ = parse_options(BenchOptions, argv, SYNOPSIS)
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        raise CompressError(f"unknown formats {unknown}; choose from {','.join(FORMATS)}")
    args.shapes = args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)
    args.rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
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
            "error: the peer benchmark needs a CUDA GPU and none is visible, so its GPU numbers are still missing; "
            "run `bash benchmarks/gpu_session.sh peers` on a GPU box, or check the script here with smoke=true.",
            file=sys.stderr,
        )
        return 2
    rows = run(args, device)
    summary = best_peer_ratios(rows)
    meta = dict(
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        smoke=args.smoke,
        torch=torch.__version__,
        triton=triton.__version__,
        gemlite=gemlite_version(),
        dtype=args.dtype,
        formats=args.formats,
        group_size=GROUP_SIZE,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernel-peers-{device_slug(device, args.smoke)}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            dict(
                meta=meta,
                rows=[asdict(row) for row in rows],
                best_peer=[dict(format=f, n=n, k=k, m=m, **entry) for (f, n, k, m), entry in summary.items()],
            ),
            indent=2,
        )
        + "\n"
    )
    stem.with_suffix(".md").write_text(markdown(meta, rows, summary))
    for (fmt, n, k, m), entry in summary.items():
        ratios = ", ".join(
            f"{name} {'-' if ratio is None else f'{ratio:.2f}'}" for name, ratio in entry["ours_vs_best_peer"].items()
        )
        print(f"{fmt:>5} N={n:<6} K={k:<6} M={m:<5} best peer {entry['best_peer'] or '-'}, its time / ours: {ratios}")
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
