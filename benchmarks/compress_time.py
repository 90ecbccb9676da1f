"""Wall time of one recipe's compression on the default model, as shipped or with overrides: one `compress run`.

    OMP_NUM_THREADS=2 python -m benchmarks.compress_time autoround_int4 --name autoround-int4-cpu-preset

The run compresses and saves (no evaluation, no gate, no tracking) in a fresh process; the time is the pipeline's
own (``report.json``: load, calibrate, quantize, save; interpreter start left out). The checkpoint stays under
``artifacts/benchmarks/compress-time/<name>/`` to be scored later (``benchmarks/quality.py``). The load average
before and after is recorded: on a shared machine other jobs take part of the CPU, and the time says so only with it.
Writes ``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value, as on the CLI")
    parser.add_argument("--name", required=True, help="results file stem under benchmarks/results/")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    work = REPO / "artifacts" / "benchmarks" / "compress-time" / args.name
    run = ["run", f"recipe={args.recipe}", *args.overrides, "eval.perplexity=false", "gate=none"]
    run += ["tracking.enabled=false", "device=cpu", "resume=false", f"output.dir={work}"]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    load_before, start = os.getloadavg(), time.perf_counter()
    with (REPO / "artifacts" / f"compress-time-{args.name}.log").open("w") as log:
        code = subprocess.run([sys.executable, "-m", "compress", *run], stdout=log, stderr=subprocess.STDOUT, env=env)
    if code.returncode:
        raise SystemExit(f"exit {code.returncode}; see artifacts/compress-time-{args.name}.log")
    [report_file] = work.glob("*/report.json")
    report = json.loads(report_file.read_text())
    result = {
        "command": "python -m benchmarks.compress_time " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "run": "python -m compress " + " ".join(shlex.quote(a) for a in run),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs (shared), torch {torch.__version__}",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_before": load_before[0],
        "load_average_after": os.getloadavg()[0],
        "process_wall_s": time.perf_counter() - start,
        "wall_time_s": report["wall_time_s"],
        "timings_s": report["timings_s"],
        "algorithm": [summary.get("algorithm") for summary in report.get("stages", {}).values()],
        "mean_loss_vs_start": [summary.get("mean_loss_vs_start") for summary in report.get("stages", {}).values()],
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Compression time: `{args.recipe}{''.join(' ' + o for o in args.overrides)}` on the default model",
        "",
        f"{result['machine']}, OMP_NUM_THREADS={result['omp_num_threads']}; {result['date']}. The CPU is shared "
        f"with other jobs: 1-minute load average {load_before[0]:.1f} before the run, "
        f"{result['load_average_after']:.1f} after (2 cores).",
        "",
        f"Command: `{result['command']}` (runs `{result['run']}`)",
        "",
        "| phase | seconds |",
        "|---|---|",
        *(f"| {phase} | {seconds:.0f} |" for phase, seconds in report["timings_s"].items()),
        f"| pipeline wall time | {report['wall_time_s']:.0f} |",
        "",
        *(f"Algorithm: {text}" for text in result["algorithm"] if text),
        *(f"Mean best / first minibatch loss per layer: {v:.3f}" for v in result["mean_loss_vs_start"] if v),
    ]
    (args.results / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
