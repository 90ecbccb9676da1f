"""Score checkpoints already on disk against the fp32 default model, as ``benchmarks/quality.py`` scores a recipe.

    python -m benchmarks.score_checkpoints autoround_int4=<folder> gptq_int4=<folder> --name autoround-int4-vs-gptq

For runs compressed elsewhere (``benchmarks/compress_time.py`` keeps its checkpoints): each one reloaded from disk and
scored with the same protocol (512-token windows) on the out-of-domain headline (2% of Shakespeare) and the in-domain
held-out pydoc split, beside the baseline scored in the same invocation. Writes ``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.peer_comparison import checkpoint_size_mb
from benchmarks.quality import score, scored_baseline

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("out_of_domain", "in_domain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="LABEL=FOLDER, one per checkpoint")
    parser.add_argument("--name", required=True, help="results file stem under benchmarks/results/")
    parser.add_argument("--title", default="Checkpoints scored on the default model")
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from compress.checkpoint import load_checkpoint

    pairs = [item.split("=", 1) for item in args.checkpoints]
    if any(len(pair) != 2 or not Path(pair[1]).is_dir() for pair in pairs):
        raise SystemExit("each checkpoint is LABEL=FOLDER, with an existing folder")
    _, ids, report = scored_baseline("python -m benchmarks.score_checkpoints", args.max_windows)
    report.pop("samples")
    report.update(title=args.title, rows={})
    for label, folder in pairs:
        model, _ = load_checkpoint(Path(folder))
        report["rows"][label] = {**score(model, ids, args.max_windows), "size_mb": checkpoint_size_mb(Path(folder))}
        del model
        print(f"{label}: {json.dumps(report['rows'][label])}", flush=True)
        write(args, report)  # after every checkpoint: a stopped invocation keeps what it scored
    print((args.results / f"{args.name}.md").read_text())


def write(args: argparse.Namespace, report: dict) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    base = report["baseline"]
    lines = [
        f"# {args.title}",
        "",
        f"Model `{report['model']}` (fp32). Perplexity by `evals/perplexity.py`, 512-token windows: out-of-domain = "
        f"{base['out_of_domain']['tokens']} scored tokens of Shakespeare, in-domain = {base['in_domain']['tokens']} "
        f"held-out pydoc tokens. {report['machine']}, {torch.get_num_threads()} torch threads; {report['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| checkpoint | out-of-domain ppl | ratio | in-domain ppl | ratio | size MB |",
        "|---|---|---|---|---|---|",
        f"| baseline (fp32) | {base['out_of_domain']['perplexity']:.3f} | 1.000x | "
        f"{base['in_domain']['perplexity']:.3f} | 1.000x | - |",
    ]
    for label, row in report["rows"].items():
        ratio = {text: row[text]["perplexity"] / base[text]["perplexity"] for text in TEXTS}
        lines.append(
            f"| `{label}` | {row['out_of_domain']['perplexity']:.3f} | {ratio['out_of_domain']:.3f}x | "
            f"{row['in_domain']['perplexity']:.3f} | {ratio['in_domain']:.3f}x | {row['size_mb']:.1f} |"
        )
    (args.results / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
