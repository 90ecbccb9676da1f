"""What keeping the walk's progress costs (``compress/model/resume.py``): the same run with ``resume=true`` and
``false``.

    python -m benchmarks.resume_cost                      # gptq_int4 on the default model, 2 rounds
    python -m benchmarks.resume_cost --recipe awq_int4 --rounds 1

Each row is one ``compress run`` in a fresh process under GNU time, without evaluation or gate (the compression
alone), alternating resume on and off each round so that a change in the machine's load hits both. Reported: the
``compress`` phase from ``report.json`` (the walk, and with resume the writes after every layer), the peak RSS, and
the largest progress folder seen. Writes ``benchmarks/results/resume-cost.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.peer_comparison import measured_run  # noqa: E402
from benchmarks.plan_vs_actual import largest_folder_mb  # noqa: E402

FIXED = ["tracking.enabled=false", "gate=none", "eval.perplexity=false", "device=cpu"]


def one_run(recipe: str, resume: bool, work: Path, tag: str) -> dict:
    runs = work / f"runs-{tag}"
    command = [sys.executable, "-m", "compress", "run", f"recipe={recipe}", *FIXED, f"resume={str(resume).lower()}",
               f"output.dir={runs}"]  # fmt: skip
    os.environ["COMPRESS_ARTIFACTS"] = str(REPO / "artifacts")  # the converted default model
    stop, sizes = threading.Event(), []
    watcher = threading.Thread(target=largest_folder_mb, args=(runs / ".progress", stop, sizes))
    watcher.start()
    result = measured_run(command, work / f"{tag}.log", timeout=3600, tree=REPO)
    stop.set()
    watcher.join()
    if not result["ok"]:
        raise SystemExit(f"{tag}: {result['error']}")
    [report] = [json.loads(p.read_text()) for p in runs.glob("*/report.json")]
    return {"resume": resume, "compress_s": report["timings_s"]["compress"], "wall_s": result["wall_s"],
            "peak_rss_mb": result["peak_rss_mb"], "largest_progress_mb": max(sizes, default=0.0)}  # fmt: skip


def markdown(result: dict) -> str:
    on, off = ([r for r in result["rows"] if r["resume"] is flag] for flag in (True, False))
    ratio = median(r["compress_s"] for r in on) / median(r["compress_s"] for r in off)
    lines = [
        f"# The cost of keeping the walk's progress: `{result['recipe']}` on the default model",
        "",
        f"{result['machine']}; {result['date']}. Command: `{result['command']}`. Each row: one `compress run` in a "
        f"fresh process (`{' '.join(FIXED)}`), resume on and off alternating; compress s = the `compress` phase of "
        "report.json; peak RSS by GNU time; progress = the largest `.progress` folder seen (sampled every 0.5 s).",
        "",
        "| round | resume | compress s | process wall s | peak RSS MB | progress MB |",
        "|---|---|---|---|---|---|",
    ]
    for index, row in enumerate(result["rows"]):
        lines.append(
            f"| {index // 2 + 1} | {row['resume']} | {row['compress_s']:.1f} | {row['wall_s']:.1f} | "
            f"{row['peak_rss_mb']:.0f} | {row['largest_progress_mb']:.0f} |"
        )
    lines += ["", f"Median compress phase, resume on / off: **{ratio:.3f}x**."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gptq_int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    result = {
        "recipe": args.recipe,
        "command": "python -m benchmarks.resume_cost " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="resume-cost-") as work:
        for round_ in range(args.rounds):
            for resume in (True, False):
                row = one_run(args.recipe, resume, Path(work), f"{round_}-{resume}")
                result["rows"].append(row)
                print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resume-cost.json").write_text(json.dumps(result, indent=2))
    (args.out / "resume-cost.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
