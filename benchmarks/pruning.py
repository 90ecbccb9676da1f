"""Default-model pruning measurements: 2:4 magnitude vs Wanda vs SparseGPT, what distillation recovers, the full chain.

    python -m benchmarks.pruning --part compare   # dense baseline, then magnitude / Wanda / SparseGPT 2:4
    python -m benchmarks.pruning --part chain     # LoRA merge → SparseGPT 2:4 → distill (ppl) → GPTQ int4 (ppl)

The parts run in separate processes (in parallel on a busy machine) and merge their numbers into
``benchmarks/results/pruning-<model>.{json,md}``. Each variant is compressed with ``compress.oneshot`` and
evaluated as reloaded from its checkpoint, with the perplexity protocol of evals/perplexity.py on the same evaluation
split; the dense model is evaluated once per part. The chain's LoRA adapter is a
freshly initialised PEFT adapter (B = 0, as peft creates it): the merge is an exact no-op on the weights, so the
perplexities compare with the compare part, and its cost is still paid.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from compress import oneshot
from compress.base.data import DataSpec, calibration_samples, load_corpus, tokenize
from compress.checkpoint import load_checkpoint
from compress.evals.perplexity import perplexity
from compress.model.sources import default_model_dir, load
from compress.stages.lora import save_adapter

RESULTS = Path(__file__).parent / "results"
CPU = torch.device("cpu")
GPTQ = {"type": "gptq", "bits": 4, "group_size": 64, "symmetric": True}


def fresh_adapter(folder: Path, config, rank: int = 8) -> Path:
    """A PEFT-initialised adapter on q/v: A random, B zero."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    factors = {}
    for index in range(config.num_hidden_layers):
        for name, out_features in (("q_proj", config.hidden_size), ("v_proj", config.num_key_value_heads * head_dim)):
            a = torch.randn(rank, config.hidden_size, generator=generator) / config.hidden_size**0.5
            factors[f"model.layers.{index}.self_attn.{name}"] = (a, torch.zeros(out_features, rank))
    return save_adapter(folder, factors, rank, alpha=2 * rank)


