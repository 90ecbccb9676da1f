"""How much sign-gradient rounding buys per unit of time: schedules (steps x sequences per step) against quality.

    python -m benchmarks.signround_schedule                       # the default grid, with gptq_int4 as reference
    python -m benchmarks.signround_schedule --schedules 40x4 100x4 --reference gptq_int4 --recipe autoround_int4

Each schedule compresses the default model with ``autoround_int4`` (``stages.0.iterations``, ``stages.0.batch_size``
overridden) through ``compress.oneshot``; the reference recipe (default ``gptq_int4``) runs in the same invocation,
so the time ratio is measured on the same machine under the same load. Every checkpoint is reloaded and scored like
``benchmarks/quality.py`` (out-of-domain headline, in-domain beside it). Writes
``benchmarks/results/signround-schedule.{json,md}`` (``--name`` changes the stem) after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quality import score, texts

ROOT = Path(__file__).resolve().parents[1]


def _row(name: str, row: dict, base: dict, reference_seconds: float | None) -> str:
    ratio = {text: row[text]["perplexity"] / base[text]["perplexity"] for text in ("out_of_domain", "in_domain")}
    times = "-" if reference_seconds is None else f"{row['seconds'] / reference_seconds:.1f}x"
    return (
        f"| {name} | {row['out_of_domain']['perplexity']:.3f} | {ratio['out_of_domain']:.3f}x | "
        f"{row['in_domain']['perplexity']:.3f} | {ratio['in_domain']:.3f}x | {row['seconds']:.0f} | {times} |"
    )


def markdown(report: dict) -> str:
    reference = report["rows"].get(report["reference"])
    reference_seconds = None if reference is None else reference["seconds"]
    lines = [
        f"# Sign-gradient rounding: schedule against quality ({report['recipe']})",
        "",
        f"Model `{report['model']}` (fp32), 64 x 512 calibration tokens of pydoc; a schedule `NxB` is N signed steps "
        f"per decoder layer on B calibration sequences each. Perplexity: 512-token windows, out-of-domain = "
        f"{report['tokens']['out_of_domain']} tokens of Shakespeare, in-domain = {report['tokens']['in_domain']} "
        f"held-out pydoc tokens. Time ratio against `{report['reference']}` in the same invocation. "
        f"{report['machine']}; {report['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| run | out-of-domain ppl | ratio | in-domain ppl | ratio | compress s | time vs reference |",
        "|---|---|---|---|---|---|---|",
    ]
    base = report["baseline"]
    lines.append(
        f"| baseline (fp32) | {base['out_of_domain']['perplexity']:.3f} | 1.000x | "
        f"{base['in_domain']['perplexity']:.3f} | 1.000x | - | - |"
    )
    lines += [_row(name, row, base, reference_seconds) for name, row in report["rows"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["20x4", "40x4", "100x4"], help="NxB: steps x sequences")
    parser.add_argument("--recipe", default="autoround_int4")
    parser.add_argument("--reference", default="gptq_int4", help="a recipe timed and scored in the same run")
    parser.add_argument("--overrides", nargs="*", default=[], help="extra overrides for every schedule")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--name", default="signround-schedule")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from compress import oneshot
    from compress.checkpoint import load_checkpoint
    from compress.models import ModelSpec, load, resolve_model_path

    model_dir = Path(resolve_model_path(ModelSpec()))
    model, tokenizer = load(ModelSpec(lazy=False))
    ids = texts(tokenizer)
    report = {
        "model": model_dir.name,
        "recipe": args.recipe,
        "reference": args.reference,
        "tokens": {name: int(tokens.numel()) for name, tokens in ids.items()},
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python -m benchmarks.signround_schedule " + " ".join(sys.argv[1:]),
        "baseline": score(model, ids, args.max_windows),
        "rows": {},
    }
    del model
    runs = [(args.reference, args.reference, [])] if args.reference else []
    for schedule in args.schedules:
        steps, batch = (int(part) for part in schedule.split("x"))
        overrides = [f"stages.0.iterations={steps}", f"stages.0.batch_size={batch}", *args.overrides]
        runs.append((f"{args.recipe} {schedule}", args.recipe, overrides))
    args.results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="signround-") as tmp:
        for index, (name, recipe, overrides) in enumerate(runs):
            start = time.perf_counter()
            folder = oneshot(
                model=str(model_dir), recipe=recipe, overrides=overrides, output_dir=str(Path(tmp) / str(index))
            )
            seconds = time.perf_counter() - start
            compressed, _ = load_checkpoint(folder)
            report["rows"][name] = {**score(compressed, ids, args.max_windows), "seconds": seconds}
            del compressed
            print(f"{name}: {json.dumps(report['rows'][name])}", flush=True)
            (args.results / f"{args.name}.json").write_text(json.dumps(report, indent=2))
            (args.results / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
