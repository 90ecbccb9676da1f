"""The headline's quality against its calibration size: `awq_int4` (the `make run` recipe) on the default model with
sampled calibration sets of several shapes, three calibration draws each, scored out of domain as the run scores it.

    OMP_NUM_THREADS=1 python -m benchmarks.headline_tradeoff 32x512 --seeds 0 2 32
    python -m benchmarks.headline_tradeoff 32x512 --seeds 0 2 32 --overrides stages.0.grid=10 --label grid10

Why: `make run` must finish in minutes on a 2-core CPU, and most of its time is sampling the calibration windows and
the layer walk over them (both grow with the calibration tokens); this measures what fewer tokens cost in quality.
Each draw samples ``N`` windows of ``L`` tokens from the model at temperature 1 (``compress.model.calibration_set``, the
run's path, cached under ``artifacts/calibration``), compresses the default model with ``awq_int4`` on exactly those
ids through ``compress.oneshot`` (with ``--overrides``), reloads the checkpoint and scores it on the run's
out-of-domain headline text (Shakespeare, 512-token windows, ``benchmarks/quality.py``'s protocol). Draws must share
no sampled batch (checked): seed ``s`` samples the batches seeded ``s, s + 16, ...``, so 32 windows at seeds 0 and 32
are the two halves of 64 windows at seed 0. Each draw is kept in ``artifacts/benchmarks/headline-tradeoff`` as it
finishes (several processes may share the work: a draw already there is not run again); the report joins every draw
of the settings asked for: mean ratio, a 95% t-interval over the draws, and the CPU seconds of each phase
(``time.process_time``: comparable on a shared machine, unlike wall time). Torch's thread count is pinned
(``--threads``, recorded): it alone moves this recipe's ratio by about 2 points (docs/results.md).
Writes ``benchmarks/results/headline-tradeoff.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from compress.base.staging import write_file_atomically

ROOT = Path(__file__).resolve().parents[1]


def parse_setting(text: str) -> tuple[int, int]:
    """``"32x512"`` → ``(32, 512)``: windows × tokens per window."""
    try:
        count, length = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"setting {text!r}: expected WINDOWSxTOKENS, e.g. 32x512") from None
    if count < 1 or length < 2:
        raise SystemExit(f"setting {text!r}: need at least 1 window of at least 2 tokens")
    return count, length


def check_independent(seeds: list[int], count: int) -> None:
    """Draws must share no sampled batch: seed ``s`` samples the batches seeded ``s, s + B, s + 2B, ...`` (``B`` =
    ``SAMPLING_BATCH``), so 32 windows at seeds 0 and 32 are two disjoint halves of 64 windows at seed 0."""
    from compress.model.calibration_set import seeded_batches

    batches = [{batch_seed for _, batch_seed in seeded_batches(count, seed)} for seed in seeds]
    for i, first in enumerate(batches):
        for j in range(i + 1, len(batches)):
            if first & batches[j]:
                raise SystemExit(f"--seeds {seeds[i]} and {seeds[j]} share sampled batches at {count} windows")


def interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: a 95% t-interval over independent draws (a single draw: its value, no interval)."""
    from evals.gate.stats import mean_interval

    found = mean_interval(values)
    if len(values) < 2:
        return found.estimate, math.nan, math.nan
    return found.estimate, found.low, found.high


def baseline(work: Path, model, ids: torch.Tensor) -> dict:
    """The fp32 model's out-of-domain score, measured once per work folder."""
    from benchmarks.quality import score

    path = work / "baseline.json"
    if path.is_file():
        return json.loads(path.read_text())
    began = time.process_time()
    result = score(model, {"out_of_domain": ids}, None)["out_of_domain"]
    result["cpu_s"] = time.process_time() - began
    path.write_text(json.dumps(result, indent=1))
    return result


