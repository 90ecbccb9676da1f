"""What the quality table and README's results section share: which stored run stands for a shipped recipe, the
pick rule, and how a row's cells read (kept apart so that neither module imports the other)."""

from __future__ import annotations

from pathlib import Path

import yaml

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DRAWS_GOAL = 3  # calibration draws a quality claim averages (the brief's rule)
TEXTS_GOAL = ("out_of_domain", "code", "technical", "in_domain")  # Shakespeare, the panel's code and technical, pydoc
TEXT_LABELS = {"out_of_domain": "Shakespeare", "code": "code", "technical": "technical", "in_domain": "in-domain"}
STANDARD = "≥ 3 calibration draws unless calibration-free, torch threads recorded, every text of the panel scored"
OUT_OF_DOMAIN = TEXTS_GOAL[:3]  # the texts no recipe calibrates on: the pick ranks on their mean, not on one of them

# Shipped recipes that run only with the user's own input: no draw of them as shipped exists to measure
NEEDS_INPUT = dict.fromkeys(
    ("lora_merge_awq_int4", "prune_2of4_distill_gptq_int4"),
    "needs your PEFT adapters (stages.0.adapters); it ships none",
)
# Recipes no stage of which reads calibration data (round-to-nearest, FP8 with dynamic activations): every seed gives
# the same checkpoint, so one draw is all draws; tests/compress/test_recipe_files.py checks this against the stages.
CALIBRATION_FREE = ("rtn_int4", "fp8_dynamic", "fp8_block")
# llm-compressor's FP8 presets quantize weights per channel (or block) from the weights alone and activations at run
# time, and its W4A16 round-to-nearest takes min-max weight ranges: the windows they are passed change nothing, as
# with ours (llm-compressor 0.14's QuantizationModifier sets requires_calibration_data false for all three)
PEER_CALIBRATION_FREE = ("llm-compressor:fp8_dynamic", "llm-compressor:fp8_block", "llm-compressor:rtn_w4a16")
PICK_RULE = (
    "the lowest mean ratio over the three out-of-domain texts (Shakespeare, code, technical: averaged per draw, "
    "then a 95% t over draws) among the int4 g64 recipes as shipped, every draw scored on all three, whose "
    "checkpoint is no larger than `gptq_int4`'s; ahead of the runner-up when the 95% interval of their paired "
    "difference (where both ran on the same calibration draws) stays below zero, else when Welch's 95% interval of "
    "the difference of their means does (a calibration-free recipe's one draw counting as exact); otherwise a tie"
)


def shipped(runs: list[dict], recipe: str) -> dict | None:
    """The row a README quotes for ``recipe``: as shipped (no overrides), else a run differing only in calibration
    size; the most draws first, then recorded threads."""
    candidates = [run for run in runs if run["recipe"] == recipe and data_only(run["overrides"])]
    candidates = [run for run in candidates if not run["overrides"]] or candidates
    candidates = [run for run in candidates if "out_of_domain" in run["ratios"]]
    return max(candidates, key=lambda run: (run["draws"], run["threads"] is not None), default=None)


def row_seed(name: str) -> int:
    """The calibration seed of a result row's key (``RECIPE [key=value ...] [seed=N]``): 0 unless it names one."""
    return int(next((word.split("=")[1] for word in name.split() if word.startswith("seed=")), 0))


def data_only(overrides: list[str]) -> bool:
    return all(override.startswith("data.") for override in overrides)


def threads_cell(threads: int | None) -> str:
    return "not recorded" if threads is None else str(threads)


def calibration_free(recipe: str, overrides: list[str]) -> bool:
    """A run whose checkpoint no calibration draw changes: a calibration-free recipe, its stages as shipped."""
    return recipe in CALIBRATION_FREE + PEER_CALIBRATION_FREE and not any(
        override.startswith("stages") for override in overrides
    )


def no_interval(stats: dict) -> str:
    """Why a ratio has no interval over calibration draws."""
    return "calibration-free: every draw is this one" if stats.get("calibration_free") else "1 draw: no interval"


def shipped_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml") if not path.stem.startswith("_"))


def recipe_files(folder: Path = RECIPES_DIR) -> dict[str, dict]:
    """Every shipped recipe file as parsed YAML (its ``defaults``, ``stages`` and any other key), by name."""
    return {path.stem: yaml.safe_load(path.read_text()) or {} for path in sorted(folder.glob("[!_]*.yaml"))}


def shipped_data_groups(folder: Path = RECIPES_DIR) -> dict[str, str]:
    """``{recipe: data group}`` for the recipes whose ``defaults`` select a calibration data group of their own
    (``override data: <group>``); any other recipe reads ``_base``'s (pydoc)."""
    found = {}
    for name, parsed in recipe_files(folder).items():
        for entry in parsed.get("defaults") or []:
            if isinstance(entry, dict) and "override data" in entry:
                found[name] = entry["override data"]
    return found


