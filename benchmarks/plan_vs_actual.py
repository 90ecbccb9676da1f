"""The pre-flight plan against what the run then measured: peak host RAM, disk and wall time, for recipe x model pairs.

    python -m benchmarks.plan_vs_actual                 # the 8 pairs below, ~40 min on a 2-core CPU
    python -m benchmarks.plan_vs_actual --only rtn_int4-default --out /tmp/check   # one pair

Every pair is one `python -m compress run` in a fresh process under GNU time. The prediction is what that same
process printed first (`plan for ...`, from config and safetensors headers and a 0.3 s probe:
`compress/app/preflight.py`); the measurement is GNU time's peak RSS of the process (torchrun: of its largest rank,
`/usr/bin/time` on each), the checkpoint's size plus the largest resume progress folder, and the pipeline's own wall
time (`report.json`, which leaves out interpreter start and imports). Ratios are predicted / measured; the goal is RAM
and disk within ±20%, time within ±50%. Writes ``benchmarks/results/plan-vs-actual.{json,md}``.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.peak_rss import save_random_llama  # noqa: E402

QUICK_EVAL = ["eval.max_windows=8", "eval.data.eval_fraction=0.005"]  # the evaluation phases, kept short
COMMON = ["tracking.enabled=false", "gate=none", "device=cpu"]
# name: (model, recipe, overrides, ranks); "default" is the project's default model, the rest are built here
PAIRS = {
    "rtn_int4-default": ("default", "rtn_int4", QUICK_EVAL, 1),
    "gptq_int4-default": ("default", "gptq_int4", ["data.num_samples=16", *QUICK_EVAL], 1),
    "awq_int4-default": ("default", "awq_int4", ["data.num_samples=16", *QUICK_EVAL], 1),
    "fp8_dynamic-default": ("default", "fp8_dynamic", QUICK_EVAL, 1),
    "smoothquant_w8a8-default": ("default", "smoothquant_w8a8", ["data.num_samples=16", *QUICK_EVAL], 1),
    "gptq_int4-default-torchrun": ("default", "gptq_int4", ["data.num_samples=16", "eval.perplexity=false"], 2),
    "gptq_int4-moe": ("moe", "gptq_int4", ["data.num_samples=8", "data.seq_len=256", "eval.perplexity=false"], 1),
    "rtn_int4-1b": ("1b", "rtn_int4", ["eval.perplexity=false"], 1),
}
MOE_SHAPE = dict(  # a random Qwen3-MoE, ~0.4B parameters: 16 experts of 8 layers, top-4 routing
    vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
)  # fmt: skip
ONE_B = dict(
    hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16,
    vocab_size=32000,
)  # fmt: skip


def model_folder(kind: str, work: Path) -> str:
    if kind == "default":
        from compress.app.run_config import ModelSpec
        from compress.model.sources import resolve_model_path

        return str(resolve_model_path(ModelSpec()))
    folder = work / f"model-{kind}"
    if not folder.exists():
        if kind == "1b":
            save_random_llama(folder, ONE_B, torch.bfloat16)
        else:
            save_random_moe(folder)
    return str(folder)


@torch.no_grad()
def save_random_moe(folder: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from benchmarks.peak_rss import byte_tokenizer

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(max_position_embeddings=4096, **MOE_SHAPE)).to(torch.bfloat16)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def largest_folder_mb(folder: Path, stop: threading.Event, found: list[float]) -> None:
    """Sample the size of ``folder`` (the runs' ``.progress``) every half second: its largest is the resume cost."""
    while not stop.is_set():
        try:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        except OSError:  # a file renamed or removed while we looked
            size = 0
        found.append(size / 2**20)
        time.sleep(0.5)


def run_pair(name: str, work: Path) -> dict:
    kind, recipe, overrides, ranks = PAIRS[name]
    model = model_folder(kind, work)
    runs, log = work / f"runs-{name}", work / f"{name}.log"
    rss = [work / f"{name}.rss{rank}" for rank in range(ranks)]
    time_prefix = ["/usr/bin/time", "-f", "%M", "-o"]
    args = ["run", f"recipe={recipe}", f"model={model}", *COMMON, *overrides, f"output.dir={runs}"]
    if ranks == 1:
        command = [*time_prefix, str(rss[0]), sys.executable, "-m", "compress", *args]
    else:  # each rank under its own GNU time: a wrapper script picks the file by LOCAL_RANK
        wrapper = work / f"{name}-rank.sh"
        wrapper.write_text(
            f'#!/bin/sh\nexec /usr/bin/time -f %M -o {work}/{name}.rss$LOCAL_RANK {sys.executable} -m compress "$@"\n'
        )
        wrapper.chmod(0o755)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   "--no-python", str(wrapper), *args]  # fmt: skip
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), COMPRESS_ARTIFACTS=str(work))
    stop, sizes = threading.Event(), []
    watcher = threading.Thread(target=largest_folder_mb, args=(runs / ".progress", stop, sizes))
    watcher.start()
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    wall = time.perf_counter() - start
    stop.set()
    watcher.join()
    text = log.read_text()
    if code != 0:
        raise SystemExit(f"{name}: exit {code}; see {log}")
    [report_file] = runs.glob("*/report.json")
    report = json.loads(report_file.read_text())
    predicted = parse_plan(text)
    measured = {
        "host_ram_mb": max(int(path.read_text().split()[-1]) / 1024 for path in rss),
        "disk_mb": report["checkpoint"]["size_mb"] + max(sizes, default=0.0),
        "seconds": report["wall_time_s"],
        "compress_s": report["timings_s"].get("compress", 0.0),
        "process_wall_s": wall,
    }
    return {"model": kind, "recipe": recipe, "overrides": overrides, "ranks": ranks, "predicted": predicted,
            "measured": measured}  # fmt: skip


