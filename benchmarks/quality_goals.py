"""Goals a recipe is held to, against another recipe's loss over fp32 or a ceiling on its own ratio, read from the
quality table's rows: the figure that decides a goal comes from this script with its interval, not from arithmetic in
a note."""

from __future__ import annotations

from benchmarks.quality_readme import MODEL
from benchmarks.quality_rows import OUT_OF_DOMAIN, TEXT_LABELS, shipped
from evals.gate.stats import welch_difference

# (ours, the reference, the share of the reference's loss over fp32 ours must remove): AutoRound's goal against
# GPTQ (the paper closes 31% of GPTQ's accuracy gap at W4G128 on Mistral-7B; W3G128 Llama-2-7B 56.68 against 54.14)
LOSS_GOALS = [("autoround_int4", "gptq_int4", 0.35), ("autoround_int3", "gptq_int3", 0.40)]
# (recipe, model, the most its out-of-domain mean ratio may be): "the best int4 leads", a shipped int4 g64 recipe at
# most x1.08 on the default model; held to the int4 recipes that come nearest
CEILING_GOALS = [("autoround_int4", MODEL, 1.08), ("rotate_autoround_int4", MODEL, 1.08)]


def share_removed(ours: list[float], reference: list[float], confidence: float = 0.95) -> dict:
    """``1 - (ours - 1) / (reference - 1)`` over the mean ratios. Interval: Welch's t interval of the difference of
    the two means (the draws are not paired: each recipe cuts its own calibration ids), divided by the reference's
    mean loss, whose own spread it leaves out."""
    loss = sum(reference) / len(reference) - 1
    gained = welch_difference(reference, ours, confidence)
    return {"share": gained.estimate / loss, "low": gained.low / loss, "high": gained.high / loss}


def loss_goals(runs: list[dict]) -> list[dict]:
    """Each goal whose two recipes have rows to the table's standard: the share removed per text and on the
    out-of-domain mean (what the goal is read on), with the verdict: met when the interval clears the goal, missed
    when it stays below, else undecided."""
    found = []
    for ours_recipe, reference_recipe, goal in LOSS_GOALS:
        ours, reference = shipped(runs, ours_recipe), shipped(runs, reference_recipe)
        rows = (ours, reference)
        if not all(row and not row["short_of_standard"] and row["panel"] for row in rows):
            continue
        panel = share_removed(ours["panel"]["values"], reference["panel"]["values"])
        texts = {
            text: share_removed(ours["ratios"][text]["values"], reference["ratios"][text]["values"])
            for text in ours["ratios"]
            if text in reference["ratios"]
        }
        verdict = "met" if panel["low"] >= goal else "missed" if panel["high"] < goal else "undecided"
        found.append({"ours": ours["run"], "reference": reference["run"], "goal": goal, "panel": panel,
                      "texts": texts, "verdict": verdict})  # fmt: skip
    return found


def ceiling_goals(runs: list[dict], model: str) -> list[dict]:
    """Each ceiling of ``model`` whose recipe has a row to the table's standard: its out-of-domain mean with the 95%
    t over draws, met when the whole interval is at or under the ceiling, missed when it is all over, else undecided."""
    found = []
    for recipe, goal_model, ceiling in CEILING_GOALS:
        row = shipped(runs, recipe) if goal_model == model else None
        if not row or row["short_of_standard"] or not row["panel"]:
            continue
        panel = row["panel"]
        verdict = "met" if panel["high"] <= ceiling else "missed" if panel["low"] > ceiling else "undecided"
        found.append({"ours": row["run"], "ceiling": ceiling, "panel": panel, "size_mb": row["size_mb"],
                      "verdict": verdict})  # fmt: skip
    return found


def goal_lines(goals: list[dict]) -> list[str]:
    """The markdown lines of ``loss_goals`` and ``ceiling_goals``, one per goal."""
    lines = []
    for goal in goals:
        if "ceiling" in goal:
            panel = goal["panel"]
            lines.append(
                f"- `{goal['ours']}` (goal: at most ×{goal['ceiling']:.2f} over fp32 on the mean of the "
                f"{len(OUT_OF_DOMAIN)} out-of-domain texts): ×{panel['mean']:.3f} ({panel['low']:.3f} to "
                f"{panel['high']:.3f}), **{goal['verdict']}**; checkpoint {goal['size_mb']:.1f} MB."
            )
            continue
        texts = ", ".join(f"{TEXT_LABELS.get(text, text)} {_percent(share)}" for text, share in goal["texts"].items())
        lines.append(
            f"- `{goal['ours']}` against `{goal['reference']}` (goal: remove ≥ {goal['goal']:.0%} of its loss over "
            f"fp32, out of domain): {_percent(goal['panel'])} on the mean of the {len(OUT_OF_DOMAIN)} out-of-domain "
            f"texts, **{goal['verdict']}**; per text: {texts}."
        )
    return lines


def _percent(share: dict) -> str:
    return f"{share['share']:.0%} ({share['low']:.0%} to {share['high']:.0%})"