def data_group_files(folder: Path = RECIPES_DIR) -> dict[str, dict]:
    """Every calibration data group as its file ships it (``recipes/data/<group>.yaml``), by name."""
    return {path.stem: yaml.safe_load(path.read_text()) for path in sorted((folder / "data").glob("*.yaml"))}


def extended_recipes(folder: Path = RECIPES_DIR) -> dict[str, str]:
    """``{recipe: the shipped recipe it extends}``: the same file but for more stages after the other's, or before
    them (a rotation in front of a quantizer; same defaults, so the same calibration), the nearest such when
    several are, stages added after first; read from the files, so a new recipe is paired with its base without a
    list to update."""
    files = recipe_files(folder)
    found = {}
    for name, longer in files.items():
        rest = {key: value for key, value in longer.items() if key != "stages"}
        bases = [
            (len(shorter["stages"]), longer["stages"][: len(shorter["stages"])] == shorter["stages"], other)
            for other, shorter in files.items()
            if other != name
            and 0 < len(shorter.get("stages") or []) < len(longer.get("stages") or [])
            and shorter["stages"]
            in (longer["stages"][: len(shorter["stages"])], longer["stages"][-len(shorter["stages"]) :])
            and {key: value for key, value in shorter.items() if key != "stages"} == rest
        ]
        if bases:
            found[name] = max(bases)[2]
    return found


def shortfall(row: dict) -> list[str]:
    """What a row lacks against the table's standard (>= 3 calibration draws unless calibration-free, torch threads
    recorded, every text scored); empty when it meets it."""
    missing = []
    if row["draws"] < DRAWS_GOAL and not calibration_free(row["recipe"], row["overrides"]):
        missing.append(f"{row['draws']} of {DRAWS_GOAL} draws")
    if row["threads"] is None:
        missing.append("threads not recorded")
    unscored = [text for text in TEXTS_GOAL if text not in row["ratios"]]
    if unscored:
        missing.append(f"not scored on {', '.join(unscored)}")
    return missing


def still_to_measure(runs: list[dict]) -> list[str]:
    """Per shipped recipe, what its row lacks against the table's standard (``shortfall``): the work left, read from
    the rows, never written by hand."""
    lines = []
    for recipe in shipped_recipes():
        row = shipped(runs, recipe)
        if row is None and recipe in NEEDS_INPUT:
            lines.append(f"- `{recipe}`: not measurable as shipped: {NEEDS_INPUT[recipe]}")
        elif row is None:
            lines.append(f"- `{recipe}`: not measured as shipped")
        elif missing := shortfall(row):
            lines.append(f"- `{row['run']}`: {'; '.join(missing)}")
    return lines


def capped_phrase(run: dict) -> str:
    """``1:distill 121, 121, 125 of 200 steps (seeds 0, 1, 2)``: what each draw of a time-capped row took."""
    asked = {name: taken_asked[1] for found in run["per_draw"] for name, taken_asked in found.get("steps", {}).items()}
    seeds = [found["seed"] for found in run["per_draw"]]
    stages = "; ".join(f"{name} {', '.join('not recorded' if n is None else str(n) for n in taken)} of "
                       f"{asked[name]} steps" for name, taken in
                       sorted(run["capped"].items()))  # fmt: skip
    return f"{stages} (seeds {', '.join(map(str, seeds))})"


# llm-compressor presets kept for their history, not asked to the standard: AWQ then round-to-nearest, and the
# AWQ→GPTQ chain on min-max ranges (``awq_gptq_w4a16_mse`` is the chain like for like)
HISTORY_PEERS = ("awq_w4a16", "awq_gptq_w4a16")


def best_peer_pairs(pairs: list[dict]) -> dict[tuple[str, str], dict]:
    """``{(our run, peer preset): pair}``: of the pairs of one recipe and preset (an old file's and a new one's), the
    one to the standard, else the one over the most draws."""
    best: dict[tuple[str, str], dict] = {}
    for pair in (pair for pair in pairs if pair["kind"] == "peer"):
        key, rank = (pair["ours"], pair["peer"].split()[0]), (not pair["short_of_standard"], len(pair["seeds"]))
        if key not in best or rank > (not best[key]["short_of_standard"], len(best[key]["seeds"])):
            best[key] = pair
    return best


def peers_to_pair(runs: list[dict], pairs: list[dict], order: list[tuple[str, str | None]]) -> list[str]:
    """Per shipped recipe and each llm-compressor preset it competes with (``order``), what their pair lacks against
    the table's standard, or that no pair was measured on the same windows and threads: the peer work left."""
    best, recipes, lines = best_peer_pairs(pairs), shipped_recipes(), []
    for recipe, preset in order:
        if preset is None or preset in HISTORY_PEERS or recipe not in recipes:
            continue
        row = shipped(runs, recipe)
        pair = best.get((row["run"], f"llm-compressor:{preset}")) if row else None
        if pair is not None and not pair["short_of_standard"]:
            continue
        lacks = "; ".join(pair["short_of_standard"]) if pair else "no pair on the same windows and threads"
        lines.append(f"- `{recipe}` − `llm-compressor:{preset}`: {lacks}")
    return lines
