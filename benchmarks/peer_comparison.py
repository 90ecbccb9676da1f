"""compress vs llm-compressor on the same model, calibration samples, machine and evaluator.

    python benchmarks/peer_comparison.py                      # every scheme, 128 x 512 calibration tokens
    python benchmarks/peer_comparison.py --schemes gptq_w4a16 --num-samples 32
    python benchmarks/peer_comparison.py --tag formats --num-samples 64 \
        --schemes fp8_block nvfp4a16 nvfp4 mxfp4 spinquant_gptq_w4a16 gptq_w4a16

Per scheme, each toolkit compresses the default model in its own subprocess (llm-compressor in
``artifacts/peer-venv``: ``python3 -m venv artifacts/peer-venv && artifacts/peer-venv/bin/pip install llmcompressor``)
reading the same calibration ids from one file; wall time and peak RSS are that subprocess's (GNU time), so both
include model load, calibration, quantization and save. Both checkpoints are then loaded by ``compress`` and scored
by ``evals/perplexity.py`` on the evaluation split of ``compress.base.data``. Results:
``benchmarks/results/peer-*.json`` and ``.md``. A peer that refuses a scheme (llm-compressor's AWQ without an
accelerator) is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize  # noqa: E402
from compress.base.signals import signals_recorded  # noqa: E402
from compress.checkpoint import load_checkpoint  # noqa: E402
from compress.evals.perplexity import perplexity  # noqa: E402
from compress.model.sources import ModelSpec, load, resolve_model_path  # noqa: E402

# scheme → (our recipe, what llm-compressor runs: see peer_llmcompressor.recipe)
SCHEMES = {
    "rtn_w4a16": "rtn_int4",
    "gptq_w4a16": "gptq_int4",
    "gptq_w4a16_mse": "gptq_int4",
    "gptq_w3a16": "gptq_int3",
    "gptq_w3a16_mse": "gptq_int3",
    "awq_w4a16": "awq_int4",
    "awq_gptq_w4a16_mse": "awq_int4",
    "smoothquant_w8a8": "smoothquant_gptq_w8a8",
    "fp8_dynamic": "fp8_dynamic",
    "fp8_block": "fp8_block",
    "nvfp4a16": "nvfp4a16",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "spinquant_gptq_w4a16": "rotate_gptq_int4",
    "sparsegpt_2of4": "prune_2of4",
}
PEER_PYTHON = ROOT / "artifacts" / "peer-venv" / "bin" / "python"


def measured_run(command: list[str], log: Path, timeout: float, tree: Path = ROOT) -> dict:
    """Wall time and peak RSS of one subprocess importing ``compress`` from ``tree``. RSS comes from GNU time
    (``%M``): the rusage a Python parent gets for an exec'd child starts from the parent's own high-water mark, which
    would charge our driver's memory to both toolkits."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = str(tree)
    rss_file = log.with_suffix(".rss")
    start = time.perf_counter()
    with log.open("w") as out, signals_recorded():
        process = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", "wall_s": timeout}
        except BaseException:  # Ctrl-C or SIGTERM to this driver: the child's own session would never hear it
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    wall = time.perf_counter() - start
    result = {"ok": code == 0, "wall_s": wall}
    if code == 0:
        result["peak_rss_mb"] = int(rss_file.read_text().split()[-1]) / 1024
    else:
        tail = log.read_text().strip().splitlines()[-3:]
        result["error"] = f"exit {code}: " + " | ".join(line.strip()[:300] for line in tail)
    return result


def checkpoint_size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def evaluate(folder: Path, eval_ids: torch.Tensor, seq_len: int, max_windows: int | None) -> dict:
    model, _ = load_checkpoint(folder)
    result = perplexity(model, eval_ids, seq_len, batch_size=4, max_windows=max_windows, progress=False)
    return {"perplexity": result.perplexity, "eval_tokens": result.tokens}


