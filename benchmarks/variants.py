"""Recipes and their variants side by side on the default model: quality against wall time, in one invocation.

    python -m benchmarks.variants gptq_int4 autoround_int4 "autoround_int4 stages.0.iterations=80" --name signround-int4
    python -m benchmarks.variants gptq_int3 "gptq_int3 stages.0.input_correction=true" --name gptq-input-correction

    python -m benchmarks.variants gptq_int4 llm-compressor:gptq_w4a16 awq_int4 --model gemma3-270m --name quality-gemma

Each positional argument is one run: a recipe name, then any overrides (``key=value``, as on the CLI). Every run
compresses the model (``--model``, default the default model) through ``compress.oneshot`` in a subprocess of its own,
one after the other, so wall times (load, calibrate, quantize, save) and peak RSS (GNU time, as
``benchmarks/peer_comparison.measured_run``) are comparable; the first run is the time reference.
``llm-compressor:<scheme>`` runs that preset of ``benchmarks/peer_llmcompressor.py`` on the same calibration ids, the
same way (``seed=N``,
``data.generated=X`` and ``data.num_samples=N`` after it give the peer the windows our run with those overrides cuts
or samples): with
``artifacts/peer-venv/bin/python`` when that venv exists, else with this Python and ``artifacts/peer-site`` on the
path (``pip install --target artifacts/peer-site --no-deps llmcompressor==0.14.0.1 compressed-tensors loguru``).
Every checkpoint is reloaded and scored like
``benchmarks/quality.py``, on the panel: the out-of-domain headline (Shakespeare), the gate's code and technical
texts, and in-domain pydoc. Writes ``benchmarks/results/<name>.{json,md}``
after every run, replacing the file a former invocation of that name wrote; calibration draws of a recipe or a peer
preset gather in one resumable file with ``benchmarks.quality_draws`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.peer_comparison import checkpoint_size_mb, measured_run
from benchmarks.quality import score, scored_baseline
from benchmarks.quality_rows import TEXT_LABELS

ROOT = Path(__file__).resolve().parents[1]
PEER = "llm-compressor:"


OURS = (
    "import sys; from compress import oneshot; "
    "oneshot(model=sys.argv[1], output_dir=sys.argv[2], recipe=sys.argv[3], overrides=sys.argv[4:])"
)


def our_command(recipe: str, overrides: list[str], model_dir: Path, output: Path) -> list[str]:
    return [sys.executable, "-c", OURS, str(model_dir), str(output), recipe, *overrides]


def peer_command(scheme: str, model_dir: Path, samples: torch.Tensor, output: Path) -> list[str]:
    """llm-compressor's ``scheme`` on ``samples``, written to ``output``: its venv's Python when there is one (this
    tree on its path: the script records the windows' digest as our checkpoints do), else this Python with
    ``artifacts/peer-site`` ahead of this tree on the path."""
    samples_file = output.with_suffix(".samples.pt")
    torch.save(samples, samples_file)
    venv = ROOT / "artifacts" / "peer-venv" / "bin" / "python"
    script = ["--scheme", scheme, "--model", str(model_dir), "--samples", str(samples_file), "--output", str(output)]
    if venv.exists():
        return ["env", f"PYTHONPATH={ROOT}", str(venv), str(ROOT / "benchmarks" / "peer_llmcompressor.py"), *script]
    path = f"PYTHONPATH={ROOT / 'artifacts' / 'peer-site'}{os.pathsep}{ROOT}"
    return ["env", path, sys.executable, str(ROOT / "benchmarks" / "peer_llmcompressor.py"), *script]


PEER_OVERRIDES = ("seed", "data.generated", "data.num_samples")  # what decides a run's calibration ids


def peer_options(overrides: list[str], takes: tuple[str, ...] = PEER_OVERRIDES) -> tuple[int, float, int]:
    """``(seed, data.generated, data.num_samples)`` of a peer run's overrides; a key outside ``takes`` is refused
    before any run starts."""
    from compress.base.data import DataSpec

    options = dict(override.split("=", 1) for override in overrides)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(f"a peer run takes only {', '.join(takes)}; got {', '.join(unknown)}")
    default = DataSpec()
    generated = float(options.get("data.generated", default.generated))
    return int(options.get("seed", 0)), generated, int(options.get("data.num_samples", default.num_samples))


def peer_samples(model_name: str, seed: int, generated: float, num_samples: int) -> torch.Tensor:
    """The calibration ids our run cuts (and samples) with ``seed=seed data.generated=generated
    data.num_samples=num_samples``."""
    from compress.base.data import DataSpec, load_corpus
    from compress.model.calibration_set import calibration_set
    from compress.model.sources import ModelSpec, load

    model, tokenizer = load(ModelSpec(path=model_name, lazy=False))
    spec = DataSpec(generated=generated, num_samples=num_samples)
    return calibration_set(model, tokenizer, load_corpus(spec).calibration_text, spec, seed)


def run_command(
    recipe: str, overrides: list[str], model: str, model_dir: Path, folder: Path, shared: torch.Tensor | None = None
) -> list[str]:
    """The command compressing one run into ``folder``: our recipe, or llm-compressor's preset on the calibration ids
    our run with the same settings cuts (``shared``: those of the default settings, when already cut)."""
    if not recipe.startswith(PEER):
        return our_command(recipe, overrides, model_dir, folder)
    options = peer_options(overrides)
    samples = shared if shared is not None and options == peer_options([]) else peer_samples(model, *options)
    return peer_command(recipe.removeprefix(PEER), model_dir, samples, folder)


def compress_and_score(
    command: list[str], folder: Path, ids: dict[str, torch.Tensor], max_windows: int | None, timeout: float
) -> dict:
    """One run's row: ``command`` compresses into ``folder`` (wall time, peak RSS), then the reloaded checkpoint is
    scored on ``ids``; a failed run's row holds its error, so the runs after it still go ahead."""
    from compress.checkpoint import load_checkpoint

    run = measured_run(command, folder.with_suffix(".log"), timeout=timeout)
    if not run["ok"]:
        return {"error": run["error"], "seconds": run["wall_s"]}
    compressed, _ = load_checkpoint(folder)
    row = {**score(compressed, ids, max_windows), "seconds": run["wall_s"], "peak_rss_mb": run["peak_rss_mb"]}
    return {**row, "size_mb": checkpoint_size_mb(folder), **stage_facts(folder), **calibration_facts(folder)}


def stage_facts(folder: Path) -> dict:
    """``{"stages": {"0:gptq": {key: value}}}``: the plain values of each stage's summary (steps taken, losses,
    held-out KL), from the checkpoint's ``stages.json``, so a row says what its stages did; per-layer detail is left
    in the checkpoint. Empty for a checkpoint without one (a peer's)."""
    path = folder / "stages.json"
    if not path.is_file():
        return {}
    plain = (int, float, str, bool)
    stages = json.loads(path.read_text()).items()
    return {"stages": {name: {k: v for k, v in found.items() if isinstance(v, plain)} for name, found in stages}}


def calibration_facts(folder: Path) -> dict:
    """``{"calibration_sha256": ...}``: the digest of the windows the checkpoint was calibrated on, from its
    ``calibration.json`` (ours, or a peer's written by ``benchmarks/peer_llmcompressor.py``), so two draws of one
    seed are known to be paired; empty without one (a draw older than the record)."""
    from compress.base.data import CALIBRATION_FILE

    path = folder / CALIBRATION_FILE
    return {"calibration_sha256": json.loads(path.read_text())["token_sha256"]} if path.is_file() else {}


def _row(name: str, row: dict, base: dict, reference_seconds: float) -> str:
    if "error" in row:
        return f"| `{name}` | failed: {row['error'][:200]} |" + " |" * (2 * len(base) + 3)
    cells = " | ".join(
        f"{row[text]['perplexity']:.3f} | {row[text]['perplexity'] / base[text]['perplexity']:.3f}x" for text in base
    )
    return (
        f"| `{name}` | {cells} | {row['seconds']:.0f} | {row['seconds'] / reference_seconds:.1f}x | "
        f"{_optional(row, 'peak_rss_mb')} | {_optional(row, 'size_mb')} |"
    )


def _optional(row: dict, key: str) -> str:
    """Rows measured before a column existed show a dash."""
    return f"{row[key]:.0f}" if key in row else "-"


def command_lines(report: dict) -> list[str]:
    """A variants file is one invocation's; a draws file grows over many, and each row names its own, so a row can be
    measured again by the command that measured it rather than by the latest one."""
    by_command: dict[str | None, list[str]] = {}
    for name, row in report["rows"].items():
        by_command.setdefault(row.get("command"), []).append(name)
    if set(by_command) <= {None}:
        return [f"Command: `{report['command']}`"]
    lines = ["Commands, each with the runs it measured (a row's own is its `command` in the JSON):", ""]
    recorded = [(command, names) for command, names in by_command.items() if command]
    lines += [f"- `{command}`: {_runs(len(names))} ({', '.join(names)})" for command, names in recorded]
    if None in by_command:
        lines.append(
            "- not recorded (rows measured before a row named its command; each row's `date` is in the JSON): "
            + _runs(len(by_command[None]))
        )
    return lines


def _runs(count: int) -> str:
    return f"{count} run" + ("s" if count != 1 else "")


def markdown(report: dict) -> str:
    rows = report["rows"]
    reference = next(iter(rows))
    base = report["baseline"]
    scored = ", ".join(f"{TEXT_LABELS.get(text, text)} {found['tokens']}" for text, found in base.items())
    lines = [
        f"# {report['title']}",
        "",
        f"Model `{report['model']}` (fp32), each recipe's own calibration (64 x 512 tokens of pydoc unless "
        "`data.num_samples` says otherwise, the share "
        f"`data.generated` of them sampled from the model itself, its time in compress s; a peer's preset gets the "
        "same ids). Perplexity: 512-token windows; out of domain: Shakespeare (the headline) and, where scored, the "
        "gate's code (the standard library's source) and technical (its docstrings) texts; in domain: held-out "
        f"pydoc. Scored tokens: {scored}. Time ratio against `{reference}`, measured in the same invocation. "
        f"{report['machine']}, torch threads {report.get('threads', 'not recorded')}; {report['date']}.",
        "",
        *command_lines(report),
        "",
        "| run | "
        + " | ".join(f"{TEXT_LABELS.get(text, text)} ppl | ratio" for text in base)
        + " | compress s | time vs first | peak RSS MB | size MB |",
        "|---|" + "---|---|" * len(base) + "---|---|---|---|",
        "| baseline (fp32) | "
        + " | ".join(f"{found['perplexity']:.3f} | 1.000x" for found in base.values())
        + " | - | - | - | - |",
    ]
    lines += [_row(name, row, base, rows[reference]["seconds"]) for name, row in rows.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help='"RECIPE [key=value ...]", one per run; the first is the reference')
    parser.add_argument("--title", default="Recipe variants: quality against wall time")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds one compression may take")
    parser.add_argument("--model", default="smollm2-135m", help="model= of every run (default: the default model)")
    parser.add_argument("--name", required=True, help="results file stem under benchmarks/results/")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    runs = [(run, run.split()[0], run.split()[1:]) for run in args.runs]
    for run, recipe, overrides in runs:  # a bad peer setting is refused before any run
        if recipe.startswith(PEER):
            try:
                peer_options(overrides)
            except ValueError as error:
                raise SystemExit(f"{run}: {error}") from None
    model_dir, ids, report = scored_baseline("python -m benchmarks.variants", args.max_windows, args.model, panel=True)
    samples = report.pop("samples")
    report.update(title=args.title, rows={})
    args.results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="variants-") as tmp:
        for index, (name, recipe, overrides) in enumerate(runs):
            folder = Path(tmp) / str(index)
            command = run_command(recipe, overrides, args.model, model_dir, folder, samples)
            report["rows"][name] = compress_and_score(command, folder, ids, args.max_windows, args.timeout)
            print(f"{name}: {json.dumps(report['rows'][name])}", flush=True)
            (args.results / f"{args.name}.json").write_text(json.dumps(report, indent=2))
            (args.results / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
