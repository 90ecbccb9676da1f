"""Calibration sampling speed: two sampling paths against each other, in one run.

    OMP_NUM_THREADS=2 python benchmarks/sampling_speed.py                  # 16 windows x 128 tokens, loop vs engine
    python benchmarks/sampling_speed.py --windows 16 --seq-len 512 --device cuda
    # the loop as a CPU run samples 32 windows against the loop before (two batches of 16 over transformers' cache)
    OMP_NUM_THREADS=2 python benchmarks/sampling_speed.py --windows 32 --seq-len 512 --paths loop-batches loop \
        --out benchmarks/results/loop-cache

Paths: ``loop`` (a KV-cached transformers forward per token over ``compress.model.decode_cache``, every window of the
run decoded together: what a CPU run does for up to ``DECODE_BATCHES`` batches), ``loop-dynamic`` (the same over
transformers' ``DynamicCache``, which copies the cache every step), ``loop-batches`` (one ``SAMPLING_BATCH`` after
another over ``DynamicCache``: the loop before 2026-11-30), ``engine`` (our engine's batched decode over the paged KV
cache).

Both paths sample what ``compress.model.calibration_set`` samples for ``data.generated`` (temperature 1 from the model's
start token, ``SAMPLING_BATCH`` windows together) from the default model
(``compress.model.sources.default_model_dir()``,
fp32, loaded whole), back to back on the same machine in the order A, B, B, A of ``--paths A B`` (a drift in the
machine's load over the run weighs on both paths alike; the gap between rows of one path shows its size), and checks
that both drew the same windows where they must (the two loops). Results: ``--out`` ``.{json,md}``, by default
``benchmarks/results/sampling-speed``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.base.data import window_start_token  # noqa: E402
from compress.model.calibration_set import _sample, _sample_engine, on_device, seeded_batches, start_token  # noqa: E402
from compress.model.sources import default_model_dir, load  # noqa: E402


def _batch_after_batch(model, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    """The loop before 2026-11-30: each batch alone, over transformers' growing cache."""
    batches = seeded_batches(count, seed)
    return torch.cat([_sample(model, size, seq_len, first, start, preallocate=False) for size, first in batches])


SAMPLERS = {
    "loop": _sample,
    "loop-dynamic": partial(_sample, preallocate=False),
    "loop-batches": _batch_after_batch,
    "engine": _sample_engine,
}
SAME_WINDOWS = {"loop", "loop-dynamic", "loop-batches"}  # one generator per batch: their windows must be identical


def measure(model, path: str, windows: int, seq_len: int, seed: int, start: int) -> dict:
    began = time.perf_counter()
    ids = SAMPLERS[path](model, windows, seq_len, seed, start)
    seconds = time.perf_counter() - began
    tokens = windows * (seq_len - 1)
    return {
        "path": path,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "shape": list(ids.shape),
        "ids": ids,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Calibration sampling speed: {report['paths'][0]} vs {report['paths'][1]}",
        "",
        f"Model `{report['model']}` (fp32), {report['windows']} windows x {report['seq_len']} tokens per row "
        f"(sampled from the start token at temperature 1, as `data.generated` samples them), device "
        f"`{report['device']}`, {report['threads']} torch threads. {report['machine']}; run {report['date']}; "
        f"load average before / after: {report['load_before']} / {report['load_after']}. Rows measured back to back "
        "in this order.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| path | tokens | seconds | tokens/s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['path']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} |" for r in report["rows"]]
    lines += [
        "",
        f"{report['paths'][1]} / {report['paths'][0]} (all tokens of a path over all its seconds): "
        f"**{report['ratio']:.2f}x** tokens/s.{report['same_windows']}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs=2, choices=sorted(SAMPLERS), default=["loop", "engine"], metavar="PATH")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sampling-speed")
    args = parser.parse_args()
    folder = default_model_dir()
    model, _ = load(str(folder), lazy=False)
    start = start_token(model, window_start_token(model.config))
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    with on_device(model, args.device):
        for path in (*args.paths, *reversed(args.paths)):
            rows.append(measure(model, path, args.windows, args.seq_len, args.seed, start))
            print(f"{path}: {rows[-1]['tokens_per_s']:.1f} tokens/s ({rows[-1]['seconds']:.1f} s)", flush=True)
    rate = {
        path: sum(r["tokens"] for r in rows if r["path"] == path) / sum(r["seconds"] for r in rows if r["path"] == path)
        for path in args.paths
    }
    same_windows = ""
    if set(args.paths) <= SAME_WINDOWS:
        identical = all(torch.equal(rows[0]["ids"], row["ids"]) for row in rows)
        if not identical:
            raise SystemExit(f"{' and '.join(args.paths)} sampled different windows: they must draw the same ones")
        same_windows = " Both paths sampled identical windows (checked token by token)."
    for row in rows:
        del row["ids"]
    report = {
        "model": folder.name,
        "windows": args.windows,
        "seq_len": args.seq_len,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before,
        "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "command": " ".join(
            [f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"] * ("OMP_NUM_THREADS" in os.environ)
            + ["python", "benchmarks/sampling_speed.py", *sys.argv[1:]]
        ),
        "paths": args.paths,
        "rows": rows,
        "ratio": rate[args.paths[1]] / rate[args.paths[0]],
        "same_windows": same_windows,
    }
    print(f"{args.paths[1]} / {args.paths[0]}: {report['ratio']:.2f}x{same_windows}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))


if __name__ == "__main__":
    main()
