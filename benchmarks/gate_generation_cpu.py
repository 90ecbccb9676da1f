"""What the gate's generation layers cost on a CPU, our engine against transformers in the same run.

    python benchmarks/gate_generation_cpu.py                     # default model, 2048-token prompt, 12 x 512 batch

Two measurements on the default model, every row in one process, back to back:

1. One long prompt (prefill-bound, as the needle and long-context layers are): 8 greedy tokens after ``--long``
   tokens, through transformers' own forward with a KV cache (the gate's ``transformers`` backend) and through
   ``compress.engine`` (the ``engine`` backend, paged KV cache, torch's fused attention on CPU).
2. ``--prompts`` distinct prompts of ``--short`` tokens: one after another through transformers, one after another
   through the engine, and all at once through the engine (``Generator.generate_batch``, what the gate now does).

Each row is the median of ``--repeats`` timings after one warm-up, every timing on new random prompts (the engine
caches prompt prefixes). Results: ``benchmarks/results/
gate-generation-cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compress.evals import generation, sides  # noqa: E402
from compress.model.sources import ModelSpec, resolve_model_path  # noqa: E402

NEW_TOKENS = 8
BACKENDS = ("transformers", "engine")


def median_seconds(work, repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--short", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = sides.load_for_eval(resolve_model_path(ModelSpec()))
    vocab = model.config.vocab_size

    def fresh(length: int, count: int = 1) -> list[list[int]]:
        """New random prompts for every timing: the engine caches prompt prefixes, so a repeated prompt is not
        prefilled again and would time nothing."""
        return [torch.randint(100, vocab, (length,)).tolist() for _ in range(count)]

    budgets = [NEW_TOKENS] * args.prompts
    transformers, engine = (generation.make_generator(name, model, tokenizer, None, {}) for name in BACKENDS)
    rows = {
        f"{args.long}-token prompt, transformers": lambda: transformers.generate(fresh(args.long)[0], NEW_TOKENS),
        f"{args.long}-token prompt, engine": lambda: engine.generate(fresh(args.long)[0], NEW_TOKENS),
        f"{args.prompts} x {args.short} tokens, transformers one by one": lambda: [
            transformers.generate(prompt, NEW_TOKENS) for prompt in fresh(args.short, args.prompts)
        ],
        f"{args.prompts} x {args.short} tokens, engine one by one": lambda: [
            engine.generate(prompt, NEW_TOKENS) for prompt in fresh(args.short, args.prompts)
        ],
        f"{args.prompts} x {args.short} tokens, engine batched": lambda: engine.generate_batch(
            fresh(args.short, args.prompts), budgets
        ),
    }
    seconds = {}
    for name, work in rows.items():
        seconds[name] = median_seconds(work, args.repeats)
        print(f"{name}: {seconds[name]:.2f} s", flush=True)
    names = list(seconds)
    ratios = {
        "engine / transformers, long prompt": seconds[names[1]] / seconds[names[0]],
        "engine one by one / transformers one by one": seconds[names[3]] / seconds[names[2]],
        "engine batched / engine one by one": seconds[names[4]] / seconds[names[3]],
        "engine batched / transformers one by one": seconds[names[4]] / seconds[names[2]],
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}")
    command = "python benchmarks/gate_generation_cpu.py " + " ".join(sys.argv[1:])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": command.strip(),
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
        "seconds": seconds,
        "ratios": ratios,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gate-generation-cpu.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# The gate's generation on a CPU: compress engine vs transformers, same run",
        "",
        f"Default model (SmolLM2-135M-Instruct, fp32), random token prompts, {NEW_TOKENS} greedy tokens each; median "
        f"of {args.repeats} after a warm-up; {report['machine']}; {report['date']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| row | seconds |",
        "|---|---|",
        *(f"| {name} | {value:.2f} |" for name, value in seconds.items()),
        "",
        "| ratio | value |",
        "|---|---|",
        *(f"| {name} | {value:.3f} |" for name, value in ratios.items()),
        "",
    ]
    (args.out / "gate-generation-cpu.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
