"""The headline `compress run` end to end on a random Llama-3-8B-shaped model: wall time, peak host and GPU memory
per phase (sample, compress, save, evaluate, gate) for awq_int4, fp8_dynamic and gptq_int4, in one short GPU call.

    bash benchmarks/gpu_session.sh e2e                 # on a GPU machine, with the wheels of fetch_e2e_wheels.sh
    python -m benchmarks.gpu_e2e                       # the same, without the shell script
    python -m benchmarks.gpu_e2e --tiny --device cpu --out /tmp/e2e   # a tiny shape on CPU: checks it end to end

The model (bf16, Llama-3-8B shapes from benchmarks/gpu_compress.py, the byte-level tokenizer of
benchmarks/peak_rss.py) is built on the device in a child process, then each recipe runs as a user runs it,
``python -m compress run recipe=<r> model=<folder> device=<d> ...``, in a fresh process with an empty artifacts
folder (no cached calibration windows, no cached gate references). Phase times, torch's peak GPU allocation per
phase and each phase's span come from the run's own ``report.json`` (``compress.app.run_report.Timer``); this script
samples the child's host RSS (psutil) and the device's used memory (NVML) every 50 ms and attributes each sample to the
phase whose span holds it. This process never imports torch: a child's peak RSS starts from its parent's.

Settings, chosen to fit three runs in one GPU call of <= 8 minutes (``--budget``, each run cut at what is left):
calibration at ``--samples`` x ``--seq-len`` (default 32 x 512; awq_int4 samples them from the model, gptq_int4
cuts them from pydoc, fp8_dynamic reads none), the perplexity passes on ``--eval-windows`` windows of 512 tokens
of the in-domain text (``eval.data=null``: the out-of-domain Shakespeare text is a download the GPU box cannot
make), ``gate=quick`` (long_context without frequent_words, which the byte tokenizer cannot answer in its token
budget; lm_eval only when the ``lm_eval`` package imports; a 2 GB KV pool for the generation layers on a GPU),
MLflow tracking off (not installed there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("awq_int4", "fp8_dynamic", "gptq_int4")  # the goal's recipe first: a call cut short has measured it
GROUPS = {  # what the issue names a phase -> the run's own phases (compress.app.pipeline)
    "sample": ("sample",),
    "compress": ("compress",),
    "save": ("save",),
    "evaluate": ("eval_baseline", "eval_candidate", "eval_reference"),
    "gate": ("gate",),
    "load": ("data", "load_model"),
}


def build_model(folder: Path, tiny: bool, layers: int | None, device: str) -> dict:
    """Run in a child (``--build-into``): the random bf16 model saved to ``folder``, and what it ran on."""
    import torch
    import transformers

    from benchmarks.gpu_compress import LLAMA3_8B, TINY, device_name
    from benchmarks.peak_rss import save_random_llama

    shape = dict(TINY if tiny else LLAMA3_8B)
    if layers:
        shape["num_hidden_layers"] = layers
    start = time.perf_counter()
    params = save_random_llama(folder, shape, torch.bfloat16, device=device)
    return {
        "shape": shape,
        "params": params,
        "weights_gb": sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9,
        "build_s": time.perf_counter() - start,
        "device_name": device_name(torch.device(device)),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


class Sampler(threading.Thread):
    """Host RSS of a process, and the GPU's used memory (NVML, when there is one), every
    ``interval`` seconds, stamped with epoch time like the run's phase spans."""

    def __init__(self, pid: int, gpu_index: int | None, interval: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.process, self.interval = psutil.Process(pid), interval
        self.samples: list[tuple[float, float, float | None]] = []
        self.stopped = threading.Event()
        self.nvml = _nvml_handle(gpu_index)

    def run(self) -> None:
        import psutil

        while not self.stopped.is_set():
            try:  # the run process alone: a child it forks shares its pages until the exec (a sum counts them twice)
                rss = self.process.memory_info().rss / 2**20
            except psutil.Error:  # exited
                rss = None
            gpu = self.nvml[0].nvmlDeviceGetMemoryInfo(self.nvml[1]).used / 2**20 if self.nvml else None
            if rss is not None:
                self.samples.append((time.time(), rss, gpu))
            self.stopped.wait(self.interval)

    def peaks(self, start: float = 0.0, end: float = float("inf")) -> tuple[float | None, float | None]:
        """``(host MB, GPU MB)``: the largest samples taken between ``start`` and ``end``."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        host = max((s[1] for s in inside), default=None)
        gpu = max((s[2] for s in inside if s[2] is not None), default=None)
        return host, gpu


def _nvml_handle(index: int | None):
    if index is None:
        return None
    try:
        import pynvml  # nvidia-ml-py, in the GPU image

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: torch's own per-phase peaks from the report remain
        return None


def lm_eval_probe(env: dict) -> subprocess.Popen:
    """Whether the gate's accuracy layer can run here (the GPU image lacks lm-eval unless its wheels are carried):
    a child importing it, started beside the model's build; its exit status answers."""
    probe = "import lm_eval, lm_eval.models.huggingface, lm_eval.tasks"
    quiet = subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=quiet, stderr=quiet)


