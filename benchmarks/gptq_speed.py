"""GPTQ and SparseGPT wall time: compress at an earlier commit, compress now, llm-compressor, back to back.

    python benchmarks/gptq_speed.py --baseline-rev 4b4734f                  # W4A16 g64, 64 x 512 tokens
    python benchmarks/gptq_speed.py --schemes gptq_w4a16 sparsegpt_2of4 smoothquant_w8a8 --max-windows 16

The machine is shared, so only numbers taken minutes apart compare: every row here compresses the same model on
the same calibration ids (``benchmarks/peer_comparison.py``'s subprocess protocol: wall time and peak RSS of load +
calibrate + quantize + save, GNU time) and is scored by ``evals/perplexity.py``. The baseline commit runs from a
``git archive`` of that commit in a temporary folder, and so does the current commit (HEAD). Results:
``benchmarks/results/gptq-speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.peer_comparison import PEER_PYTHON, SCHEMES, checkpoint_size_mb, evaluate, measured_run  # noqa: E402
from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize  # noqa: E402
from compress.model.sources import ModelSpec, load, resolve_model_path  # noqa: E402


def export(rev: str, folder: Path) -> Path:
    """The tree of commit ``rev`` (its benchmarks/peer_compress.py and compress package)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def markdown(report: dict) -> str:
    lines = [
        "# GPTQ and SparseGPT wall time: compress before / after, llm-compressor",
        "",
        f"Model `{report['model']}`; {report['num_samples']}x{report['seq_len']} calibration tokens, the same ids "
        f"for every row; perplexity by `evals/perplexity.py` on {report['eval_tokens']} evaluation tokens "
        f"(fp32 baseline {report['baseline_perplexity']:.4f}). {report['machine']}; run {report['date']}, rows "
        "measured back to back in this order. Wall time and peak RSS: the compression subprocess (load + "
        "calibrate + quantize + save).",
        "",
        f"Command: `{report['command']}`",
        "",
        "| scheme | toolkit | wall s | peak RSS MB | perplexity | size MB | wall / llm-compressor |",
        "|---|---|---|---|---|---|---|",
    ]
    for scheme, rows in report["schemes"].items():
        peer = rows.get("llm-compressor", {})
        for toolkit, entry in rows.items():
            if not entry.get("ok"):
                lines.append(f"| {scheme} | {toolkit} | – | – | – | – | {entry.get('error', 'not run')} |")
                continue
            ratio = f"{entry['wall_s'] / peer['wall_s']:.2f}x" if peer.get("ok") else ""
            lines.append(
                f"| {scheme} | {toolkit} | {entry['wall_s']:.1f} | {entry['peak_rss_mb']:.0f} | "
                f"{entry['perplexity']:.4f} | {entry['size_mb']:.1f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=["gptq_w4a16"], choices=list(SCHEMES))
    parser.add_argument("--baseline-rev", help="also time compress at this commit")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None, help="cap evaluation windows (default: all)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} missing: see benchmarks/peer_comparison.py")
    model_dir = Path(resolve_model_path(ModelSpec()))
    model, tokenizer = load(ModelSpec(lazy=False))
    corpus = load_corpus(DataSpec(num_samples=args.num_samples, seq_len=args.seq_len))
    samples = calibration_samples(tokenize(tokenizer, corpus.calibration_text), args.num_samples, args.seq_len, 0)
    eval_ids = tokenize(tokenizer, corpus.evaluation_text)
    from compress.evals.perplexity import perplexity

    baseline = perplexity(model, eval_ids, args.seq_len, 4, args.max_windows, progress=False)
    del model
    report = {
        "model": str(model_dir),
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "eval_tokens": baseline.tokens,
        "baseline_perplexity": baseline.perplexity,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, shared with other jobs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python " + " ".join([Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(), *sys.argv[1:]]),
        "schemes": {},
    }
    with tempfile.TemporaryDirectory(prefix="gptq-speed-") as tmp:
        work = Path(tmp)
        torch.save(samples, work / "samples.pt")
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True)
        # the current commit runs from an export too: edits to the working tree during the run change nothing
        compress_trees = {f"compress@{head.stdout.decode().strip()}": export("HEAD", work / "head")}
        if args.baseline_rev:
            compress_trees = {
                f"compress@{args.baseline_rev}": export(args.baseline_rev, work / "base"),
                **compress_trees,
            }
        for scheme in args.schemes:
            rows = report["schemes"].setdefault(scheme, {})
            runs = [(label, tree, [sys.executable, str(tree / "benchmarks" / "peer_compress.py"), "--recipe",
                                   SCHEMES[scheme]]) for label, tree in compress_trees.items()]  # fmt: skip
            runs.append(("llm-compressor", ROOT, [str(PEER_PYTHON), str(ROOT / "benchmarks" / "peer_llmcompressor.py"),
                                                  "--scheme", scheme]))  # fmt: skip
            for label, tree, command in runs:
                output = work / f"{scheme}-{label}"
                command = [
                    *command,
                    "--model",
                    str(model_dir),
                    "--samples",
                    str(work / "samples.pt"),
                    "--output",
                    str(output),
                ]
                entry = measured_run(command, work / f"{scheme}-{label}.log", args.timeout, tree)
                if entry["ok"]:
                    entry["size_mb"] = checkpoint_size_mb(output)
                    entry.update(evaluate(output, eval_ids, args.seq_len, args.max_windows))
                rows[label] = entry
                print(f"{scheme:18s} {label:22s} {json.dumps(entry)}", flush=True)
                args.results.mkdir(parents=True, exist_ok=True)
                (args.results / "gptq-speed.json").write_text(json.dumps(report, indent=2))
                (args.results / "gptq-speed.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