def draw(model_dir: Path, model, ids: torch.Tensor, count: int, length: int, seed: int, overrides: list[str]) -> dict:
    """One calibration draw: sample (or read the cache), compress, reload, score."""
    from benchmarks.quality import score
    from compress import oneshot
    from compress.base.data import window_start_token
    from compress.checkpoint import load_checkpoint
    from compress.model.calibration_set import sampled_windows, start_token

    began = (time.process_time(), time.perf_counter())
    samples = sampled_windows(model, count, length, seed, start_token(model, window_start_token(model.config)), "cpu")
    sample_cpu, sample_wall = time.process_time() - began[0], time.perf_counter() - began[1]
    with tempfile.TemporaryDirectory() as scratch:
        began = (time.process_time(), time.perf_counter())
        checkpoint = oneshot(model_dir, "awq_int4", data=samples, output_dir=Path(scratch) / "ckpt",
                             overrides=[f"seed={seed}", *overrides])  # fmt: skip
        compress_cpu, compress_wall = time.process_time() - began[0], time.perf_counter() - began[1]
        began = time.process_time()
        quantized, _ = load_checkpoint(checkpoint)
        scored = score(quantized, {"out_of_domain": ids}, None)["out_of_domain"]
        eval_cpu = time.process_time() - began
    return {
        "windows": count, "seq_len": length, "seed": seed, "overrides": overrides,
        "perplexity": scored["perplexity"], "tokens": scored["tokens"],
        "sample_cpu_s": sample_cpu, "sample_wall_s": sample_wall, "sampled_here": sample_cpu > 1.0,
        "compress_cpu_s": compress_cpu, "compress_wall_s": compress_wall, "eval_cpu_s": eval_cpu,
        "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
    }  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        "# The headline's quality against its calibration size (`awq_int4`, default model, out of domain)",
        "",
        f"Model `{report['model']}` (fp32); each row: `awq_int4` calibrated on N windows of L tokens the model samples "
        f"itself (temperature 1, the run's path), draws = seeds {report['seeds']}; scored on the run's out-of-domain "
        f"headline text ({report['baseline']['tokens']} tokens of Shakespeare in 512-token windows; fp32 baseline "
        f"perplexity {report['baseline']['perplexity']:.3f}). Ratio: candidate / baseline perplexity; interval: 95% t "
        f"over the draws. CPU seconds (`time.process_time`, {report['threads']} torch thread(s)) per draw, mean over "
        f"the draws: sampling (only draws that sampled, not read the cache), the layer walk (compress + save), the "
        f"candidate's evaluation. {report['machine']}; {report['date']}; load average at the end {report['load']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| setting | calibration tokens | draws | ratio per draw | mean ratio | 95% interval | sample CPU s | "
        "compress CPU s | eval CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        draws = ", ".join(f"{r:.4f}" for r in row["ratios"])
        low = "–" if math.isnan(row["low"]) else f"{row['low']:.4f}–{row['high']:.4f}"
        sample = f"{row['sample_cpu_s']:.0f}" if row["sample_cpu_s"] is not None else "cached"
        lines.append(
            f"| {row['setting']} | {row['tokens']} | {len(row['ratios'])} | {draws} | **{row['mean']:.4f}** | {low} | "
            f"{sample} | {row['compress_cpu_s']:.0f} | {row['eval_cpu_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def summarize(name: str, draws: list[dict], base: float) -> dict:
    ratios = [d["perplexity"] / base for d in draws]
    mean, low, high = interval(ratios)
    sampled = [d["sample_cpu_s"] for d in draws if d["sampled_here"]]
    return {
        "setting": name, "tokens": draws[0]["windows"] * draws[0]["seq_len"], "seeds": [d["seed"] for d in draws],
        "ratios": ratios, "mean": mean, "low": low, "high": high,
        "sample_cpu_s": sum(sampled) / len(sampled) if sampled else None,
        "compress_cpu_s": sum(d["compress_cpu_s"] for d in draws) / len(draws),
        "eval_cpu_s": sum(d["eval_cpu_s"] for d in draws) / len(draws),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="WINDOWSxTOKENS, e.g. 64x512 32x512 64x256")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--overrides", nargs="*", default=[], help="recipe overrides for every draw")
    parser.add_argument("--label", default="", help="a name for the overrides, in the setting's name")
    parser.add_argument("--report-only", action="store_true", help="join the draws already kept; run none")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "headline-tradeoff")
    args = parser.parse_args()
    for setting in args.settings:
        check_independent(args.seeds, parse_setting(setting)[0])
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from benchmarks.quality import texts
    from compress.base.paths import artifacts_dir
    from compress.model.sources import ModelSpec, load, resolve_model_path

    work = artifacts_dir() / "benchmarks" / "headline-tradeoff"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(resolve_model_path(ModelSpec(path="smollm2-135m")))
    model, tokenizer = load(ModelSpec(path="smollm2-135m", lazy=False))
    ids = texts(tokenizer)["out_of_domain"]
    base = baseline(work, model, ids)
    suffix = f"-{args.label}" if args.label else ""
    rows = []
    for setting in args.settings:
        count, length = parse_setting(setting)
        name = f"{count}x{length}{suffix}"
        draws = []
        for seed in args.seeds:
            path = work / f"{name}-seed{seed}.json"
            if not path.is_file() and not args.report_only:
                measured = draw(model_dir, model, ids, count, length, seed, args.overrides)
                write_file_atomically(path, partial(Path.write_text, data=json.dumps(measured)))
                print(f"{name} seed {seed}: x{measured['perplexity'] / base['perplexity']:.4f}")
            if path.is_file():
                draws.append(json.loads(path.read_text()))
        if draws:
            rows.append(summarize(name, draws, base["perplexity"]))
    report = {
        "model": model_dir.name, "baseline": base, "seeds": args.seeds, "threads": args.threads, "rows": rows,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "command": " ".join(["OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "?"),
                             "python -m benchmarks.headline_tradeoff", *(shlex.quote(a) for a in sys.argv[1:])]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
