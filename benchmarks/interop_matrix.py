"""Interop matrix: every shipped recipe's checkpoint of the default model, loaded by transformers (logits against our
own reader's) and by vLLM's CPU build (accepted? generated?), written to ``docs/interop.md``.

    python -m benchmarks.interop_matrix --vllm-python /work/vllm-venv/bin/python
    python -m benchmarks.interop_matrix --recipes rtn_int4 fp8_dynamic --output /tmp/interop.md   # a few rows

1. Each recipe (``recipes/*.yaml`` but ``_base``) compresses the default model through ``compress.oneshot`` with small
   calibration (``QUICK``: 8 windows of 128 tokens of pydoc text, no sampling, 2 distillation steps, 2 SignRound
   iterations; the merge recipes a small random LoRA adapter): interop depends on the format, not on quality. A
   checkpoint already under ``--workdir`` (default ``<artifacts>/interop/<recipe>``) is reused (the writer renames a
   folder in only when complete), and so is a row of ``--json`` measured on the same checkpoint (not with ``--fresh``).
2. transformers: ``AutoModelForCausalLM.from_pretrained`` (bf16 for FP4 formats: compressed-tensors decompresses them
   to bf16, so our reader's model runs in bf16 too) against ``compress.checkpoint.load_checkpoint`` on ``PROMPTS``:
   max abs and relative (‖Δ‖/‖ours‖) logit difference, and how often both pick the same next token.
3. vLLM: ``benchmarks/interop_vllm.py`` in a subprocess of ``--vllm-python``, from a temporary folder outside the
   repository, one recipe at a time with a ``--timeout``; without ``--vllm-python`` (or when it cannot import vLLM)
   the vLLM columns say so. A refusal's message is the root cause in the engine's stderr, not the wrapper's.
4. ``docs/interop.md``: date, versions, CPU, one row per recipe; the measured rows also go to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.interop_report import cpu_model, format_row, local_versions, render, summary, vllm_versions

ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = ROOT / "recipes"
VLLM_SCRIPT = Path(__file__).resolve().parent / "interop_vllm.py"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
QUICK = ["data.num_samples=8", "data.seq_len=128", "data.generated=0.0", "gate=none"]
STAGE_QUICK = {  # stage type -> overrides that keep it to seconds; the stage list and every format choice stay
    "distill": {"steps": 2, "seq_len": 64, "batch_size": 1, "held_out": 1},
    "signround": {"iterations": 2, "batch_size": 2},
}
# rough cost of a stage on the default model: the recipes run cheapest first, so a --deadline leaves the slow ones
STAGE_COST = {"fp8": 0, "kv_cache": 1, "rtn": 1, "smoothquant": 1, "lora_merge": 1, "rotate": 1, "w8a8": 2}
SLOW_STAGE_COST = {"gptq": 3, "sparsegpt": 3, "distill": 4, "awq": 5, "signround": 8}
RESULT_MARK = "INTEROP_RESULT "
# what vLLM logs once the weights are in: the config was accepted even when a later forward fails
LOADED = re.compile(r"Loading weights took|Model loading took|load_model.*took")
ERROR_LINE = re.compile(r"^(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$")
GENERIC = ("Engine core initialization failed", "See root cause above", "EngineCore failed")


def recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml") if not path.name.startswith("_"))


def recipe_stages(recipe: str) -> list[dict]:
    import yaml

    return yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["stages"]


def cheapest_first(names: list[str]) -> list[str]:
    costs = {**STAGE_COST, **SLOW_STAGE_COST}
    return sorted(names, key=lambda name: (sum(costs.get(stage["type"], 3) for stage in recipe_stages(name)), name))


def quick_overrides(recipe: str, adapter: Path | None) -> list[str]:
    """The recipe's command-line overrides for a quick checkpoint: sizes only, and the adapter a merge asks for."""
    overrides = list(QUICK)
    for index, stage in enumerate(recipe_stages(recipe)):
        overrides += [f"stages.{index}.{key}={value}" for key, value in STAGE_QUICK.get(stage["type"], {}).items()]
        if stage["type"] == "lora_merge":
            if adapter is None:
                raise SystemExit(f"{recipe} merges a LoRA adapter: give one")
            overrides.append(f"stages.{index}.adapters=[{adapter}]")
    return overrides