def parse_plan(text: str) -> dict:
    """The numbers of the plan the run printed first."""
    ram = re.search(r"peak host RAM (\d+) MB", text)
    disk = re.search(r"disk: (\d+) MB", text)
    times = re.search(r"wall time ~(\d+) s: (.*)", text)
    if not (ram and disk and times):
        raise SystemExit("the run printed no plan")
    phases = {name: float(s) for name, s in re.findall(r"(\w+) (\d+) s", times.group(2))}
    return {"host_ram_mb": float(ram.group(1)), "disk_mb": float(disk.group(1)), "seconds": float(times.group(1)),
            "compress_s": phases.get("compress", 0.0)}  # fmt: skip


def ratio(row: dict, key: str) -> float:
    return row["predicted"][key] / row["measured"][key] if row["measured"][key] else float("nan")


def markdown(result: dict) -> str:
    lines = [
        "# The plan against the run",
        "",
        f"{result['machine']}; {result['date']}. Command: `{result['command']}`. Each row: one `compress run` in a "
        "fresh process; predicted = the plan that process printed first, measured = GNU time's peak RSS (the largest "
        "rank under torchrun), checkpoint + largest resume progress folder, the pipeline's wall time (report.json). "
        "Ratio = predicted / measured. Goal: RAM and disk within 0.8-1.2, time within 0.5-1.5. Common overrides: "
        f"`{' '.join(COMMON)}`.",
        "",
        "| pair | overrides | RAM MB plan / run | ratio | disk MB plan / run | ratio | time s plan / run | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["pairs"].items():
        p, m = row["predicted"], row["measured"]
        lines.append(
            f"| {name} | `{' '.join(row['overrides'])}` | {p['host_ram_mb']:.0f} / {m['host_ram_mb']:.0f} | "
            f"{ratio(row, 'host_ram_mb'):.2f} | {p['disk_mb']:.0f} / {m['disk_mb']:.0f} | {ratio(row, 'disk_mb'):.2f} "
            f"| {p['seconds']:.0f} / {m['seconds']:.0f} | {ratio(row, 'seconds'):.2f} |"
        )
    within = {key: sum(lo <= ratio(r, key) <= hi for r in result["pairs"].values())
              for key, lo, hi in (("host_ram_mb", 0.8, 1.2), ("disk_mb", 0.8, 1.2), ("seconds", 0.5, 1.5))}  # fmt: skip
    total = len(result["pairs"])
    lines += [
        "",
        f"Within the goal: RAM {within['host_ram_mb']}/{total}, disk {within['disk_mb']}/{total}, "
        f"time {within['seconds']}/{total}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    result = {
        "command": "python -m benchmarks.plan_vs_actual " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "pairs": {},
    }
    with tempfile.TemporaryDirectory(prefix="plan-vs-actual-") as work:
        for name in args.only:
            print(f"{name} ...", flush=True)
            result["pairs"][name] = run_pair(name, Path(work))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "plan-vs-actual.json").write_text(json.dumps(result, indent=2))
            (args.out / "plan-vs-actual.md").write_text(markdown(result))
            print(next(line for line in markdown(result).splitlines() if line.startswith(f"| {name} ")), flush=True)


if __name__ == "__main__":
    main()
