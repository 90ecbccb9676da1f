"""Does the rotation stage make 4-bit weights less lossy on the default model? Perplexity of RTN (and optionally
GPTQ) int4 g64 with and without ``rotate`` in front, every checkpoint made by ``compress.oneshot`` and scored as
reloaded from disk on the same evaluation windows, against the baseline measured in the same run.

    python -m benchmarks.rotation                      # RTN, 16 evaluation windows of 512 tokens
    python -m benchmarks.rotation --gptq --windows 56  # GPTQ too, the whole evaluation split (slow on a CPU)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from compress import oneshot
from compress.checkpoint import load_checkpoint
from compress.data import DataSpec, load_corpus, tokenize
from compress.models import default_model_dir, load
from evals.perplexity import perplexity

RESULTS = Path(__file__).parent / "results"
INT4 = {"bits": 4, "group_size": 64, "symmetric": True, "ignore": ["lm_head"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows of 512 tokens")
    parser.add_argument("--gptq", action="store_true", help="also GPTQ (minutes per layer on a loaded CPU)")
    args = parser.parse_args()
    model_dir = default_model_dir()
    model, tokenizer = load(model_dir, lazy=False)
    eval_ids = tokenize(tokenizer, load_corpus(DataSpec()).evaluation_text)

    def ppl(candidate, label: str) -> float:
        return perplexity(candidate, eval_ids, 512, 4, args.windows, label=label).perplexity

    rows = {"baseline": {"ppl": ppl(model, "baseline"), "seconds": 0.0}}
    del model
    chains = {"rtn": [{"type": "rtn", **INT4}], "rotate+rtn": [{"type": "rotate"}, {"type": "rtn", **INT4}]}
    if args.gptq:
        chains |= {"gptq": [{"type": "gptq", **INT4}], "rotate+gptq": [{"type": "rotate"}, {"type": "gptq", **INT4}]}
    with tempfile.TemporaryDirectory(prefix="rotation-") as workdir:
        for label, chain in chains.items():
            start = time.perf_counter()
            checkpoint = oneshot(str(model_dir), chain, output_dir=Path(workdir) / label, device="cpu")
            seconds = time.perf_counter() - start
            candidate, _ = load_checkpoint(checkpoint)
            rows[label] = {"ppl": ppl(candidate, label), "seconds": seconds}
            print(label, rows[label], flush=True)
    base = rows["baseline"]["ppl"]
    lines = [
        f"# Rotation before int4 g64 on `{model_dir.name}` ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python -m benchmarks.rotation{' --gptq' if args.gptq else ''} --windows {args.windows}`: "
        f"{args.windows} evaluation windows of 512 tokens (pydoc evaluation split), the recipe's default calibration "
        "(64 x 512 tokens), checkpoints reloaded from disk, 2-core CPU shared with other jobs (seconds are noisy).",
        "",
        "| model | perplexity | increase over baseline | oneshot seconds |",
        "|---|---|---|---|",
        *(
            f"| {k} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.1f}% | {r['seconds']:.0f} |"
            for k, r in rows.items()
        ),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rotation.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "rotation.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
