"""Needle-in-a-haystack layer: retrieve a pass key hidden at a given depth of a long, unrelated text.

The format is the pass-key retrieval test, which a 135M model can solve: the needle states a five-digit key twice
("The pass key is 48213. Remember it. 48213 is the pass key."), the haystack is local evaluation text, and the prompt
ends by restating the question and the answer's opening ("What is the pass key? The pass key is"). A cell scores when
the first number in the continuation is the key. Everything is seeded, so the grid is the same in every run and for
candidate and baseline alike.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from compress.evals.generation import Generator

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def haystack(tokenizer, filler_ids: list[int], length: int, depth: float, key: int, seed: int) -> list[int]:
    """A prompt of exactly ``length`` tokens with the needle at ``depth`` (0 = start, 1 = end) of the filler."""
    intro, needle, question = _ids(tokenizer, INTRO), _ids(tokenizer, NEEDLE.format(key=key)), _ids(tokenizer, QUESTION)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    filler_length = length - len(bos) - len(intro) - len(needle) - len(question)
    if filler_length < 1:
        raise ValueError(f"context length {length} is too short for the needle prompt")
    if len(filler_ids) < filler_length:
        raise ValueError(f"the evaluation text has {len(filler_ids)} tokens; the haystack needs {filler_length}")
    start = random.Random(seed).randrange(len(filler_ids) - filler_length + 1)
    filler = filler_ids[start : start + filler_length]
    cut = round(depth * filler_length)
    return bos + intro + filler[:cut] + needle + filler[cut:] + question


def retrieved(answer: str, key: int) -> bool:
    match = re.search(r"\d+", answer)
    return match is not None and match.group() == str(key)


def context_lengths(requested: list[int], max_context: int) -> list[int]:
    """The requested lengths that fit the model's context (the gate never extrapolates past training length)."""
    return sorted({length for length in requested if length <= max_context})


def evaluate_needle(
    generator: Generator,
    tokenizer,
    filler_ids: list[int],
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int,
) -> dict:
    """Accuracy per (length, depth) cell and overall (``needle_accuracy``, a fraction), and every prompt's 0/1
    outcome in grid order (``outcomes``: the gate pairs candidate and baseline prompt by prompt)."""
    cells = [
        (length_index, depth_index, trial)
        for length_index in range(len(lengths))
        for depth_index in range(len(depths))
        for trial in range(trials)
    ]
    keys, prompts = [], []
    for length_index, depth_index, trial in cells:
        rng = random.Random(f"{seed}:{length_index}:{depth_index}:{trial}")
        keys.append(rng.randrange(10_000, 100_000))
        depth = depths[depth_index]
        prompts.append(haystack(tokenizer, filler_ids, lengths[length_index], depth, keys[-1], rng.randrange(2**31)))
    answers = generator.generate_batch(prompts, [ANSWER_TOKENS] * len(prompts))
    outcomes = [
        int(retrieved(tokenizer.decode(answer, skip_special_tokens=True), key))
        for answer, key in zip(answers, keys, strict=True)
    ]
    grid = [[0.0] * len(depths) for _ in lengths]
    for (length_index, depth_index, _), outcome in zip(cells, outcomes, strict=True):
        grid[length_index][depth_index] += outcome / trials
    hits, total = sum(outcomes), len(outcomes)
    return {
        "needle_accuracy": hits / total, "lengths": lengths, "depths": depths, "trials": trials, "grid": grid,
        "outcomes": outcomes,
    }  # fmt: skip


def plot_heatmaps(results: dict[str, dict], path: Path) -> Path:
    """One accuracy heatmap (length × depth) per model, side by side, for the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    for axis, (label, result) in zip(axes[0], results.items(), strict=True):
        image = axis.imshow(result["grid"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        axis.set_xticks(range(len(result["depths"])), [f"{depth:.0%}" for depth in result["depths"]])
        axis.set_yticks(range(len(result["lengths"])), [str(length) for length in result["lengths"]])
        axis.set_xlabel("needle depth")
        axis.set_ylabel("context length (tokens)")
        axis.set_title(f"{label}: {result['needle_accuracy']:.0%}")
        for row, values in enumerate(result["grid"]):
            for column, value in enumerate(values):
                axis.text(column, row, f"{value:.0%}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
