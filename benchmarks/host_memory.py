"""Host memory of `compress run recipe=awq_int4` (sampling included) on a random ~4B-parameter Llama on this CPU,
against `compress plan`'s prediction and the goal: peak RSS <= 3 GB plus the sampling model's share the
plan states, and the plan within +-25 % of the measured peak.

    python -m benchmarks.host_memory                       # hidden 3072, 28 layers, intermediate 8192, vocab 128256
    python -m benchmarks.host_memory --model-dir <folder>  # a model this script (or save_random_llama) wrote before
    python -m benchmarks.host_memory --tiny --out /tmp/hm  # a tiny shape: checks the script, measures nothing

The model is written as bf16 safetensors by ``benchmarks.peak_rss.save_random_llama`` (never fp32). ``compress plan``
and ``compress run`` then run in fresh processes with the same overrides; the run's peak RSS comes from GNU time
(that process alone), its per-phase rises and times from its report. Results: ``benchmarks/results/host-memory-4b``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.peak_rss import REPO, SHAPES, save_random_llama
from benchmarks.peer_comparison import measured_run

SHAPE_4B = dict(  # Llama-3.2-3B's widths with an untied head and Llama-3's vocabulary: 3.61 B parameters
    hidden_size=3072,
    num_hidden_layers=28,
    intermediate_size=8192,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
)
# No evaluation and no gate (hours for a 4B model on 2 cores); 4 sampled windows of 16 tokens (a 3.6B bf16 forward
# per token on 2 shared cores takes tens of seconds). AWQ's scale search costs o x i^2 per candidate and linear
# whatever the token count (the plan prices the recipe's 40 candidates and GPTQ rounding at ~12 h here): one
# candidate, round-to-nearest, no clipping search keep the walk's structure (one layer widened, its input
# covariances, the streamed weights) at a fraction of the time; GPTQ's Hessian walk is what this leaves out.
OVERRIDES = [
    "device=cpu",
    "tracking.enabled=false",
    "gate=none",
    "eval.perplexity=false",
    "data.num_samples=4",
    "data.seq_len=16",
    "stages.0.grid=1",
    "stages.0.duo_scaling=false",
    "stages.0.rounding=rtn",
    "stages.0.clip=false",
]
GOAL_BASE_MB = 3 * 1024  # the goal: peak RSS <= 3 GB plus the sampling model's share


class PeakWatch(threading.Thread):
    """The run process's peak RSS so far (``VmHWM``) every few seconds, and its value when each new line of the
    run's log appeared: what a run cut at a deadline reached, phase by phase."""

    def __init__(self, log: Path, interval: float = 5.0):
        super().__init__(daemon=True)
        self.log, self.interval = log, interval
        self.peak_mb: float | None = None
        self.by_line: list[tuple[float, str, float]] = []  # (seconds since start, log line, peak MB so far)
        self.stopped = threading.Event()

    def run(self) -> None:
        start, seen = time.perf_counter(), 0
        while not self.stopped.wait(self.interval):
            peak = _run_peak_mb()
            if peak is not None:
                self.peak_mb = peak
            lines = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
            for line in lines[seen:]:
                if line.startswith(("INFO", "WARNING")) and self.peak_mb is not None:
                    self.by_line.append((time.perf_counter() - start, line[:200], self.peak_mb))
            seen = len(lines)