def small_adapter(model_dir: Path, folder: Path, rank: int = 4, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter on every layer's q_proj and v_proj, small enough to leave the model sane."""
    from compress.stages.lora import save_adapter

    if (folder / "adapter_config.json").is_file():
        return folder
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    outputs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, width in outputs.items():
            a = torch.randn(rank, config["hidden_size"], generator=generator) * 0.01
            b = torch.randn(width, rank, generator=generator) * 0.01
            factors[f"model.layers.{layer}.self_attn.{name}"] = (a, b)
    return save_adapter(folder, factors, rank=rank, alpha=2 * rank)


def make_checkpoint(recipe: str, folder: Path, adapter: Path | None) -> tuple[bool, float]:
    """``(made now, seconds)``; an existing folder is reused (the writer only renames complete ones in)."""
    from compress import oneshot

    if (folder / "config.json").is_file():
        return False, 0.0
    start = time.perf_counter()
    oneshot("smollm2-135m", recipe, overrides=quick_overrides(recipe, adapter), output_dir=folder)
    return True, time.perf_counter() - start


def checkpoint_format(folder: Path) -> str:
    """``quantization_config.format`` (+ the KV cache's dtype, + 2:4 when ``sparsity.json`` says so), or dense."""
    config = json.loads((folder / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    parts = [quantization.get("format") or "dense"]
    kv = quantization.get("kv_cache_scheme")
    if kv:
        parts.append(f"KV {kv.get('type', '')}{kv.get('num_bits', '')}")
    sparsity = folder / "sparsity.json"
    if sparsity.is_file():
        parts.append(json.loads(sparsity.read_text()).get("sparsity_structure", "sparse"))
    return " + ".join(parts)


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]


def compare_logits(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> dict:
    """Max abs and relative (‖Δ‖/‖ours‖) difference over all prompts' logits, and the share of same argmax."""
    mine, other = (
        torch.cat([t.reshape(-1, t.shape[-1]) for t in ours]),
        torch.cat([t.reshape(-1, t.shape[-1]) for t in theirs]),
    )
    return {
        "max_abs": (mine - other).abs().max().item(),
        "relative": ((mine - other).norm() / mine.norm()).item(),
        "same_top1": (mine.argmax(-1) == other.argmax(-1)).float().mean().item(),
    }


def prompt_logits(model, tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(tokenizer(p, return_tensors="pt").input_ids).logits.float() for p in prompts]


def in_bfloat16(model: torch.nn.Module) -> None:
    """Our reader's model run in bf16, as transformers runs FP4 checkpoints (compressed-tensors decompresses FP4
    weights to bf16 and has no fp32 path): the floating parameters cast, the buffers (packed codes, fp8/e8m0 and
    global scales, rotary frequencies) kept. Compared in fp32 against bf16, W4A4's activation rounding turns the
    bf16 rounding into whole FP4 steps: 0.24 (nvfp4) and 0.56 (mxfp4) relative logits on the default model."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(torch.bfloat16)


def transformers_check(folder: Path, prompts: list[str] = PROMPTS) -> dict:
    """Load ``folder`` with transformers and with our reader, and compare their logits on ``prompts``."""
    from transformers import AutoModelForCausalLM

    from compress.checkpoint import load_checkpoint

    fp4 = "fp4" in checkpoint_format(folder)
    result = {"loaded": False, "ran": False, "dtype": "bfloat16" if fp4 else "auto", "error": None}
    try:
        ours, tokenizer = load_checkpoint(folder)
        if fp4:
            in_bfloat16(ours)
        reference = prompt_logits(ours, tokenizer, prompts)
        del ours
    except Exception as error:  # noqa: BLE001 - our reader failing is a row to show, not a crash of the matrix
        result["error"] = f"our reader: {one_line(error)}"
        return result
    try:
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if fp4 else "auto").eval()
        result["loaded"] = True
        result.update(compare_logits(reference, prompt_logits(theirs, tokenizer, prompts)))
        result["ran"] = True
    except Exception as error:  # noqa: BLE001 - a failure is the outcome we record
        result["error"] = one_line(error)
    gc.collect()
    return result


def root_cause(stderr: str, fallback: str | None) -> str | None:
    """The most specific ``SomeError: message`` line in the engine's stderr (the last one not a generic wrapper)."""
    found = [
        f"{m.group(1)}: {m.group(2).strip()}" for line in stderr.splitlines() if (m := ERROR_LINE.match(line.strip()))
    ]
    specific = [line for line in found if not any(generic in line for generic in GENERIC)]
    if specific:
        return specific[-1][:300]
    message = fallback or (found[-1] if found else None)
    return message[:300] if message else None


def text_of(stream: str | bytes | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def vllm_outcome(stdout: str, stderr: str, returncode: int | None, timeout: float) -> dict:
    """The last result line of ``interop_vllm.py`` (``returncode`` None: killed at ``timeout``), its error replaced
    by the most specific one in stderr; accepted also when the log shows the weights loaded."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    result = json.loads(lines[-1][len(RESULT_MARK) :]) if lines else {"accepted": False, "generated": False}
    result.setdefault("text", None)
    result["accepted"] = bool(result.get("accepted")) or bool(LOADED.search(stderr))
    if returncode is None:
        step = "generating" if result["accepted"] else "building the engine"
        result["error"] = f"timed out after {timeout:.0f} s {step}"
    elif not lines:
        result["error"] = root_cause(stderr, f"exit {returncode} without a result")
    elif result.get("error"):
        result["error"] = root_cause(stderr, result["error"])
    return result


def vllm_check(vllm_python: str | None, folder: Path, timeout: float, prompt: str = PROMPTS[0]) -> dict:
    """Run ``interop_vllm.py`` on ``folder`` with the vLLM venv's python from a folder outside the repository."""
    if vllm_python is None:
        return {"accepted": None, "generated": None, "text": None, "error": "vLLM not installed"}
    start = time.perf_counter()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempfile.TemporaryDirectory(prefix="interop-vllm-") as cwd:
        command = [vllm_python, str(VLLM_SCRIPT), str(folder), "--prompt", prompt]
        try:
            done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            result = vllm_outcome(done.stdout, done.stderr, done.returncode, timeout)
        except subprocess.TimeoutExpired as expired:
            result = vllm_outcome(text_of(expired.stdout), text_of(expired.stderr), None, timeout)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def fingerprint(folder: Path) -> str:
    """config.json and every file's name and size: a checkpoint made again gets a new one."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.iterdir()):
        digest.update(f"{path.name}:{path.stat().st_size};".encode())
    return digest.hexdigest()[:16]


def reusable(previous: dict, recipe: str, folder: Path, vllm_python: str | None) -> dict | None:
    """An earlier run's row for the same checkpoint and the same vLLM, or None."""
    row = previous.get(recipe)
    if not row or "fingerprint" not in row or not (folder / "config.json").is_file():
        return None
    return row if row["fingerprint"] == fingerprint(folder) and row.get("vllm_python") == vllm_python else None


def merged(measured: list[dict], previous: dict[str, dict], previous_cpu: str | None = None) -> list[dict]:
    """This run's rows, plus --json's rows of shipped recipes it did not measure (``--recipes`` fills in some), each
    with the CPU it was measured on (``previous_cpu``: that of the run that wrote --json, for rows that lack one)."""
    asked = {row["recipe"] for row in measured}
    kept = [
        {**row, "cpu": row.get("cpu", previous_cpu)}
        for recipe, row in previous.items()
        if recipe not in asked and recipe in recipes()
    ]
    return sorted(measured + kept, key=lambda row: row["recipe"])


def measure(recipe: str, workdir: Path, adapter: Path | None, vllm_python: str | None, timeout: float) -> dict:
    """One row: the checkpoint (made or reused), the transformers check, the vLLM check."""
    folder = workdir / recipe
    row: dict = {"recipe": recipe}
    try:
        made, seconds = make_checkpoint(recipe, folder, adapter)
        row["checkpoint_seconds"] = round(seconds, 1) if made else None
    except Exception as error:  # noqa: BLE001 - a recipe that cannot make its checkpoint is a row to show
        row["checkpoint_error"] = one_line(error)
        return row
    gc.collect()
    row["fingerprint"], row["vllm_python"] = fingerprint(folder), vllm_python
    row["measured"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    row["cpu"] = cpu_model()  # vLLM's CPU kernels differ by machine
    row["format"] = checkpoint_format(folder)
    row["transformers"] = transformers_check(folder)
    row["vllm"] = vllm_check(vllm_python, folder, timeout)
    return row


def usable_vllm(vllm_python: str | None) -> str | None:
    if vllm_python is not None and not Path(vllm_python).is_file():
        print(f"--vllm-python {vllm_python} does not exist: vLLM columns say 'not installed'", file=sys.stderr)
        return None
    return vllm_python


def main(argv: list[str] | None = None) -> None:
    from compress.base.paths import artifacts_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (../shared/README.md); none: skip vLLM")
    parser.add_argument("--recipes", nargs="*", help="these recipes only (default: every shipped one)")
    parser.add_argument("--workdir", type=Path, help="checkpoints, made or reused (default <artifacts>/interop)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one recipe's vLLM check")
    parser.add_argument("--deadline-minutes", type=float, help="start no recipe after this; the rest say 'not run'")
    parser.add_argument("--fresh", action="store_true", help="measure again rows --json has for the same checkpoint")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "interop.md")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "interop.json")
    args = parser.parse_args(argv)
    names = args.recipes or recipes()
    unknown = sorted(set(names) - set(recipes()))
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; shipped: {recipes()}")
    from compress.model.sources import default_model_dir

    workdir = (args.workdir or artifacts_dir() / "interop").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    adapter = small_adapter(default_model_dir(), workdir / "_adapter")
    vllm_python = usable_vllm(args.vllm_python)
    saved = json.loads(args.json.read_text()) if args.json.is_file() else {}
    previous = {row["recipe"]: row for row in saved.get("rows", [])}  # --fresh measures again, still keeps the rest
    rows, start = [], time.monotonic()
    for recipe in cheapest_first(names):
        if not args.fresh and (row := reusable(previous, recipe, workdir / recipe, vllm_python)) is not None:
            rows.append(row)
            continue
        if args.deadline_minutes is not None and time.monotonic() - start > 60 * args.deadline_minutes:
            rows.append({"recipe": recipe, "skipped": f"--deadline-minutes {args.deadline_minutes:g} ran out"})
            continue
        print(f"[interop] {recipe} ...", file=sys.stderr, flush=True)
        rows.append(measure(recipe, workdir, adapter, vllm_python, args.timeout))
        print(f"[interop] {format_row(rows[-1])}", file=sys.stderr, flush=True)
    rows = merged(rows, previous, saved.get("meta", {}).get("cpu"))
    command = "python -m benchmarks.interop_matrix" + (" --vllm-python " + args.vllm_python if args.vllm_python else "")
    if args.recipes:
        command += " --recipes " + " ".join(args.recipes)
    if args.fresh:
        command += " --fresh"
    if args.timeout != 300:
        command += f" --timeout {args.timeout:g}"
    if args.deadline_minutes is not None:
        command += f" --deadline-minutes {args.deadline_minutes:g}"
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "versions": local_versions(),
        "vllm": vllm_versions(vllm_python),
        "command": command,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)  # the measurements first: the page is made from them
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.output.write_text(render(rows, meta, QUICK, PROMPTS))
    print(f"{summary(rows)} -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
