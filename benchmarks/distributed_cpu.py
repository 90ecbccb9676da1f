"""Calibration time of one process against ``torchrun --nproc-per-node 2`` (gloo) on CPU, run back to back.

    python benchmarks/distributed_cpu.py [recipe=gptq_int4] [extra overrides ...]

Each configuration runs ``python -m compress run`` with evaluation, gate and tracking off and reads the ``compress``
phase (the layer walk: calibration forwards, statistics, GPTQ) and the whole wall time from its report; the table
goes to ``benchmarks/results/distributed-cpu.md``. One process uses every core's threads; torchrun gives each rank
one thread (its default), so both use the same cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
SETTINGS = ["data.num_samples=32", "eval.perplexity=false", "gate=none", "tracking.enabled=false", "device=cpu"]


def timed_run(ranks: int, overrides: list[str], runs_dir: Path) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [*(launcher if ranks > 1 else [sys.executable]), "-m", "compress", "run", *overrides]
    command.append(f"output.dir={runs_dir}")
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    [report_file] = runs_dir.glob("*/report.json")
    report = json.loads(report_file.read_text())
    return {"ranks": report["data"]["ranks"], "compress_s": report["timings_s"]["compress"], "process_wall_s": wall}


def main(argv: list[str]) -> None:
    overrides = [*(argv or ["recipe=gptq_int4"]), *SETTINGS]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in (1, 2):
            rows.append(timed_run(ranks, overrides, Path(scratch) / f"ranks{ranks}"))
    base = rows[0]["compress_s"]
    load = os.getloadavg()[0]
    lines = [
        "# Data-parallel calibration on CPU: 1 process vs torchrun --nproc-per-node 2 (gloo)",
        "",
        f"`python benchmarks/distributed_cpu.py {' '.join(argv)}` → `python -m compress run {' '.join(overrides)}`,",
        "then the same under `torchrun --standalone --nproc-per-node 2`, back to back on the same machine",
        f"({os.cpu_count()} cores, load average {load:.1f} at the end: the machine is shared with other jobs, so the",
        "times carry that noise). `compress` is the layer walk (capture, calibration forwards, statistics, GPTQ);",
        "the process wall time adds start-up, model load and saving (rank 0).",
        "",
        "| ranks | compress (s) | speedup | process wall (s) |",
        "|---|---|---|---|",
        *[
            f"| {r['ranks']} | {r['compress_s']:.1f} | {base / r['compress_s']:.2f}x | {r['process_wall_s']:.1f} |"
            for r in rows
        ],
        "",
    ]
    out = ROOT / "benchmarks" / "results" / "distributed-cpu.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
