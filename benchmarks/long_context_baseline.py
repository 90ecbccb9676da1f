"""Which long-context tasks the gate can judge on the default model: each task's baseline accuracy, its Wilson 95%
interval and its chance level (``compress.evals.long_context.chance``), with the default preset's lengths and trials.

    python benchmarks/long_context_baseline.py          # writes benchmarks/results/long-context-baseline.{json,md}

A task is judged when the interval's low end lies above its chance level (the gate's rule, ``checks.at_chance``).
The prompts are the gate's own: its evaluation text as filler, its seed, its backend choice.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.commands.gate import evaluation_texts, load_policy
    from compress.evals import generation
    from compress.evals.gate.policy import resolve_policy
    from compress.evals.gate.stats import proportion_interval
    from compress.evals.long_context import evaluate_long_context
    from compress.model.sources import default_model_dir

    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    raw = load_policy("default", [])
    texts = evaluation_texts(raw)
    policy = resolve_policy(raw)
    folder = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    filler = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    backend = generation.choose_backend(policy.backend)
    generator = generation.make_generator(backend, model, tokenizer, None, dataclasses.asdict(policy.engine))
    lc = policy.long_context
    started = time.perf_counter()
    result = evaluate_long_context(generator, tokenizer, filler, lc.context_lengths, lc.tasks, lc.trials, policy.seed)
    tasks = {}
    for task in lc.tasks:
        outcomes = [o for o, item in zip(result["outcomes"], result["items"], strict=True) if item["task"] == task]
        interval = proportion_interval(outcomes, policy.confidence)
        chance = result["per_task_chance"][task]
        tasks[task] = {
            "right": sum(outcomes),
            "items": len(outcomes),
            "low": interval.low,
            "high": interval.high,
            "chance": chance,
            "judged": interval.low > chance,
        }
    report = {
        "model": Path(folder).name,
        "backend": backend,
        "lengths": lc.context_lengths,
        "trials": lc.trials,
        "seconds": round(time.perf_counter() - started, 1),
        "tasks": tasks,
    }
    lines = [
        "# Long-context tasks on the default model: judged or not",
        "",
        f"`{report['model']}`, backend `{backend}`, lengths {lc.context_lengths}, {lc.trials} trials each (the default",
        "preset). A task is judged when its baseline's Wilson 95% interval lies above its chance level.",
        "",
        "| task | right | interval | chance | judged |",
        "|---|---|---|---|---|",
    ]
    for task, row in tasks.items():
        lines.append(
            f"| {task} | {row['right']}/{row['items']} | {row['low']:.0%}–{row['high']:.0%} | {row['chance']:.2g} | "
            f"{'yes' if row['judged'] else 'no'} |"
        )
    lines += ["", "```bash", "python benchmarks/long_context_baseline.py", "```"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long-context-baseline.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (RESULTS / "long-context-baseline.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
