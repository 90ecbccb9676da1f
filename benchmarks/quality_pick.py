"""Which int4 recipe the README's first row names, by the measured numbers (``PICK_RULE``): each run's ratios as a
mean with a 95% t over calibration draws, and the mean over the out-of-domain texts that the pick ranks on."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.quality_rows import OUT_OF_DOMAIN, PENDING, shipped, threads_cell
from evals.gate.stats import mean_interval


def interval(values: list[float]) -> dict:
    """Mean and, from two draws on, a 95% t-interval over them (the gate's own Student t)."""
    found = mean_interval(values)
    if len(values) < 2:
        return {"n": 1, "mean": found.estimate, "low": None, "high": None, "values": values}
    return {"n": len(values), "mean": found.estimate, "low": found.low, "high": found.high, "values": values}


def panel_interval(draws: list[dict]) -> dict | None:
    """Mean over draws of each draw's mean ratio on the out-of-domain texts, with its 95% t; None unless every
    draw was scored on all of them (a mean over different texts per draw would compare nothing)."""
    if not draws or not all(text in found["ratios"] for found in draws for text in OUT_OF_DOMAIN):
        return None
    return interval([sum(found["ratios"][t] for t in OUT_OF_DOMAIN) / len(OUT_OF_DOMAIN) for found in draws])


INT4_G64 = ("rtn_int4", "awq_int4", "gptq_int4", "autoround_int4", "rotate_gptq_int4")


def pick(runs: list[dict]) -> dict | None:
    """The int4 recipe a user should pick by the measured numbers (PICK_RULE), with the runner-up and the verdict."""
    reference = shipped(runs, "gptq_int4")
    if reference is None or reference["size_mb"] is None:
        return None
    rows = [shipped(runs, recipe) for recipe in INT4_G64 if recipe not in PENDING]
    ranked = sorted(
        (row for row in rows if row and not row["overrides"] and row["size_mb"] is not None and row["panel"]),
        key=_headline,
    )
    rows = [row for row in ranked if row["size_mb"] <= reference["size_mb"] * 1.001]
    if not rows:
        return None
    larger = ranked[0] if ranked[0] is not rows[0] else None  # lower still, at a larger checkpoint: said beside
    best, runner = rows[0], (rows[1] if len(rows) > 1 else None)
    verdict = "no other candidate"
    if runner:
        a, b = best["panel"], runner["panel"]
        if a["low"] is None or b["low"] is None:
            verdict = "not established (one of them has 1 draw)"
        else:
            verdict = "a tie (95% intervals overlap)" if a["high"] >= b["low"] else "ahead (95% intervals apart)"
        if best["threads"] != runner["threads"]:
            verdict += f", torch threads {threads_cell(best['threads'])} against {threads_cell(runner['threads'])}"
    return {
        "recipe": best["recipe"], "runner_up": runner["recipe"] if runner else None, "verdict": verdict,
        "panel": best["panel"], "runner_up_panel": runner["panel"] if runner else None,
        "size_mb": best["size_mb"], "larger": None if larger is None else
        {"recipe": larger["recipe"], "panel": larger["panel"], "size_mb": larger["size_mb"]},
    }  # fmt: skip


def _headline(run: dict) -> float:
    return run["panel"]["mean"]


def pick_sentences(chosen: dict, number: Callable[[dict | None], str]) -> list[str]:
    """The pick (after its caller's prefix) and, when there is one, the lower recipe at a larger checkpoint: one
    wording for quality.md and the README, each with its own ``number`` format."""
    against = (
        f"against `{chosen['runner_up']}` ({number(chosen['runner_up_panel'])}): {chosen['verdict']}"
        if chosen["runner_up"]
        else "the only int4 g64 recipe measured"
    )
    sentences = [f"`{chosen['recipe']}`, out-of-domain mean {number(chosen['panel'])}; {against}."]
    larger = chosen.get("larger")
    if larger:
        sentences.append(
            f"Lower at a larger checkpoint: `{larger['recipe']}`, out-of-domain mean {number(larger['panel'])}, "
            f"{larger['size_mb']:.1f} MB against {chosen['size_mb']:.1f}."
        )
    return sentences
