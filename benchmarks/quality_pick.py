"""Which int4 recipe the README's first row names, by the measured numbers (``PICK_RULE``): each run's ratios as a
mean with a 95% t over calibration draws, and the mean over the out-of-domain texts that the pick ranks on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.quality_rows import OUT_OF_DOMAIN, RECIPES_DIR, recipe_files, shipped, threads_cell
from evals.gate.stats import mean_interval, welch_difference


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
    return interval([draw_panel(found) for found in draws])


def draw_panel(draw: dict) -> float:
    """A draw's mean ratio over the out-of-domain texts (what the pick ranks on)."""
    return sum(draw["ratios"][text] for text in OUT_OF_DOMAIN) / len(OUT_OF_DOMAIN)


# stages that compress something besides the int4 weights, or ask the user for input: their recipes are not ranked
OTHER_COMPRESSION = {"kv_cache", "sparsegpt", "wanda", "magnitude_prune", "lora_merge"}


def int4_g64_recipes(folder: Path = RECIPES_DIR) -> list[str]:
    """The recipes the pick ranks, read from their files: int4 weights in groups of 64 (not an FP4 format), nothing
    else compressed and no input asked of the user; a new such recipe is ranked without a list to update."""
    found = []
    for name, recipe in recipe_files(folder).items():
        stages = recipe.get("stages") or []
        int4 = any(s.get("bits") == 4 and s.get("group_size") == 64 and "format" not in s for s in stages)
        if int4 and not any(stage["type"] in OTHER_COMPRESSION for stage in stages):
            found.append(name)
    return found


def pick(runs: list[dict], pairs: list[dict] = ()) -> dict | None:
    """The int4 recipe a user should pick by the measured numbers (PICK_RULE), with the runner-up and the verdict:
    from their paired difference where they share calibration draws (``pairs``), else from Welch's interval of the
    difference of their means (overlap of their own intervals would call many real gaps a tie)."""
    reference = shipped(runs, "gptq_int4")
    if reference is None or reference["size_mb"] is None:
        return None
    rows = [shipped(runs, recipe) for recipe in int4_g64_recipes()]
    ranked = sorted(
        (
            row
            for row in rows
            if row
            and not row["short_of_standard"]
            and not row["overrides"]
            and row["size_mb"] is not None
            and row["panel"]
        ),
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
        paired = _paired_panel(pairs, best["run"], runner["run"])
        if paired is not None:
            ahead = "ahead" if paired["high"] < 0 else "a tie (the paired interval reaches zero)"
            verdict = (f"{ahead}: paired difference {paired['mean']:+.3f} ({paired['low']:+.3f} to "
                       f"{paired['high']:+.3f}, {paired['n']} draws on the same calibration ids)")  # fmt: skip
        elif a.get("calibration_free") or b.get("calibration_free"):
            verdict = _against_one_value(a, b)
        elif a["low"] is None or b["low"] is None:
            verdict = "not established (one of them has 1 draw)"
        else:
            found = welch_difference(a["values"], b["values"])
            ahead = "ahead" if found.high < 0 else "a tie (the interval reaches zero)"
            verdict = (f"{ahead}: difference {found.estimate:+.3f} ({found.low:+.3f} to {found.high:+.3f}, Welch's 95% "
                       f"interval: {a['n']} and {b['n']} draws on different calibration ids)")  # fmt: skip
        if best["threads"] != runner["threads"]:
            verdict += f", torch threads {threads_cell(best['threads'])} against {threads_cell(runner['threads'])}"
    return {
        "recipe": best["recipe"], "runner_up": runner["recipe"] if runner else None, "verdict": verdict,
        "panel": best["panel"], "runner_up_panel": runner["panel"] if runner else None,
        "size_mb": best["size_mb"], "larger": None if larger is None else
        {"recipe": larger["recipe"], "panel": larger["panel"], "size_mb": larger["size_mb"]},
    }  # fmt: skip


def _paired_panel(pairs: list[dict], best: str, runner: str) -> dict | None:
    """best − runner-up of the out-of-domain mean, draw by draw, when a pair of the two has it over >= 2 draws."""
    for pair in pairs:
        found = pair.get("panel")
        if found is None or found["low"] is None:
            continue
        if (pair["ours"], pair["peer"]) == (best, runner):
            return found
        if (pair["ours"], pair["peer"]) == (runner, best):
            return {**found, "mean": -found["mean"], "low": -found["high"], "high": -found["low"]}
    return None


def _against_one_value(best: dict, runner: dict) -> str:
    """The verdict when one side is calibration-free: its one draw is every draw, so the difference's interval is
    the t-interval of the other side's draws less that value (both calibration-free: the difference is exact)."""
    if best.get("calibration_free") and runner.get("calibration_free"):
        difference = best["mean"] - runner["mean"]
        return f"{'ahead' if difference < 0 else 'a tie'}: difference {difference:+.3f} (both calibration-free: exact)"
    drawn = runner if best.get("calibration_free") else best
    if drawn["low"] is None:
        return "not established (the calibrated recipe has 1 draw)"
    if drawn is best:
        found = mean_interval([value - runner["mean"] for value in best["values"]])
    else:
        found = mean_interval([best["mean"] - value for value in runner["values"]])
    ahead = "ahead" if found.high < 0 else "a tie (the interval reaches zero)"
    return (f"{ahead}: difference {found.estimate:+.3f} ({found.low:+.3f} to {found.high:+.3f}, 95% t over "
            f"{drawn['n']} draws against the calibration-free recipe's one value)")  # fmt: skip


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