def markdown(report: dict) -> str:
    base = report["baseline_perplexity"]
    lines = [
        "# compress vs llm-compressor",
        "",
        f"Model `{report['model']}`; {report['num_samples']}x{report['seq_len']} calibration tokens (the same ids "
        f"for both); perplexity by `evals/perplexity.py` on {report['eval_tokens']} evaluation tokens, both "
        f"checkpoints loaded by `compress.checkpoint.load_checkpoint`. Baseline (fp32) perplexity {base:.4f}.",
        f"Machine: {report['machine']}; run {report['date']}. Wall time and peak RSS: the compression subprocess "
        "(load + calibrate + quantize + save), measured back to back in this run.",
        "",
        "| scheme | toolkit | perplexity | Δ vs fp32 | wall s | peak RSS MB | size MB | ours/peer wall "
        "| ours/peer RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scheme, row in report["schemes"].items():
        for toolkit in ("compress", "llm-compressor"):
            entry = row.get(toolkit, {})
            if not entry.get("ok"):
                lines.append(f"| {scheme} | {toolkit} | – | – | – | – | – | {entry.get('error', 'not run')} | |")
                continue
            ppl = entry["perplexity"]
            ratios = ["", ""]
            peer = row.get("llm-compressor", {})
            if toolkit == "compress" and peer.get("ok"):
                ratios = [
                    f"{entry['wall_s'] / peer['wall_s']:.2f}x",
                    f"{entry['peak_rss_mb'] / peer['peak_rss_mb']:.2f}x",
                ]
            lines.append(
                f"| {scheme} | {toolkit} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | {entry['wall_s']:.1f} | "
                f"{entry['peak_rss_mb']:.0f} | {entry['size_mb']:.1f} | {ratios[0]} | {ratios[1]} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--toolkits", nargs="+", default=["compress", "llm-compressor"])
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None, help="cap evaluation windows (default: all)")
    parser.add_argument("--peer-timeout", type=float, default=1800, help="seconds before a peer run is abandoned")
    parser.add_argument("--awq-peer-timeout", type=float, default=300)
    parser.add_argument("--work", type=Path, default=ROOT / "artifacts" / "peer-bench")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="latest")
    args = parser.parse_args()

    if "llm-compressor" in args.toolkits and not PEER_PYTHON.exists():
        raise SystemExit(
            f"{PEER_PYTHON} missing: python3 -m venv artifacts/peer-venv && "
            "artifacts/peer-venv/bin/pip install llmcompressor"
        )
    model_dir = Path(resolve_model_path(ModelSpec()))
    run_dir = args.work / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True)
    model, tokenizer = load(ModelSpec(lazy=False))
    spec = DataSpec(num_samples=args.num_samples, seq_len=args.seq_len)
    corpus = load_corpus(spec)
    samples = calibration_samples(tokenize(tokenizer, corpus.calibration_text), args.num_samples, args.seq_len, 0)
    eval_ids = tokenize(tokenizer, corpus.evaluation_text)
    torch.save(samples, run_dir / "samples.pt")
    baseline = perplexity(model, eval_ids, args.seq_len, 4, args.max_windows, progress=False)
    del model
    print(f"baseline perplexity {baseline.perplexity:.4f} on {baseline.tokens} tokens", flush=True)

    report = {
        "model": str(model_dir),
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "eval_tokens": baseline.tokens,
        "baseline_perplexity": baseline.perplexity,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, shared with other jobs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "schemes": {},
    }
    for scheme in args.schemes:
        row = report["schemes"].setdefault(scheme, {})
        for toolkit in args.toolkits:
            output = run_dir / f"{scheme}-{toolkit}"
            if toolkit == "compress":
                command = [sys.executable, str(ROOT / "benchmarks" / "peer_compress.py"), "--recipe", SCHEMES[scheme]]
                timeout = args.peer_timeout
            else:
                command = [str(PEER_PYTHON), str(ROOT / "benchmarks" / "peer_llmcompressor.py"), "--scheme", scheme]
                timeout = args.awq_peer_timeout if scheme == "awq_w4a16" else args.peer_timeout
            command += ["--model", str(model_dir), "--samples", str(run_dir / "samples.pt"), "--output", str(output)]
            entry = measured_run(command, run_dir / f"{scheme}-{toolkit}.log", timeout)
            if entry["ok"]:
                entry["size_mb"] = checkpoint_size_mb(output)
                try:
                    entry.update(evaluate(output, eval_ids, args.seq_len, args.max_windows))
                except Exception as error:  # a checkpoint our loader cannot read is a result, not a crash
                    entry.update(ok=False, error=f"evaluation failed: {error}"[:300])
            row[toolkit] = entry
            print(f"{scheme:18s} {toolkit:15s} {json.dumps(entry)}", flush=True)
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / f"peer-{args.tag}.json").write_text(json.dumps(report, indent=2))
            (args.results / f"peer-{args.tag}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
