"""One table of every recipe's quality and cost, per model, assembled from the measured result files.

    python -m benchmarks.quality_table            # the files in SOURCES → benchmarks/results/quality.{md,json}
    python -m benchmarks.quality_table --sources int3 quality-formats --name quality-int3

No recipe runs here. The measurements come from ``benchmarks/quality.py`` and ``benchmarks/variants.py``, each of
which scores its fp32 baseline and its checkpoints in one invocation; a row's ratios are to the baseline of its own
file, so rows from different invocations (or different ``--max-windows``) are never divided by each other's baseline.
Where a run was measured in several files, the latest measurement is kept. Each row names its file and date, so the
command that produced it is one click away; wall time and peak RSS are only comparable within one file (one CPU
state), which is why peers are measured beside ours in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = [  # oldest first; a later file's row replaces an earlier one of the same model and run
    "quality-recipes",
    "signround-int4",
    "self-calibration",
    "int3",
    "gptq-input-correction-int4",
    "gptq-vs-llmcompressor-seeds",
    "quality-gemma3-270m",
    "quality-formats",
    "quality-nvfp4",
    "quality-nvfp4-peer",
    "gemma3-270m-seeds",
    "quality-awq-gptq",
    "gemma3-270m-awq-gptq",
    "awq-gptq-sampled-seed1",
    "int3-signround",
    "gemma3-270m-formats",
    "gemma3-270m-awq-peer",
    "gemma3-270m-awq-gptq-peer",
    "gemma3-270m-awq-peer-seeds",
    "quality-nvfp4-awq-sampled",
]
PEER = "llm-compressor:"
# llm-compressor's presets beside the recipe they compete with (benchmarks/peer_comparison.SCHEMES, reversed)
ORDER = [
    ("rtn_int4", "rtn_w4a16"),
    ("awq_int4", "awq_w4a16"),
    ("awq_int4", "awq_gptq_w4a16"),  # the peer chain nearest awq_int4 (AWQ scales, GPTQ rounding)
    ("gptq_int4", "gptq_w4a16"),
    ("autoround_int4", None),
    ("rotate_gptq_int4", "spinquant_gptq_w4a16"),
    ("gptq_int3", "gptq_w3a16"),
    ("rotate_gptq_int3", None),
    ("smoothquant_gptq_w8a8", "smoothquant_w8a8"),
    ("fp8_dynamic", "fp8_dynamic"),
    ("fp8_block", "fp8_block"),
    ("nvfp4a16", "nvfp4a16"),
    ("nvfp4", "nvfp4"),
    ("mxfp4", "mxfp4"),
]
TEXTS = ("out_of_domain", "in_domain")
# A recipe whose shipped settings changed: its date, the overrides that give back what it ran with before, and the
# settings it ships with now. A row measured before the change is shown with the first (those the row does not set
# itself: `data.generated=...` keeps its own data); overrides that spell what ships now are dropped from any row.
SAMPLED = ["data=sampled", "data.generated=1.0"]  # data: sampled is pydoc's group with every window generated
CHANGED = {
    "rotate_gptq_int4": ("2026-11-26 19:00", ["data=pydoc"], SAMPLED),
    "awq_int4": ("2026-11-26 22:30", ["stages.0.rounding=rtn", "data=pydoc"], ["stages.0.rounding=gptq", *SAMPLED]),
    "rotate_gptq_int3": ("2026-11-26 22:30", ["data=pydoc"], SAMPLED),
    "autoround_int4": (  # SignRound refining GPTQ, before AutoRound as published (min/max scales, from RTN)
        "2026-11-27 13:00",
        ["stages.0.init=gptq", "stages.0.iterations=40", "stages.0.batch_size=4", "stages.0.lr=0.005"]
        + ["stages.0.tune_clip=false", "data.num_samples=64", "data.seq_len=512"],
        ["stages.0.init=rtn"],
    ),
}
# A run spelled as overrides of one recipe that another recipe ships (after CHANGED): shown under the shipped name.
SHIPPED_AS = {"rotate_gptq_int4 data=pydoc stages.1.bits=3": "rotate_gptq_int3 data=pydoc"}


def measured_rows(sources: list[str], results: Path) -> dict[str, dict[str, dict]]:
    """``{model: {run: row}}``, each row with its two ratios, costs, and the file and date it comes from."""
    models: dict[str, dict[str, dict]] = {}
    for stem in sources:
        path = results / f"{stem}.json"
        if not path.is_file():
            continue
        stored = json.loads(path.read_text())
        for report in stored.get("invocations", [stored]):  # a file may join several invocations
            base = report["baseline"]
            for run, row in (report.get("rows") or report.get("recipes") or {}).items():
                if "error" in row:
                    continue
                entry = {f"{text}_ratio": row[text]["perplexity"] / base[text]["perplexity"] for text in TEXTS}
                entry.update({key: row.get(key) for key in ("seconds", "peak_rss_mb", "size_mb")})
                entry.update(source=stem, date=report["date"], scored_tokens=base["out_of_domain"]["tokens"])
                models.setdefault(report["model"], {})[as_measured(run, report["date"])] = entry
    return models


def as_measured(run: str, date: str) -> str:
    """``run`` spelled against today's recipes: a row measured before its recipe changed gets the overrides that
    give back the settings it ran with; overrides equal to what the recipe ships now are left out."""
    recipe, *overrides = run.split()
    changed_at, then, now = CHANGED.get(recipe, ("", [], []))
    own = {override.split("=")[0] for override in overrides}

    def overridden(key: str) -> bool:  # the row sets it, or a key inside it (data.generated=1.0 sets data)
        return any(mine == key or mine.startswith(f"{key}.") for mine in own)

    if date < changed_at:
        overrides = [override for override in then if not overridden(override.split("=")[0])] + overrides
    spelled = " ".join([recipe, *(override for override in overrides if override not in now)])
    return SHIPPED_AS.get(spelled, spelled)


def _rank(run: str) -> tuple[int, int, str]:
    """Our recipe, then its variants (seeds, overrides), then the peer preset it competes with."""
    is_peer, recipe = run.startswith(PEER), run.removeprefix(PEER).split()[0]
    for index, (ours, peer) in enumerate(ORDER):
        if recipe == (peer if is_peer else ours):  # preset and recipe may share a name (fp8_dynamic, nvfp4a16)
            return index, int(is_peer), run
    return len(ORDER), int(is_peer), run


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(models: dict[str, dict[str, dict]], command: str) -> str:
    lines = [
        "# Quality and cost of every recipe, per model",
        "",
        "Assembled from the measured files named in each row (no run happens in this step): perplexity ratio to the "
        "fp32 baseline of the same file, out-of-domain (Shakespeare, the headline) and in-domain (pydoc's held-out "
        "split, the calibration source: it flatters every recipe). `llm-compressor:` rows are llm-compressor 0.14's "
        "preset on the same calibration ids, measured in the same invocation as our row above it. Wall time and peak "
        "RSS (the compressing process: load, calibrate, quantize, save) compare only within one file; a dash is a "
        "figure that file did not record.",
        "",
        f"Command: `{command}`",
    ]
    for model, rows in models.items():
        lines += [
            "",
            f"## {model}",
            "",
            f"Scored tokens per text: {', '.join(sorted({str(row['scored_tokens']) for row in rows.values()}))} "
            "(out-of-domain; a figure below the full text's comes from a `--max-windows` run).",
            "",
            "| run | out-of-domain | in-domain | compress s | peak RSS MB | size MB | measured in |",
            "|---|---|---|---|---|---|---|",
        ]
        for run in sorted(rows, key=_rank):
            row = rows[run]
            lines.append(
                f"| `{run}` | {row['out_of_domain_ratio']:.3f}x | {row['in_domain_ratio']:.3f}x | "
                f"{_cell(row['seconds'])} | {_cell(row['peak_rss_mb'])} | {_cell(row['size_mb'], 1)} | "
                f"[{row['source']}]({row['source']}.md), {row['date']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", nargs="+", default=SOURCES, help="result file stems, oldest first")
    parser.add_argument("--name", default="quality", help="output file stem")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    models = measured_rows(args.sources, args.results)
    command = " ".join(["python -m benchmarks.quality_table", *(shlex.quote(a) for a in sys.argv[1:])])
    (args.results / f"{args.name}.json").write_text(json.dumps(models, indent=2))
    (args.results / f"{args.name}.md").write_text(markdown(models, command))
    print(markdown(models, command))


if __name__ == "__main__":
    main()