def _run_peak_mb() -> float | None:
    """``VmHWM`` of the `compress run` process this script started (the child of GNU time)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[1:4] == ["-m", "compress", "run"]:  # not GNU time, whose arguments name it too
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except (psutil.Error, OSError):
            continue
    return None


def parse_plan(text: str) -> dict:
    """The plan's peak host RAM and its per-phase RAM above the process, from ``compress plan``'s lines."""
    peak = re.search(r"peak host RAM (\d+) MB \(largest phase above this process: ([^)]*) MB\)", text)
    if not peak:
        raise SystemExit(f"compress plan printed no peak host RAM line:\n{text}")
    phases = {name: float(mb) for name, mb in re.findall(r"(\w+) (\d+)", peak.group(2))}
    seconds = re.search(r"wall time ~(\d+) s", text)
    return {"host_ram_mb": float(peak.group(1)), "phases_ram_mb": phases, "seconds": float(seconds.group(1))}


def markdown(result: dict) -> str:
    run, plan, goal = result["run"], result["plan"], result["goal"]
    rises = ", ".join(f"{k} +{v:.0f}" for k, v in run["peak_rss_rise_mb"].items())
    times = ", ".join(f"{k} {v:.0f} s" for k, v in run["timings_s"].items())
    lines = [
        f"# Host memory of `compress run recipe={result['recipe']}` on a random {result['params'] / 1e9:.2f} B "
        "Llama (sampling included)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Shape {json.dumps(result['shape'])}; bf16 safetensors {result['weights_mb']:.0f} MB; "
        f"{result['machine']}. "
        f"Every command also sets `{' '.join(result['overrides'])}`.",
        "",
        "| | MB |",
        "|---|---|",
        f"| measured peak RSS of `compress run` (GNU time; VmHWM so far when stopped) | {run['peak_rss_mb']:.0f} |",
        f"| plan: peak host RAM | {plan['host_ram_mb']:.0f} |",
        f"| plan: sampling phase (the model's share) | {plan['phases_ram_mb'].get('sample', 0):.0f} |",
        f"| goal: 3 GB + the sampling share | {goal['limit_mb']:.0f} |",
        "",
        f"Peak within the goal: **{'yes' if goal['peak_within'] else 'no'}**; the plan is "
        f"{goal['plan_error']:+.1%} off the measurement (goal ±25 %): "
        f"**{'yes' if goal['plan_within'] else 'no'}**.",
        "",
        f"Run wall {run['wall_s']:.0f} s ({times}); the phases that raised the peak RSS (MB): {rises}. "
        f"Plan's wall-time estimate: {plan['seconds']:.0f} s.",
    ]
    if "replanned" in result:
        again, earlier = result["replanned"], result["replanned"]["earlier"]
        lines += [
            "",
            f"**The plan was recomputed** on {again['date']} at {again['commit']} (`{again['command']}`) and judged "
            f"against the run above, measured before: the earlier plan said {earlier['plan']['host_ram_mb']:.0f} MB "
            f"({earlier['goal']['plan_error']:+.1%}; phases {earlier['plan']['phases_ram_mb']}).",
        ]
    if not run["complete"]:
        lines += [
            "",
            f"**The run was stopped at the deadline ({run['wall_s']:.0f} s)**: the peak is the one reached so far.",
        ]
    rising, last = [], 0.0
    for seconds, line, peak in run["peaks_by_log_line"]:
        if peak > last + 50:
            rising.append(f"| {seconds:.0f} | {peak:.0f} | `{line.replace('|', '/')}` |")
            last = peak
    if rising:
        lines += ["", "Peak RSS so far (VmHWM, read every 5 s) when the run logged a line:", ""]
        lines += ["| s | peak MB | log line |", "|---|---|---|", *rising]
    return "\n".join(lines) + "\n"


def judged(result: dict) -> dict:
    """The peak-RSS goal for ``result``'s plan and run."""
    limit = GOAL_BASE_MB + result["plan"]["phases_ram_mb"].get("sample", 0.0)
    error = result["plan"]["host_ram_mb"] / result["run"]["peak_rss_mb"] - 1
    peak_within = result["run"]["peak_rss_mb"] <= limit
    return {"limit_mb": limit, "peak_within": peak_within, "plan_error": error, "plan_within": abs(error) <= 0.25}


