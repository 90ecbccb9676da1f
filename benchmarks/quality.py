"""Quality of every headline recipe on the default model, on text it was not calibrated on and on text it was.

    python -m benchmarks.quality                                   # the README's recipes, full evaluation texts
    python -m benchmarks.quality --recipes rtn_int4 gptq_int4 --max-windows 8

Each recipe compresses the default model with ``compress.oneshot`` (the recipe's own calibration: 64 x 512 tokens of
the pydoc calibration split); each checkpoint, reloaded from disk, and the fp32 baseline are scored by
``evals/perplexity.py`` with the run's protocol (512-token windows) on two texts: the out-of-domain headline (the
run's default ``eval.data``: 2% of Shakespeare's works) and the in-domain held-out split of the calibration source
(pydoc). Prints and writes ``benchmarks/results/quality-recipes.{json,md}``; each ratio is to the baseline of the same
text, measured in the same run. ``benchmarks/quality_table.py`` joins it with the other measurements into quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PANEL_TEXTS = ("code", "technical")  # out-of-domain texts beside Shakespeare, keys of compress.base.data.domain_panel
RECIPES = ["rtn_int4", "awq_int4", "gptq_int4", "rotate_gptq_int4", "smoothquant_gptq_w8a8", "fp8_dynamic"]


def texts(tokenizer, panel: bool = False) -> dict[str, torch.Tensor]:
    """Token ids of the texts a checkpoint is scored on: the out-of-domain headline (Shakespeare) and the in-domain
    held-out pydoc split; with ``panel``, also the gate's other out-of-domain kinds (``code``: the standard library's
    source, ``technical``: its docstrings), so one text does not decide a ranking alone."""
    from compress.base.data import DataSpec, domain_panel, load_corpus, out_of_domain, tokenize

    found = {"out_of_domain": tokenize(tokenizer, load_corpus(out_of_domain()).evaluation_text)}
    if panel:
        others = {kind: spec for kind, spec in domain_panel().items() if kind in PANEL_TEXTS}
        found |= {kind: tokenize(tokenizer, load_corpus(spec).evaluation_text) for kind, spec in others.items()}
    return {**found, "in_domain": tokenize(tokenizer, load_corpus(DataSpec()).evaluation_text)}


def score(model, ids: dict[str, torch.Tensor], max_windows: int | None) -> dict[str, dict]:
    from compress.evals.perplexity import perplexity

    results = {}
    for name, tokens in ids.items():
        result = perplexity(model, tokens, 512, 4, max_windows, progress=False)
        results[name] = {"perplexity": result.perplexity, "tokens": result.tokens}
    return results


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``; else ``platform.processor()``): a time-capped stage's steps,
    and the windows a model samples itself, follow the processor, which ``machine`` does not name."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def scored_baseline(
    command: str, max_windows: int | None, model_name: str = "smollm2-135m", panel: bool = False
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """``(model folder, token ids of both texts, the report's header with the fp32 baseline's scores)``; the
    header keeps the recipes' calibration ids (``samples``: 64 x 512 tokens of pydoc, seed 0, as a run cuts them),
    for a peer toolkit to calibrate on the same tokens."""
    from compress.base.data import DataSpec, load_corpus
    from compress.model.calibration_set import calibration_set
    from compress.model.sources import ModelSpec, load, resolve_model_path

    model_dir = Path(resolve_model_path(ModelSpec(path=model_name)))
    model, tokenizer = load(ModelSpec(path=model_name, lazy=False))
    ids = texts(tokenizer, panel)
    spec = DataSpec()
    samples = calibration_set(model, tokenizer, load_corpus(spec).calibration_text, spec, seed=0)  # as a run cuts them
    report = {
        "model": model_dir.name,
        "tokens": {name: int(tokens.numel()) for name, tokens in ids.items()},
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        "threads": torch.get_num_threads(),  # scoring's, and the compressing subprocesses' (same environment)
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([command, *(shlex.quote(a) for a in sys.argv[1:])]),
        "baseline": score(model, ids, max_windows),
    }
    return model_dir, ids, {**report, "samples": samples}


def markdown(report: dict) -> str:
    lines = [
        "# Quality on the default model: out-of-domain (headline) and in-domain",
        "",
        f"Model `{report['model']}` (fp32); each recipe as shipped (64 x 512 calibration tokens of pydoc). "
        f"Perplexity by `evals/perplexity.py`, 512-token windows: out-of-domain = "
        f"{report['baseline']['out_of_domain']['tokens']} scored tokens of Shakespeare (the run's default "
        f"`eval.data`), in-domain = {report['baseline']['in_domain']['tokens']} scored held-out tokens of the "
        f"calibration source. {report['machine']}; {report['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| recipe | out-of-domain ppl | ratio | in-domain ppl | ratio | size MB | compress s |",
        "|---|---|---|---|---|---|---|",
    ]
    base = report["baseline"]
    lines.append(
        f"| baseline (fp32) | {base['out_of_domain']['perplexity']:.3f} | 1.000x | "
        f"{base['in_domain']['perplexity']:.3f} | 1.000x | - | - |"
    )
    for recipe, row in report["recipes"].items():
        ratios = {name: row[name]["perplexity"] / base[name]["perplexity"] for name in ("out_of_domain", "in_domain")}
        lines.append(
            f"| `{recipe}` | {row['out_of_domain']['perplexity']:.3f} | {ratios['out_of_domain']:.3f}x | "
            f"{row['in_domain']['perplexity']:.3f} | {ratios['in_domain']:.3f}x | {row['size_mb']:.1f} | "
            f"{row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--max-windows", type=int, default=None, help="cap evaluation windows (default: all)")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from compress import oneshot
    from compress.checkpoint import load_checkpoint

    model_dir, ids, report = scored_baseline("python -m benchmarks.quality", args.max_windows)
    report.pop("samples")
    report["recipes"] = {}
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        for recipe in args.recipes:
            start = time.perf_counter()
            folder = oneshot(model=str(model_dir), recipe=recipe, output_dir=str(Path(tmp) / recipe), device="cpu")
            seconds = time.perf_counter() - start
            compressed, _ = load_checkpoint(folder)
            size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e6
            report["recipes"][recipe] = {
                **score(compressed, ids, args.max_windows),
                "size_mb": size,
                "seconds": seconds,
            }
            del compressed
            print(f"{recipe}: {json.dumps(report['recipes'][recipe])}", flush=True)
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / "quality-recipes.json").write_text(json.dumps(report, indent=2))
            (args.results / "quality-recipes.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