def run_overrides(args: argparse.Namespace, with_lm_eval: bool) -> list[str]:
    overrides = [
        f"device={args.device}",
        "tracking.enabled=false",
        "eval.data=null",
        f"eval.max_windows={args.eval_windows}",
        f"data.num_samples={args.samples}",
        f"data.seq_len={args.seq_len}",
        f"gate={args.gate}",
    ]
    if args.gate != "none":
        overrides.append("gate.long_context.tasks=[variable_tracking,multi_key]")
        overrides += [] if with_lm_eval else ["gate.lm_eval.enabled=false"]
        if args.device.startswith("cuda"):  # quick's 64 MB KV pool (sized for a CPU) holds 512 tokens of an 8B model,
            overrides.append("gate.engine.kv_cache_memory_gb=2")  # less than its max_model_len of 1024: refused
    return overrides + list(args.extra)


def measure(recipe: str, model: Path, overrides: list[str], work: Path, env: dict, timeout: float, gpu) -> dict:
    """One ``compress run`` in a fresh process: its report's phases with the sampled peaks of each."""
    runs = work / f"runs-{recipe}"
    command = [sys.executable, "-m", "compress", "run", f"recipe={recipe}", f"model={model}", *overrides]
    command.append(f"output.dir={runs}")
    env = dict(env, COMPRESS_ARTIFACTS=str(work / f"artifacts-{recipe}"))  # nothing cached from an earlier run
    log = work / f"{recipe}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )  # fmt: skip
        sampler = Sampler(process.pid, gpu)
        sampler.start()
        try:
            code = process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            code = process.wait()
        sampler.stopped.set()
        sampler.join()
    row = {"command": " ".join(["python", *command[1:]]), "exit_code": code, "process_s": time.perf_counter() - start}
    host, device = sampler.peaks()
    row.update(peak_host_sampled_mb=host, peak_gpu_device_mb=device, log=str(log))
    reports = sorted(runs.glob("*/report.json"))
    if not reports:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        row["error"] = ("timed out: " if code == -9 else f"exit {code}: ") + " | ".join(line[:300] for line in tail)
        return row
    report = json.loads(reports[-1].read_text())
    phases = {}
    for name, began, ended in report["phase_spans"]:
        phase = phases.setdefault(name, {"seconds": 0.0, "peak_host_mb": None, "peak_gpu_device_mb": None})
        phase["seconds"] += ended - began
        host, device = sampler.peaks(began, ended)
        phase["peak_host_mb"] = _max(phase["peak_host_mb"], host)
        phase["peak_gpu_device_mb"] = _max(phase["peak_gpu_device_mb"], device)
        phase["peak_gpu_torch_mb"] = report.get("peak_gpu_mb", {}).get(name)
    groups = {}
    for group, members in GROUPS.items():
        present = [phases[m] for m in members if m in phases]
        if present:
            groups[group] = {
                "seconds": sum(p["seconds"] for p in present),
                **{k: _max(*(p.get(k) for p in present)) for k in ("peak_host_mb", "peak_gpu_device_mb")},
                "peak_gpu_torch_mb": _max(*(p.get("peak_gpu_torch_mb") for p in present)),
            }
    gate = report.get("gate") or {}
    row.update(
        run_wall_s=report["wall_time_s"],
        peak_rss_mb=report["peak_rss_mb"],
        phases=phases,
        groups=groups,
        calibration_tokens=report["data"]["calibration_tokens"],
        generated_tokens=report["data"].get("generated_tokens", 0),
        evaluation_tokens=report["data"]["evaluation_tokens"],
        checkpoint_mb=report["checkpoint"]["size_mb"],
        verdict=gate.get("verdict"),
        stages={  # each stage's own seconds; AWQ with GPTQ rounding also says which part was the rounding
            name: {key: summary[key] for key in ("seconds", "rounding_seconds") if key in summary}
            for name, summary in report.get("stages", {}).items()
        },
    )
    shutil.rmtree(runs, ignore_errors=True)  # the checkpoint: gigabytes on the GPU box's disk
    return row