def replan(results: Path, plan: dict, command: str) -> int:
    """A changed plan judged against the run ``results`` measured before (the run costs ~40 min here; the plan
    seconds): the earlier plan and its error stay in the file beside the new one."""
    result = json.loads(results.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout
    earlier = {"plan": result["plan"], "goal": result["goal"], "command": result["command"]}
    result["replanned"] = {"command": "python -m benchmarks.host_memory " + command, "commit": commit.strip(),
                           "date": time.strftime("%Y-%m-%d", time.gmtime()), "earlier": earlier}  # fmt: skip
    result["plan"] = plan
    result["goal"] = judged(result)
    results.write_text(json.dumps(result, indent=2))
    results.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape: checks the script, measures nothing")
    parser.add_argument("--model-dir", type=Path, help="a random model folder written before (skips the build)")
    parser.add_argument("--recipe", default="awq_int4")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; none for --tiny)")
    parser.add_argument("--deadline", type=float, help="seconds: stop the run there, keep the peak it reached")
    parser.add_argument("--replan", type=Path, help="a results .json: plan again, judge it against its measured run")
    parser.add_argument("extra", nargs="*", help="more key=value overrides for the plan and the run")
    args = parser.parse_args(argv)
    shape = dict(SHAPES["tiny"] if args.tiny else SHAPE_4B)
    overrides = OVERRIDES + (["stages.0.group_size=32"] if args.tiny else []) + args.extra
    out = args.out or (None if args.tiny else REPO / "benchmarks" / "results")
    with tempfile.TemporaryDirectory(prefix="host-memory-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or work / "model"
        if args.model_dir is None:
            save_random_llama(model_dir, shape, torch.bfloat16)
        shape = {k: v for k, v in json.loads((model_dir / "config.json").read_text()).items() if k in shape}
        os.environ["COMPRESS_ARTIFACTS"] = str(work / "artifacts")  # no cached calibration windows: sampling runs
        common = [f"recipe={args.recipe}", f"model={model_dir}", *overrides]
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        planned = subprocess.run(
            [sys.executable, "-m", "compress", "plan", *common], capture_output=True, text=True, env=env, cwd=REPO
        )  # fmt: skip
        if planned.returncode != 0:
            raise SystemExit(f"compress plan failed: {planned.stderr.strip()[-500:]}")
        plan = parse_plan(planned.stdout)
        print(planned.stdout, flush=True)
        if args.replan:
            return replan(args.replan, plan, " ".join(sys.argv[1:] if argv is None else argv))
        runs = work / "runs"
        command = [sys.executable, "-m", "compress", "run", *common, f"output.dir={runs}"]
        watch = PeakWatch(work / "run.log")
        watch.start()
        measured = measured_run(command, work / "run.log", timeout=args.deadline or 24 * 3600, tree=REPO)
        watch.stopped.set()
        watch.join()
        report_files = list(runs.glob("*/report.json"))
        if not measured["ok"] and not (watch.peak_mb and "timed out" in measured["error"]):
            raise SystemExit(f"compress run failed: {measured['error']}")
        report = json.loads(report_files[0].read_text()) if report_files else None
        params = sum(_parameter_counts(model_dir).values())  # every tensor of the weight files
        weights_mb = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    run = {  # a run cut at --deadline: its peak so far (VmHWM) and the phases its log had reached
        "complete": report is not None,
        "peak_rss_mb": measured.get("peak_rss_mb", watch.peak_mb),
        "wall_s": measured["wall_s"],
        "timings_s": report["timings_s"] if report else {},
        "peak_rss_rise_mb": report["peak_rss_rise_mb"] if report else {},
        "peaks_by_log_line": watch.by_line,
    }
    result = {
        "command": "python -m benchmarks.host_memory " + " ".join(sys.argv[1:] if argv is None else argv),
        "recipe": args.recipe,
        "shape": shape,
        "params": params,
        "weights_mb": weights_mb,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "overrides": overrides,
        "plan": plan,
        "run": run,
    }
    result["goal"] = judged(result)
    print(markdown(result))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        name = "host-memory-tiny" if args.tiny else "host-memory-4b"
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        (out / f"{name}.md").write_text(markdown(result))
    return 0


def _parameter_counts(folder: Path) -> dict[str, int]:
    from compress.app.preflight import read_headers

    return {name: int(torch.Size(shape).numel()) for name, (_, shape) in read_headers(folder).items()}


if __name__ == "__main__":
    sys.exit(main())
