"""`compress search` on the default model at several bit budgets, against uniform GPTQ and AWQ int4, one gate for all.

    python benchmarks/search_budgets.py                                   # budgets 4.25 4.5 5 6, gate=quick @ 1.10
    python benchmarks/search_budgets.py --budgets 4.5 --max-trials 2 --overrides data.num_samples=32
    python benchmarks/search_budgets.py --max-trials 1 --start-at-budget   # one gated allocation per budget

Every checkpoint (each search trial and the two uniform ones) is judged by the same release gate policy against the
same baseline, so the perplexity ratios are the gate's own (``gate=quick``: 12 windows of 512 tokens). After the
searches, the smallest passing checkpoint is gated again by ``python -m compress gate`` in a fresh process and its
exit code is recorded. Results: ``benchmarks/results/search-budgets.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress import oneshot  # noqa: E402
from compress.base.data import load_corpus  # noqa: E402
from compress.commands.run import validate  # noqa: E402
from compress.evals.gate import run_gate  # noqa: E402
from compress.model.sources import resolve_model_path  # noqa: E402
from compress.search import SearchSpec, run_search  # noqa: E402


def uniform_row(recipe: str, overrides: list[str], folder: Path) -> dict:
    """A uniform recipe compressed and judged by the same gate the search uses."""
    _, [config] = validate(recipe, overrides, multirun=False)
    start = time.perf_counter()
    checkpoint = oneshot(config.model.path, recipe, output_dir=folder / "checkpoint", overrides=overrides)
    texts = load_corpus(config.data).evaluation  # the texts the search's gate reads
    verdict = run_gate(
        checkpoint, resolve_model_path(config.model), config.gate, folder / "gate", evaluation_texts=texts
    )
    size = json.loads((checkpoint / "size.json").read_text())
    return {
        "recipe": recipe,
        "bits_per_weight": size["linear_bits_per_weight"],
        "size_mb": sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 1e6,
        "ppl_ratio": verdict.metric("perplexity", "perplexity")
        / verdict.metric("perplexity", "perplexity", "baseline"),
        "passed": verdict.passed,
        "reasons": verdict.reasons,
        "wall_s": time.perf_counter() - start,
    }


def markdown(report: dict) -> str:
    lines = [
        "# compress search: size vs perplexity vs verdict",
        "",
        f"Default model, base recipe `{report['recipe']}`, overrides `{' '.join(report['overrides'])}`; every row "
        f"judged by the same gate policy (ppl ratio = the gate's perplexity / the baseline's). {report['machine']}; "
        f"run {report['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| checkpoint | bits/weight | size MB | ppl ratio | verdict |",
        "|---|---|---|---|---|",
    ]
    for row in report["uniform"]:
        verdict = "pass" if row["passed"] else "BLOCK: " + "; ".join(row["reasons"])
        copied = f" (from {row['copied_from']})" if "copied_from" in row else ""
        lines.append(
            f"| uniform `{row['recipe']}`{copied} | {row['bits_per_weight']:.3f} | {row['size_mb']:.1f} | "
            f"{row['ppl_ratio']:.4f} | {verdict} |"
        )
    for budget, search in report["searches"].items():
        for trial in search["trials"]:
            verdict = "pass" if trial["passed"] else "BLOCK: " + "; ".join(trial["reasons"])
            schemes = ", ".join(f"{name} ×{count}" for name, count in trial["schemes"].items())
            lines.append(
                f"| search ≤{budget} bits, trial {trial['number']} ({schemes}) | {trial['bits_per_weight']:.3f} | "
                f"{trial['size_mb']:.1f} | {trial['ppl_ratio']:.4f} | {verdict} |"
            )
    lines += [""] + [f"- budget {budget}: {search['line']}" for budget, search in report["searches"].items()]
    if report.get("regate"):
        regate = report["regate"]
        lines.append(f"- `python -m compress gate` on {regate['checkpoint']}: exit {regate['exit_code']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gptq_int4")
    parser.add_argument("--budgets", nargs="+", type=float, default=[4.25, 4.5, 5.0, 6.0])
    parser.add_argument("--max-trials", type=int, default=3)
    parser.add_argument(
        "--start-at-budget", action="store_true", help="first trial: the best allocation within the budget"
    )
    parser.add_argument("--candidates", nargs="+", default=["int3_g64", "int4_g64", "int8", "bf16"])
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument(
        "--uniform-from", type=Path, help="copy the uniform rows from this earlier search-budgets.json (same overrides)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "search-bench")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    overrides = ["gate=quick", "gate.perplexity.max_ratio=1.10", "tracking.enabled=false", *args.overrides]
    work = args.work / time.strftime("%Y%m%d-%H%M%S")
    report = {
        "recipe": args.recipe,
        "overrides": overrides,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python " + " ".join([Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
        "uniform": [],
        "searches": {},
    }

    def save() -> None:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "search-budgets.json").write_text(json.dumps(report, indent=2, default=str))
        (args.results / "search-budgets.md").write_text(markdown(report))

    if args.uniform_from:
        earlier = json.loads(args.uniform_from.read_text())
        if earlier["overrides"] != overrides:
            raise SystemExit(f"{args.uniform_from} was measured with {earlier['overrides']}, not {overrides}")
        report["uniform"] = [
            {**row, "copied_from": f"{args.uniform_from.name} ({earlier['date']})"} for row in earlier["uniform"]
        ]
    for recipe in () if args.uniform_from else ("gptq_int4", "awq_int4"):
        report["uniform"].append(uniform_row(recipe, overrides, work / recipe))
        print(json.dumps(report["uniform"][-1]), flush=True)
        save()
    _, [config] = validate(args.recipe, overrides, multirun=False)
    for budget in args.budgets:
        start = budget if args.start_at_budget else None
        spec = SearchSpec(budget_bits=budget, candidates=args.candidates, max_trials=args.max_trials, start_bits=start)
        result = run_search(config, spec, work / f"search-{budget:g}")
        trials = [{**vars(t), "checkpoint": str(t.checkpoint)} for t in result.trials]
        report["searches"][f"{budget:g}"] = {"line": result.line, "trials": trials}
        print(result.line, flush=True)
        save()
    passing = [t for s in report["searches"].values() for t in s["trials"] if t["passed"]]
    if passing:
        best = min(passing, key=lambda t: t["bits_per_weight"])
        command = [sys.executable, "-m", "compress", "gate", f"checkpoint={best['checkpoint']}",
                   f"baseline={resolve_model_path(config.model)}", "gate=quick", "gate.perplexity.max_ratio=1.10",
                   "gate.registry.register=false"]  # fmt: skip
        code = subprocess.run(command, cwd=ROOT).returncode
        report["regate"] = {"checkpoint": best["checkpoint"], "exit_code": code}
        save()
    print(markdown(report))


if __name__ == "__main__":
    main()
