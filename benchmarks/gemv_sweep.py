"""Sweep the W4A16 decode (gemv) kernel's tiles on a GPU and say where its time goes.

``python -m benchmarks.gemv_sweep [--shapes 14336x4096,...] [--rows 1,4] [--before MODULE] [--out DIR]``

Per weight shape ``[N, K]`` (symmetric int4, group 128, bf16 activations, the N-contiguous words the engine keeps)
and row count M, every tile of a grid is timed from CUDA-graph replays (``compress.kernels.timing``, L2 flushed),
its output checked against the float64 product, and set beside, in the same run:

* a device-to-device copy (the bandwidth ceiling) and ``torch.matmul`` on the bf16 weight;
* torch's tinygemm int4 kernel, the peer to beat at M=1;
* a load-only probe with the same tiling (reads every word, adds them, one store per column and split, no memset):
  the memory side's ceiling for that tile. Near the gemv's time, the tile's loads are the limit; far under it,
  the arithmetic or the split-K epilogue is;
* with ``--before MODULE`` (a copy of ``kernels/w4a16_kernels.py`` from another commit), that module's gemv on the
  best tiles: an A/B of two kernel versions on one card in one run.

Writes ``gemv-sweep-<device>.{json,md}`` to ``--out`` and prints the best tiles last. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.bench_kernels import GROUP_SIZE, copy_bandwidth_gbps, device_slug, parse_shapes, quantized_weight
from benchmarks.kernel_peers import tinygemm_op
from compress.kernels import w4a16
from compress.kernels.accuracy import relative_error
from compress.kernels.configs import W4A16_SKINNY
from compress.kernels.packing import pack_int32
from compress.kernels.timing import graph_time_ms

WRONG_ABOVE = 2e-2  # relative error against the float64 product above which a tile computes something else
BLOCKS_N = (32, 64, 128, 256)
BLOCKS_K = (128, 256, 512)
WARPS = (2, 4, 8)
SPLITS = (1, 2, 4, 8, 16)
WORDS_PER_THREAD = (4, 32)  # fewer starves the loads, more spills registers


def tile_grid(k: int) -> list[dict]:
    """Every gemv tile of the grid that gives each thread 4..32 words and each split at least one K tile, then the
    table's own gemv entries (so the sweep also times what the autotuner chooses from)."""
    tiles = []
    for block_n, block_k, warps, split in itertools.product(BLOCKS_N, BLOCKS_K, WARPS, SPLITS):
        words = block_n * block_k // 8 // (32 * warps)
        if WORDS_PER_THREAD[0] <= words <= WORDS_PER_THREAD[1] and split <= -(-k // block_k):
            tiles.append(
                dict(KIND="gemv", BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps, num_stages=1)
            )
    for entry in W4A16_SKINNY["hopper"]:
        if entry.get("KIND") == "gemv" and entry not in tiles:
            tiles.append(dict(entry))
    return tiles


def fastest(entry: dict) -> list[dict]:
    """The timed tiles of one (shape, M) that compute the right product, fastest first."""
    right = (r for r in entry["tiles"] if "us" in r and r["relative_error"] < WRONG_ABOVE)
    return sorted(right, key=lambda r: r["us"])


def label(tile: dict) -> str:
    return f"n{tile['BLOCK_N']} k{tile['BLOCK_K']} s{tile['SPLIT_K']} w{tile['num_warps']} st{tile['num_stages']}"


@triton.jit
def load_probe_kernel(
    packed_ptr, out_ptr, N, K, stride_pk, stride_pn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr
):
    """The gemv's loads and nothing else: program (n-block, split) adds its words, one store per column."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first_tile = pid_k * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, k_tiles)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.int32)
    for tile in range(first_tile, last_tile):
        rows = tile * WORDS + offs_w
        mask = (rows * 8 < K)[:, None] & (offs_n < N)[None, :]
        acc += tl.load(
            packed_ptr + rows[:, None] * stride_pk + offs_n[None, :] * stride_pn,
            mask=mask,
            other=0,
            eviction_policy="evict_first",
        )
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, axis=0), mask=offs_n < N)


def probe(packed_kn: torch.Tensor, k: int, tile: dict):
    n = packed_kn.shape[1]
    out = torch.empty(tile["SPLIT_K"], n, device=packed_kn.device, dtype=torch.int32)
    grid = (triton.cdiv(n, tile["BLOCK_N"]), tile["SPLIT_K"])

    def launch():
        load_probe_kernel[grid](
            packed_kn,
            out,
            n,
            k,
            packed_kn.stride(0),
            packed_kn.stride(1),
            BLOCK_N=tile["BLOCK_N"],
            BLOCK_K=tile["BLOCK_K"],
            SPLIT_K=tile["SPLIT_K"],
            num_warps=tile["num_warps"],
            num_stages=tile["num_stages"],
        )
        return out

    return launch


def sweep_shape(n: int, k: int, rows: list[int], before, device, deadline: float) -> dict:
    dtype = torch.bfloat16
    weight = quantized_weight("w4a16", n, k, device, dtype)
    packed_kn = w4a16.repack_n_contiguous(pack_int32(weight.values, 4))
    scale = weight.scale.t().contiguous().t()  # N-contiguous, as QuantizedLinear keeps it
    dense = weight.dense.to(dtype)
    tinygemm = tinygemm_op(weight, dtype)
    moved = packed_kn.numel() * 4 + scale.numel() * scale.element_size()
    result = {"n": n, "k": k, "weight_bytes": moved, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=dtype)
        truth = x.double() @ weight.dense.T

        def ours(tile, x=x):
            return w4a16.weight_only_matmul(x, packed_kn, scale, None, 4, GROUP_SIZE, config=tile)

        entry = {
            "bf16_us": 1e3 * graph_time_ms(lambda x=x: x @ dense.T, warmup=10, rep=40),
            "tinygemm_us": 1e3 * graph_time_ms(lambda x=x: tinygemm(x), warmup=10, rep=40),
            "tiles": [],
        }
        for tile in tile_grid(k):
            if time.monotonic() > deadline:
                entry["cut_short"] = True
                break
            record = {"tile": tile, "label": label(tile)}
            try:
                error = relative_error(ours(tile).double(), truth)
                record["relative_error"] = error
                record["us"] = 1e3 * graph_time_ms(lambda t=tile: ours(t), warmup=5, rep=25)
            except Exception as failure:  # a tile that does not compile or fit: say so and go on
                record["error"] = f"{type(failure).__name__}: {str(failure)[:120]}"
            entry["tiles"].append(record)
        timed = fastest(entry)
        for record in timed[:4]:  # where the time goes on the best tiles: loads alone, and the kernel before
            tile = record["tile"]
            record["load_probe_us"] = 1e3 * graph_time_ms(probe(packed_kn, k, tile), warmup=5, rep=25)
            if before is not None:
                swapped, w4a16.gemv_kernel = w4a16.gemv_kernel, before.gemv_kernel
                try:
                    record["before_us"] = 1e3 * graph_time_ms(lambda t=tile: ours(t), warmup=5, rep=25)
                finally:
                    w4a16.gemv_kernel = swapped
        entry["best"] = [r["label"] for r in timed[:8]]
        result["rows"][str(m)] = entry
    return result


def markdown(meta: dict, shapes: list[dict]) -> str:
    lines = [
        f"# W4A16 gemv tile sweep: {meta['device']}",
        "",
        f"`{meta['command']}` ({meta['date']}; torch {meta['torch']}, triton {meta['triton']}). Symmetric int4, group "
        f"{GROUP_SIZE}, bf16 activations, N-contiguous words. Copy ceiling in the same run: **{meta['copy_gbps']:.0f} "
        "GB/s** (bytes read + written). Times are medians of CUDA-graph replays with L2 flushed. `probe`: the same "
        "tile's loads alone; `before`: the kernel of `--before` on the same tile.",
        "",
        "| N x K | M | tile | us | % copy BW | probe us | before us | bf16 us | tinygemm us | vs bf16 | vs tinygemm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in shapes:
        for m, entry in shape["rows"].items():
            for record in fastest(entry)[:4]:
                share = 100 * shape["weight_bytes"] / (record["us"] * 1e-6) / 1e9 / meta["copy_gbps"]
                lines.append(
                    f"| {shape['n']}x{shape['k']} | {m} | {record['label']} | {record['us']:.1f} | {share:.0f} | "
                    f"{record.get('load_probe_us', float('nan')):.1f} | {record.get('before_us', float('nan')):.1f} | "
                    f"{entry['bf16_us']:.1f} | {entry['tinygemm_us']:.1f} | x{entry['bf16_us'] / record['us']:.2f} | "
                    f"x{entry['tinygemm_us'] / record['us']:.2f} |"
                )
    wrong = [
        (s["n"], s["k"], m, r["label"])
        for s in shapes
        for m, e in s["rows"].items()
        for r in e["tiles"]
        if r.get("relative_error", 0) >= WRONG_ABOVE
    ]
    lines += ["", f"Tiles above {WRONG_ABOVE} relative error (wrong): {wrong or 'none'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="14336x4096,4096x4096,4096x14336")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--before", default="", help="module holding another version's gemv_kernel")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop adding tiles after this many seconds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_sweep needs a CUDA GPU")
    device = torch.device("cuda")
    before = importlib.import_module(args.before) if args.before else None
    meta = {
        "device": torch.cuda.get_device_name(device),
        "command": " ".join(["python -m benchmarks.gemv_sweep", *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy_bandwidth_gbps(device, None, 1 << 30),
    }
    rows = [int(m) for m in args.rows.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gemv-sweep-{device_slug(device, False)}"
    shapes, wanted, start = [], parse_shapes(args.shapes), time.monotonic()
    for index, (n, k) in enumerate(wanted):  # each shape gets its share of the budget
        deadline = start + args.budget_s * (index + 1) / len(wanted)
        shapes.append(sweep_shape(n, k, rows, before, device, deadline))
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "shapes": shapes}, indent=1))
        stem.with_suffix(".md").write_text(markdown(meta, shapes))
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