def _max(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _mb(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def markdown(result: dict) -> str:
    model = result["model"]
    lines = [
        f"# `compress run` end to end on a random {result['shape_name']} ({model['device_name']})",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{model['params'] / 1e9:.2f} B parameters ({model['shape']['num_hidden_layers']} layers), bf16 safetensors "
        f"{model['weights_gb']:.1f} GB, built on {result['device']} in {model['build_s']:.0f} s; "
        f"torch {model['versions']['torch']}, transformers {model['versions']['transformers']}. Every run: "
        f"`{' '.join(result['overrides'])}`.",
        "",
        "Seconds and peaks per phase: seconds from the run's report; host = the run process's RSS, GPU (device) = "
        "the card's used memory (NVML), both sampled every 50 ms; GPU (torch) = torch's peak allocation in the phase. "
        "`load` is the corpus and the lazy model load; a run's process also spends time before its first phase.",
    ]
    for recipe, row in result["recipes"].items():
        lines += ["", f"## {recipe}", ""]
        if "error" in row:
            lines.append(f"failed after {row['process_s']:.0f} s: {row['error']}")
            continue
        lines += [
            f"Run wall {row['run_wall_s']:.1f} s (process {row['process_s']:.1f} s), peak RSS {row['peak_rss_mb']:.0f} "
            f"MB, peak GPU (device) {_mb(row['peak_gpu_device_mb'])} MB; {row['calibration_tokens']} calibration "
            f"tokens ({row['generated_tokens']} sampled), {row['evaluation_tokens']} evaluation tokens, checkpoint "
            f"{row['checkpoint_mb']:.0f} MB, gate {row['verdict']}.",
            "",
            "| phase | seconds | peak host MB | peak GPU MB (device) | peak GPU MB (torch) |",
            "|---|---|---|---|---|",
        ]
        for name, group in row["groups"].items():
            lines.append(
                f"| {name} | {group['seconds']:.1f} | {_mb(group['peak_host_mb'])} | "
                f"{_mb(group['peak_gpu_device_mb'])} | {_mb(group['peak_gpu_torch_mb'])} |"
            )
        for name, stage in row.get("stages", {}).items():
            rounding = stage.get("rounding_seconds")
            split = "" if rounding is None else f" (GPTQ rounding {rounding:.1f} s, the rest its own search)"
            lines.append(f"\nStage `{name}`: {stage.get('seconds', 0.0):.1f} s{split}.")
    goal = result["recipes"].get("awq_int4", {})
    if "run_wall_s" in goal and result["device"] != "cpu":
        met = "met" if goal["process_s"] <= 600 else "not met"
        lines += ["", f"Goal: the whole awq_int4 run <= 10 minutes on one H100: {goal['process_s']:.0f} s, "
                  f"{met} (on {model['device_name']}, at the settings above)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU in seconds)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--eval-windows", type=int, default=8, help="512-token windows per perplexity pass")
    parser.add_argument("--gate", default="quick", help="gate preset: quick, default, full or none")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script; runs cut there")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results; none for --tiny)")
    parser.add_argument("--logs", type=Path, help="keep each run's log here")
    parser.add_argument("--build-into", type=Path, help=argparse.SUPPRESS)  # the model-building child
    parser.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.build_into:
        print(json.dumps(build_model(args.build_into, args.tiny, args.layers, args.device)))
        return 0
    began = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    gpu = None
    if args.device.startswith("cuda"):
        gpu = int(args.device.partition(":")[2] or 0)
    out = args.out or (None if args.tiny else REPO / "benchmarks" / "results")
    with tempfile.TemporaryDirectory(prefix="gpu-e2e-") as tmp:
        work, model_dir = Path(tmp), Path(tmp) / "model"
        build = [sys.executable, "-m", "benchmarks.gpu_e2e", "--build-into", str(model_dir), "--device", args.device]
        build += ["--tiny"] * args.tiny + (["--layers", str(args.layers)] if args.layers else [])
        probe = lm_eval_probe(env)
        built = subprocess.run(build, env=env, cwd=REPO, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"building the model failed: {(built.stderr.strip() or 'no output').splitlines()[-1]}")
        model = json.loads(built.stdout.strip().splitlines()[-1])
        with_lm_eval = probe.wait() == 0 and args.gate != "none"
        overrides = run_overrides(args, with_lm_eval)
        result = {
            "command": "python -m benchmarks.gpu_e2e " + " ".join(sys.argv[1:] if argv is None else argv),
            "shape_name": "tiny Llama" if args.tiny else "Llama-3-8B shape",
            "device": args.device,
            "model": model,
            "overrides": overrides,
            "lm_eval_layer": with_lm_eval,
            "recipes": {},
        }
        print(f"model: {model['params'] / 1e9:.2f} B params, built in {model['build_s']:.0f} s", flush=True)
        for recipe in args.recipes.split(","):
            left = args.budget - (time.perf_counter() - began)
            if left < 10:
                result["recipes"][recipe] = {"error": "not run: the budget was spent", "process_s": 0.0}
                continue
            row = measure(recipe, model_dir, overrides, work, env, left, gpu)
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(row["log"], args.logs / f"gpu-e2e-{recipe}.log")
            result["recipes"][recipe] = row
            print(f"{recipe}: {row.get('run_wall_s', row['process_s']):.1f} s {row.get('error', '')}", flush=True)
            if out is not None:  # after every run: a call cut short keeps the runs that finished
                out.mkdir(parents=True, exist_ok=True)
                name = f"gpu-e2e-{slug(model['device_name'])}"
                (out / f"{name}.json").write_text(json.dumps(result, indent=2))
                (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all("error" not in row for row in result["recipes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