class Bench:
    def __init__(self, args, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.model_dir = default_model_dir()
        self.model, tokenizer = load(self.model_dir, lazy=False)
        corpus = load_corpus(DataSpec())
        self.eval_ids = tokenize(tokenizer, corpus.evaluation_text)
        calibration = tokenize(tokenizer, corpus.calibration_text)
        self.samples = calibration_samples(calibration, args.num_samples, 512, seed=0)
        self.settings = {
            "calibration": f"{args.num_samples} x 512 tokens (pydoc calibration split)",
            "evaluation": f"{args.max_windows or 'all'} windows x 512 tokens (pydoc evaluation split)",
            "sequential": args.sequential,
        }

    def ppl(self, model, label: str) -> float:
        return perplexity(model, self.eval_ids, 512, 4, self.args.max_windows, label=label).perplexity

    def compress(self, label: str, chain: list[dict]) -> tuple[float, dict]:
        """``compress.oneshot`` of the default model with ``chain``, then the perplexity of the checkpoint as
        reloaded from disk; returns it with each stage's summary."""
        checkpoint = oneshot(str(self.model_dir), chain, data=self.samples, output_dir=self.workdir / label)
        model, _ = load_checkpoint(checkpoint)
        return self.ppl(model, label), json.loads((checkpoint / "stages.json").read_text())


def compare(bench: Bench) -> dict:
    runs = {"dense": {"ppl": bench.ppl(bench.model, "dense")}}
    for kind in ("magnitude_prune", "wanda", "sparsegpt"):
        args = {"type": kind} if kind == "magnitude_prune" else {"type": kind, "sequential": bench.args.sequential}
        ppl, summaries = bench.compress(kind, [args])
        [summary] = summaries.values()
        runs[kind] = {
            "ppl": ppl,
            "stage_seconds": {name: s["seconds"] for name, s in summaries.items()},
            "mean_sparsity": summary["mean_sparsity"],
            "per_layer_sparsity": summary["per_layer_sparsity"],
        }
    return runs


def chain(bench: Bench) -> dict:
    """The distilled model and the full chain are two oneshot runs (the first three stages are paid twice): the
    pruner's masks only hold within one run, so GPTQ cannot start from a reloaded distilled checkpoint."""
    adapter = fresh_adapter(bench.workdir / "adapter", bench.model.config)
    distill = {"type": "distill", "max_minutes": bench.args.distill_minutes, "steps": bench.args.distill_steps}
    distilled_chain = [
        {"type": "lora_merge", "adapters": [str(adapter)]},
        {"type": "sparsegpt", "sequential": bench.args.sequential},
        distill,
    ]
    distilled, distilled_summaries = bench.compress("distilled", distilled_chain)
    full, summaries = bench.compress(
        "full chain", [*distilled_chain, {**GPTQ, "true_sequential": bench.args.sequential}]
    )
    pruner = summaries["1:sparsegpt"]  # finalized after GPTQ: the 2:4 mask survived distillation and GPTQ
    return {
        "sparsegpt_distill": {"ppl": distilled, "distill": distilled_summaries["2:distill"]},
        "full_chain": {
            "ppl": full,
            "stage_seconds": {name: s["seconds"] for name, s in summaries.items()},
            "mean_sparsity_after_gptq": pruner["mean_sparsity"],
        },
    }


def analysis(runs: dict) -> dict:
    """The issue's goals from whatever runs are present."""
    out: dict = {}
    if {"dense", "magnitude_prune", "wanda", "sparsegpt"} <= set(runs):
        increase = {k: runs[k]["ppl"] - runs["dense"]["ppl"] for k in ("magnitude_prune", "wanda", "sparsegpt")}
        out["sparsegpt_increase_over_wanda"] = increase["sparsegpt"] / increase["wanda"]
        out["sparsegpt_increase_over_magnitude"] = increase["sparsegpt"] / increase["magnitude_prune"]
        out["goal_sparsegpt_le_0.7x_wanda"] = out["sparsegpt_increase_over_wanda"] <= 0.7
        out["goal_sparsegpt_le_0.5x_magnitude"] = out["sparsegpt_increase_over_magnitude"] <= 0.5
    if {"dense", "sparsegpt", "sparsegpt_distill"} <= set(runs):
        lost = runs["sparsegpt"]["ppl"] - runs["dense"]["ppl"]
        recovered = runs["sparsegpt"]["ppl"] - runs["sparsegpt_distill"]["ppl"]
        seconds = runs["sparsegpt_distill"]["distill"]["seconds"]
        out["distill_recovery"] = recovered / lost
        out["distill_seconds"] = seconds
        out["goal_distill_recovers_30pct_in_15min"] = recovered / lost >= 0.3 and seconds <= 15 * 60
    return out


def markdown(model: str, stored: dict) -> str:
    runs, settings = stored["runs"], stored.get("settings", {})
    dense = runs.get("dense", {}).get("ppl")
    lines = [
        f"# Pruning on `{model}`",
        "",
        "2:4 semi-structured sparsity on every decoder linear (lm_head dense). "
        + "; ".join(f"{k}: {v}" for k, v in settings.items())
        + ". Seconds are wall time on a shared, heavily loaded 2-core CPU.",
        "",
        "| run | perplexity | Δ vs dense | stage seconds |",
        "|---|---|---|---|",
    ]
    for label, r in runs.items():
        delta = f"{r['ppl'] - dense:+.3f}" if dense else "n/a"
        seconds = r.get("stage_seconds") or ({"distill": r["distill"]["seconds"]} if "distill" in r else {})
        timing = ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
        lines.append(f"| {label} | {r['ppl']:.3f} | {delta} | {timing} |")
    if stored.get("analysis"):
        lines += ["", "| measure | value |", "|---|---|"]
        for key, value in stored["analysis"].items():
            lines.append(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("compare", "chain"), required=True)
    parser.add_argument("--num-samples", type=int, default=64, help="calibration samples of 512 tokens")
    parser.add_argument("--max-windows", type=int, default=None, help="evaluation windows (default: all)")
    parser.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--distill-minutes", type=float, default=15.0)
    parser.add_argument("--distill-steps", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pruning-") as workdir:
        bench = Bench(args, Path(workdir))
        runs = compare(bench) if args.part == "compare" else chain(bench)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = default_model_dir().name
    path = RESULTS / f"pruning-{name}.json"
    stored = json.loads(path.read_text()) if path.exists() else {"runs": {}}  # the other part may have written
    stored["runs"].update(runs)
    stored["settings"] = bench.settings
    stored.setdefault("part_seconds", {})[args.part] = time.perf_counter() - start
    stored["analysis"] = analysis(stored["runs"])
    path.write_text(json.dumps(stored, indent=2))
    (RESULTS / f"pruning-{name}.md").write_text(markdown(name, stored))
    print(json.dumps(stored["analysis"], indent=2))


if __name__ == "__main__":
    main()
