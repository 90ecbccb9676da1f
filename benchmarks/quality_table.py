"""One table of every recipe's quality and cost, per model, assembled from the measured result files; and the
README's results section, rendered from the same rows.

    python -m benchmarks.quality_table     # SOURCES → benchmarks/results/quality.{md,json}, README.md's section
    python -m benchmarks.quality_table --sources int3 quality-formats --name quality-int3   # (README untouched)

No recipe runs here. The measurements come from ``benchmarks/quality.py``, ``benchmarks/variants.py`` and
``benchmarks/headline_tradeoff.py``, each of which scores its fp32 baseline and its checkpoints in one invocation; a
draw's ratios are to the baseline of its own file, so rows from different invocations are never divided by each
other's baseline. A row is one run (recipe and overrides, ``seed=`` aside) at one recorded torch thread count; its
draws are its calibration seeds (the latest measurement of a seed is kept), summarised as a mean and a 95%
t-interval over the draws. Threads come from the file (its ``threads`` or an ``OMP_NUM_THREADS=`` in its command),
else "not recorded": never guessed. Pairs on the same calibration ids (ours against llm-compressor's preset, and a
recipe as shipped against itself with a stage setting changed) are computed here from the per-draw ratios. Wall
time and peak RSS compare only within one file (one CPU state).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from benchmarks.quality_goals import ceiling_goals, goal_lines, loss_goals
from benchmarks.quality_pick import draw_panel, interval, panel_interval, pick, pick_sentences
from benchmarks.quality_readme import README, readme_section, replace_section
from benchmarks.quality_rows import (
    OUT_OF_DOMAIN,
    PICK_RULE,
    STANDARD,
    TEXT_LABELS,
    calibration_free,
    capped_phrase,
    data_group_files,
    extended_recipes,
    no_interval,
    peers_to_pair,
    recipe_files,
    row_seed,
    shipped_data_groups,
    shortfall,
    still_to_measure,
    threads_cell,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = [  # oldest first; a later file's draw replaces an earlier one of the same model, run, seed and threads
    "quality-recipes",
    "signround-int4",
    "self-calibration",
    "int3",
    "gptq-input-correction-int4",
    "gptq-vs-llmcompressor-seeds",
    "quality-gemma3-270m",
    "quality-formats",
    "quality-nvfp4",
    "quality-nvfp4-peer",
    "gemma3-270m-seeds",
    "quality-awq-gptq",
    "gemma3-270m-awq-gptq",
    "awq-gptq-sampled-seed1",
    "int3-signround",
    "gemma3-270m-formats",
    "gemma3-270m-awq-peer",
    "gemma3-270m-awq-gptq-peer",
    "gemma3-270m-awq-peer-seeds",
    "quality-nvfp4-awq-sampled",
    "headline-tradeoff",
    "quality-draws",
    "gptq-w4a16-mse-seeds",
    "awq-gptq-w4a16-mse-seeds",
    "awq-gptq-w4a16-mse-seed1",
    "awq-gptq-w4a16-mse-seed2",
    "quality-draws-gemma3-270m",
]
PEER = "llm-compressor:"
# llm-compressor's presets beside the recipe they compete with (benchmarks/peer_comparison.SCHEMES, reversed)
ORDER = [
    ("rtn_int4", "rtn_w4a16"),
    ("awq_int4", "awq_w4a16"),
    ("awq_int4", "awq_gptq_w4a16"),  # the peer chain nearest awq_int4 (AWQ scales, GPTQ rounding)
    ("awq_int4", "awq_gptq_w4a16_mse"),  # like for like: the same chain with clipping searched, as ours does
    ("awq_int4_train_scales", "awq_gptq_w4a16_mse"),  # the same chain, then its scales trained
    ("gptq_int4", "gptq_w4a16"),
    ("gptq_int4", "gptq_w4a16_mse"),  # like for like: its mse observer searches clipping, as our GPTQ does
    ("autoround_int4", None),
    ("rotate_gptq_int4", "spinquant_gptq_w4a16"),
    ("gptq_int3", "gptq_w3a16"),
    ("gptq_int3", "gptq_w3a16_mse"),  # like for like at 3 bits: both search clipping
    ("rotate_gptq_int3", None),
    ("smoothquant_gptq_w8a8", "smoothquant_w8a8"),
    ("fp8_dynamic", "fp8_dynamic"),
    ("fp8_block", "fp8_block"),
    ("nvfp4a16", "nvfp4a16"),
    ("nvfp4", "nvfp4"),
    ("mxfp4", "mxfp4"),
]
FAMILY = {"smollm2-135m-instruct": "llama", "gemma-3-270m": "gemma3_text"}
# column names of the scored texts, in the order shown; a key not named here follows, by its key
TEXT_NAMES = {**TEXT_LABELS, "code": "code (stdlib source)", "technical": "technical (stdlib docstrings)"}


def _text_order(text: str) -> tuple[bool, int, str]:
    """Shakespeare first, the other out-of-domain texts next, in-domain last."""
    named = list(TEXT_NAMES)
    return (text == "in_domain", named.index(text) if text in named else len(named), text)


# A recipe whose shipped settings changed, once or more: each change's date, the overrides that give back what it ran
# with before, and the settings it ships with since. A row measured before a change is shown with that change's first
# list (the overrides the row does not set itself: `data.generated=...` keeps its own data); overrides that spell what
# ships now are dropped from any row. A row's date is its own where the file records one (quality_draws), else its
# file's.
SAMPLED = ["data=sampled", "data.generated=1.0"]  # data: sampled is pydoc's group with every window generated
AUTOROUND_SEQUENCES = (  # AutoRound's CPU preset of 64-token sequences, before 512-token ones (both bit widths)
    ["stages.0.iterations=50", "stages.0.batch_size=8", "data.seq_len=64"],
    ["stages.0.iterations=200", "stages.0.batch_size=2", "data.seq_len=512"],
)
HALF_SAMPLED = (["data.generated=0.0"], ["data=half_sampled", "data.generated=0.5"])  # pydoc, then data: half_sampled
CHANGED = {  # oldest change first
    "rotate_gptq_int4": [("2026-11-26 19:00", ["data=pydoc"], SAMPLED)],
    "awq_int4": [
        ("2026-11-26 22:30", ["stages.0.rounding=rtn", "data=pydoc"], ["stages.0.rounding=gptq", *SAMPLED]),
        ("2026-11-28 10:00", ["stages.0.act_order=false"], ["stages.0.act_order=true"]),
    ],
    "rotate_gptq_int3": [("2026-11-26 22:30", ["data=pydoc"], SAMPLED)],
    "gptq_int3": [
        ("2026-11-28 12:50", ["stages.0.act_order=false"], ["stages.0.act_order=true", "stages.0.clip_search=true"])
    ],
    "autoround_int4": [  # SignRound refining GPTQ, before AutoRound as published (min/max scales, from RTN)
        (
            "2026-11-27 13:00",
            ["stages.0.init=gptq", "stages.0.iterations=40", "stages.0.batch_size=4", "stages.0.lr=0.005"]
            + ["stages.0.tune_clip=false", "data.num_samples=64", "data.seq_len=512"],
            ["stages.0.init=rtn"],
        ),
        ("2026-11-29 11:12", *AUTOROUND_SEQUENCES),
        ("2026-12-06 06:10", *HALF_SAMPLED),
    ],
    "autoround_int3": [("2026-11-29 11:47", *AUTOROUND_SEQUENCES), ("2026-12-06 09:10", *HALF_SAMPLED)],
    "gptq_int4": [("2026-11-28 05:15", ["stages.0.act_order=false"], ["stages.0.act_order=true"])],
    "awq_int4_train_scales": [  # EfficientQAT's absolute steps at SmolLM's rate, before steps relative to each scale
        (
            "2026-11-30 06:45",
            ["stages.1.learning_rate=5e-5", "stages.1.scale_steps=absolute"],
            ["stages.1.learning_rate=1e-3", "stages.1.scale_steps=relative"],
        )
    ],
}
# The sampled data group's size before it changed (8700e76): a run on it measured before then gets this override.
SAMPLED_CHANGED = ("2026-11-27 10:18", "data.num_samples=64")
DATA_GROUPS = data_group_files()  # group → its file's settings, read once: calibration() runs for every draw
SAMPLED_NOW = {key: DATA_GROUPS["sampled"][key] for key in ("num_samples", "seq_len")}
PYDOC_NUM_SAMPLES = DATA_GROUPS["pydoc"]["num_samples"]
RECIPE_DATA = {name: parsed.get("data") or {} for name, parsed in recipe_files().items()}  # a recipe's own data keys
SHIPPED_GROUPS = shipped_data_groups()  # recipe → the calibration data group its defaults select, read from its file
# A run spelled as overrides of one recipe that another recipe ships (after CHANGED): shown under the shipped name,
# with the overrides that give back what it ran with since that recipe changed
# (tests/test_quality_draws.py checks that both compose to the same stages and calibration).
SHIPPED_AS = {
    "rotate_gptq_int4 data=pydoc stages.1.bits=3": "rotate_gptq_int3 data=pydoc",
    "awq_int4 stages=[{type:awq,bits:4,group_size:64,symmetric:true,rounding:gptq,act_order:true,ignore:[lm_head]},"
    "{type:distill,trains:scales,learning_rate:5e-5,steps:200,max_minutes:10}]": "awq_int4_train_scales "
    "stages.1.learning_rate=5e-5 stages.1.scale_steps=absolute",
    "autoround_int4 stages=[{type:rotate,residual:true,heads:true,kind:hadamard,seed:0},{type:signround,bits:4,"
    "group_size:64,symmetric:true,init:rtn,iterations:200,batch_size:2,lr:null,tune_clip:true,min_clip:0.5,"
    "ignore:[lm_head]}]": "rotate_autoround_int4",
}
EXTENDS = extended_recipes()  # recipe → the shipped recipe whose stages it extends: paired (what the added ones buy)
HEADLINE_RECIPE = "awq_int4"  # benchmarks/headline_tradeoff.py compresses with this recipe only


def as_measured(run: str, date: str) -> str:
    """``run`` spelled against today's recipes: a row measured before its recipe changed gets the overrides that
    give back the settings it ran with; overrides equal to what the recipe ships now are left out."""
    recipe, *overrides = run.split()
    changes = CHANGED.get(recipe, [])
    own = {override.split("=")[0] for override in overrides}

    def overridden(key: str) -> bool:  # the row sets it, a key inside it (data.generated=1.0 sets data), or the
        # group holding it (data=sampled sets data.generated)
        return any(mine == key or mine.startswith(f"{key}.") or key.startswith(f"{mine}.") for mine in own)

    before = {}  # key → the value the row ran with: the oldest change after its date that lists the key says it
    for changed_at, then, _ in changes:
        for override in then if date < changed_at else []:
            key = override.split("=")[0]
            if not overridden(key):
                before.setdefault(key, override)
    overrides = list(before.values()) + overrides
    now = {override for _, _, ships in changes for override in ships}
    spelled = " ".join([recipe, *(override for override in overrides if override not in now)])
    spelled = SHIPPED_AS.get(spelled, spelled)
    recipe, *overrides = spelled.split()
    if date < SAMPLED_CHANGED[0] and data_group(recipe, overrides) == "sampled":
        if not any(override.startswith("data.num_samples=") for override in overrides):
            spelled += f" {SAMPLED_CHANGED[1]}"
    return spelled


def calibration(recipe: str, overrides: list[str], seed: int) -> tuple[str, float, int, int]:
    """What decides a run's calibration ids: ``(data group, generated share, windows, seed)``, each from the run's
    overrides, else its recipe file, else its data group's file; a peer preset reads the pydoc group unless its
    overrides say otherwise (benchmarks/variants.peer_options)."""
    options = dict(override.split("=", 1) for override in overrides if "=" in override)
    group = data_group(recipe, overrides)
    ships = {**DATA_GROUPS.get(group, {}), **RECIPE_DATA.get(recipe, {})}  # a file path as the group: no group file
    generated = float(options.get("data.generated", ships.get("generated", 0.0)))
    windows = int(options.get("data.num_samples", ships.get("num_samples", PYDOC_NUM_SAMPLES)))
    if generated == 1.0 and group == "pydoc":
        group = "sampled"  # pydoc's group with every window generated is the sampled group
    return group, generated, windows, seed


def data_group(recipe: str, overrides: list[str]) -> str:
    """The data config group a run reads: its ``data=`` override, else what its recipe ships (a peer: pydoc)."""
    chosen = [override.split("=", 1)[1] for override in overrides if override.startswith("data=")]
    return chosen[-1] if chosen else SHIPPED_GROUPS.get(recipe, "pydoc")


def file_threads(report: dict) -> int | None:
    """Torch threads as the file records them: its ``threads``, or ``OMP_NUM_THREADS=N`` in its command."""
    if isinstance(report.get("threads"), int):
        return report["threads"]
    found = re.search(r"OMP_NUM_THREADS=(\d+)", report.get("command", ""))
    return int(found.group(1)) if found else None


def file_draws(stem: str, results: Path) -> list[dict]:
    """Every measured draw of one result file, in the shape the table uses."""
    stored = json.loads((results / f"{stem}.json").read_text())
    draws = []
    for report in stored.get("invocations", [stored]):  # a file may join several invocations
        date, threads, model = report["date"].removesuffix(" UTC"), file_threads(report), report["model"]
        rows = report.get("rows") or report.get("recipes") or {}
        if isinstance(rows, list):  # benchmarks/headline_tradeoff.py: out-of-domain ratios per seed, one recipe
            for row in rows:
                windows, _, length = row["setting"].partition("x")
                length, _, label = length.partition("-")
                overrides = [f"data.num_samples={windows}", f"data.seq_len={length}"] + ([label] if label else [])
                overrides = [o for o in overrides if o not in [f"data.{k}={v}" for k, v in SAMPLED_NOW.items()]]
                run = as_measured(" ".join([HEADLINE_RECIPE, *overrides]), date)
                for seed, ratio in zip(row["seeds"], row["ratios"], strict=True):
                    ratios = {"out_of_domain": ratio}
                    draws.append(draw(model, run, seed, threads, stem, date, ratios, {}, report))
            continue
        base = report["baseline"]
        texts = [text for text, value in base.items() if isinstance(value, dict) and "perplexity" in value]
        for name, row in rows.items():
            if "error" in row:
                continue
            seed = row_seed(name)
            run = " ".join(w for w in name.split() if not w.startswith("seed="))
            measured = row.get("date", date)  # quality_draws dates each row: its file gathers several invocations
            run = run if run.startswith(PEER) else as_measured(run, measured)
            ratios = {text: row[text]["perplexity"] / base[text]["perplexity"] for text in texts if text in row}
            draws.append(draw(model, run, seed, threads, stem, measured, ratios, row, report))
    return draws


def draw(model, run, seed, threads, source, date, ratios, row, report) -> dict:  # noqa: ANN001
    costs = {key: row.get(key) for key in ("seconds", "peak_rss_mb", "size_mb")}
    headline = report["baseline"].get("out_of_domain", report["baseline"])  # headline_tradeoff: one text, no key
    windows = {"calibration_sha256": row["calibration_sha256"]} if "calibration_sha256" in row else {}
    processor = {"cpu": row["cpu"]} if row.get("cpu") else {}  # recorded by quality_draws since 2026-12-01
    steps = {name: [found["steps"], found["steps_asked"]] for name, found in row.get("stages", {}).items()
             if "steps_asked" in found}  # fmt: skip
    return {"model": model, "run": run, "seed": seed, "threads": threads, "source": source, "date": date,
            "ratios": ratios, **costs, "scored_tokens": headline.get("tokens"), "machine": report.get("machine"),
            **windows, **processor, **({"steps": steps} if steps else {})}  # fmt: skip


# calibration_sha256, cpu: recorded since 2026-12-01; steps: what a stage with a step count took of it
PER_DRAW = ("seed", "source", "date", "ratios", "seconds", "cpu", "calibration_sha256", "steps")


def capped_steps(draws: list[dict]) -> dict[str, list[int | None]]:
    """``{stage: steps each draw took}`` (None: not recorded) for a stage some draw stopped short of its asked steps
    (a time cap): its result then follows the machine's speed as well as the calibration draw."""
    stages = {name for found in draws for name, (taken, asked) in found.get("steps", {}).items() if taken < asked}
    return {name: [found.get("steps", {}).get(name, [None])[0] for found in draws] for name in stages}


def windows_checked(mine: dict, theirs: dict) -> bool:
    """Both draws' checkpoints named their windows, and they are the same: a pair shown, not taken at its seed's
    word."""
    return "calibration_sha256" in mine and mine.get("calibration_sha256") == theirs.get("calibration_sha256")


def same_windows(mine: dict, theirs: dict) -> bool:
    """Two draws of one seed calibrated on the same windows, unless their checkpoints' digests say otherwise (draws
    recorded before checkpoints named their windows are taken at their seed's word)."""
    return not ("calibration_sha256" in mine and "calibration_sha256" in theirs) or (
        mine["calibration_sha256"] == theirs["calibration_sha256"]
    )


def build(sources: list[str], results: Path) -> dict:
    """``{model: {"runs": [...], "pairs": [...]}}`` from the files in ``sources`` (oldest first)."""
    latest: dict[tuple, dict] = {}
    sizes: dict[tuple, tuple[float, str]] = {}  # (model, recipe, non-data overrides) → checkpoint MB, its file
    for stem in sources:
        if not (results / stem).with_suffix(".json").is_file():
            continue
        for found in file_draws(stem, results):
            latest[(found["model"], found["run"], found["seed"], found["threads"])] = found
            recipe, *overrides = found["run"].split()
            if found["size_mb"] is not None:  # the layout does not depend on the calibration data or seed
                sizes[(found["model"], recipe, tuple(o for o in overrides if not o.startswith("data")))] = (
                    found["size_mb"], found["source"])  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for (model, run, _, threads), found in latest.items():
        groups.setdefault((model, run, threads), []).append(found)
    models: dict[str, dict] = {}
    for (model, run, threads), draws in sorted(groups.items(), key=lambda item: (item[0][0], _rank(item[0][1]))):
        draws.sort(key=lambda found: found["seed"])
        recipe, *overrides = run.split()
        size = sizes.get((model, recipe, tuple(o for o in overrides if not o.startswith("data"))))
        texts = sorted({text for found in draws for text in found["ratios"]}, key=_text_order)
        marks = {"calibration_free": True} if calibration_free(recipe, overrides) else {}
        panel = panel_interval(draws)
        entry = {
            "run": run, "recipe": recipe, "overrides": overrides, "model": model, "family": FAMILY.get(model, "-"),
            "threads": threads, "draws": len(draws), "seeds": [found["seed"] for found in draws],
            "ratios": {t: interval([f["ratios"][t] for f in draws if t in f["ratios"]]) | marks for t in texts},
            "panel": panel and panel | marks,
            "size_mb": size[0] if size else None, "size_from": size[1] if size else None,
            "seconds": _mean([found["seconds"] for found in draws]),
            "peak_rss_mb": _mean([found["peak_rss_mb"] for found in draws]),
            "sources": sorted({(found["source"], found["date"]) for found in draws}, key=lambda s: s[1]),
            "scored_tokens": sorted({found["scored_tokens"] for found in draws if found["scored_tokens"]}),
            "machines": sorted({found["machine"] for found in draws if found["machine"]}),
            "processors": sorted({found["cpu"] for found in draws if "cpu" in found}),
            "per_draw": [{k: found[k] for k in PER_DRAW if k in found} for found in draws],
        }  # fmt: skip
        capped = capped_steps(draws)
        if capped:
            entry["capped"] = capped
        entry["short_of_standard"] = shortfall(entry)
        models.setdefault(model, {"runs": [], "pairs": []})["runs"].append(entry)
    for model, tables in models.items():
        tables["pairs"] = pairs(tables["runs"])
        tables["pick"] = pick(tables["runs"], tables["pairs"])
        tables["goals"] = loss_goals(tables["runs"]) + ceiling_goals(tables["runs"], model)
    return models


def _mean(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def _rank(run: str) -> tuple[int, int, str]:
    """Our recipe, then its variants (seeds, overrides), then the peer preset it competes with."""
    is_peer, recipe = run.startswith(PEER), run.removeprefix(PEER).split()[0]
    for index, (ours, peer) in enumerate(ORDER):
        if recipe == (peer if is_peer else ours):  # preset and recipe may share a name (fp8_dynamic, nvfp4a16)
            return index, int(is_peer), run
    return len(ORDER), int(is_peer), run


def rival(ours: dict, other: dict) -> str | None:
    """What ``other`` is to ``ours``: the peer preset it competes with (ORDER); for a recipe as shipped the same
    recipe with stage settings changed or its stage list replaced (``stages=[...]``: what the shipped stages buy
    against, say, an added stage), or the shipped recipe whose stages it extends (``extended_recipes``); else
    None."""
    if other["recipe"].startswith(PEER):
        return "peer" if (ours["recipe"], other["recipe"].removeprefix(PEER)) in ORDER else None
    if not ours["overrides"] and not other["overrides"] and EXTENDS.get(ours["recipe"]) == other["recipe"]:
        return "added stages"
    same_data = other["overrides"] and all(o.startswith(("stages.", "stages=")) for o in other["overrides"])
    return "setting" if not ours["overrides"] and other["recipe"] == ours["recipe"] and same_data else None


def pairs(runs: list[dict]) -> list[dict]:
    """Ours against each rival (``rival``), draw by draw on the same calibration ids (``same_windows``) and threads:
    the difference ours − rival of each ratio (negative: ours lower), its mean and 95% t-interval over the draws."""
    found = []
    for ours in (run for run in runs if not run["run"].startswith(PEER)):
        for peer in runs:
            kind = rival(ours, peer)
            if kind is None or peer["threads"] != ours["threads"]:
                continue
            mine = {calibration(ours["recipe"], ours["overrides"], d["seed"]): d for d in ours["per_draw"]}
            theirs = {calibration(peer["recipe"], peer["overrides"], d["seed"]): d for d in peer["per_draw"]}
            shared = sorted(
                (k for k in set(mine) & set(theirs) if same_windows(mine[k], theirs[k])), key=lambda k: k[3]
            )
            if not shared:
                continue
            texts = [t for t in ours["ratios"] if all(t in d[k]["ratios"] for d in (mine, theirs) for k in shared)]
            free = all(stats.get("calibration_free") for run in (ours, peer) for stats in run["ratios"].values())
            exact = {"calibration_free": True} if free else {}  # two calibration-free runs: their one gap is exact
            found.append({
                "ours": ours["run"], "peer": peer["run"], "kind": kind, "threads": ours["threads"],
                "seeds": [k[3] for k in shared],
                "windows_checked": [k[3] for k in shared if windows_checked(mine[k], theirs[k])],
                "difference": {
                    t: interval([mine[k]["ratios"][t] - theirs[k]["ratios"][t] for k in shared]) | exact
                    for t in texts
                },
                "panel": interval([draw_panel(mine[k]) - draw_panel(theirs[k]) for k in shared]) | exact
                if all(t in texts for t in OUT_OF_DOMAIN) else None,
                "sources": sorted({d[k]["source"] for d in (mine, theirs) for k in shared}),
            })  # fmt: skip
            found[-1]["short_of_standard"] = shortfall({
                "recipe": ours["recipe"], "overrides": ours["overrides"], "draws": len(shared),
                "threads": ours["threads"], "ratios": found[-1]["difference"],
            })  # fmt: skip
    return found


def cell(stats: dict | None, digits: int = 3) -> str:
    """``1.161 (1.125–1.197)`` over several draws, ``1.358 (1 draw: no interval)`` over one."""
    if stats is None:
        return "not measured"
    if stats["low"] is None:
        return f"{stats['mean']:.{digits}f} ({no_interval(stats)})"
    return f"{stats['mean']:.{digits}f} ({stats['low']:.{digits}f} to {stats['high']:.{digits}f})"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _run_line(run: dict, texts: list[str]) -> str:
    size = _number(run["size_mb"], 1) + ("" if run["size_from"] in (None, *dict(run["sources"])) else
                                         f" ({run['size_from']})")  # fmt: skip
    files = ", ".join(f"[{stem}]({stem}.md) {date}" for stem, date in run["sources"])
    ratios = " | ".join(cell(run["ratios"].get(t)) for t in texts)
    return (
        f"| `{run['run']}` | {run['draws']} ({', '.join(map(str, run['seeds']))}) | "
        f"{threads_cell(run['threads'])} | {ratios} | {size} | {_number(run['seconds'])} | "
        f"{_number(run['peak_rss_mb'])} | {files} |"
    )


def _pair_line(pair: dict, texts: list[str]) -> str:
    diffs = " | ".join(cell(pair["difference"].get(t)) for t in texts)
    checked = pair.get("windows_checked")
    checked = f"; windows checked: {', '.join(map(str, checked))}" if checked else ""
    return (
        f"| `{pair['ours']}` | `{pair['peer']}` | {len(pair['seeds'])} ({', '.join(map(str, pair['seeds']))}"
        f"{checked}) | "
        f"{threads_cell(pair['threads'])} | {diffs} | {', '.join(pair['sources'])} |"
    )


def markdown(models: dict, command: str) -> str:
    lines = [
        "# Quality and cost of every recipe, per model",
        "",
        "Assembled from the measured files named in each row (no run happens in this step). Ratio: perplexity over "
        "the fp32 baseline of the same file; out of domain: Shakespeare (the headline) and, where a file scored "
        "them, the gate's code (the standard library's source) and technical (its docstrings) texts; in domain: "
        "pydoc's held-out split, the calibration source, which flatters every recipe. A row is one "
        'run at one torch thread count (from the file; "not recorded" where it lacks it); its draws are calibration '
        "seeds: mean, then the 95% t-interval over the draws. `llm-compressor:` rows are llm-compressor 0.14's "
        "preset on the calibration ids of our run with the same seed and data overrides. Size: the checkpoint of "
        "the run, or of the same recipe with other calibration data (named). Wall time and peak RSS (load, "
        "calibrate, quantize, save) are means over the draws and compare only within one file; a dash is a figure "
        "the file did not record.",
        "",
        f"Command: `{command}`",
        "",
        f"Pick rule (the README's first row): {PICK_RULE}.",
        "",
        "The draws a row still lacks (listed under each model) are measured by `python -m benchmarks.quality_draws` "
        "(resumable, threads pinned, every text).",
    ]
    for model, tables in models.items():
        texts = sorted({t for run in tables["runs"] for t in run["ratios"]}, key=_text_order)
        names = [TEXT_NAMES.get(t, t.replace("_", "-")) for t in texts]
        chosen = tables["pick"]
        tokens = sorted({n for run in tables["runs"] for n in run["scored_tokens"]})
        lines += ["", f"## {model} (`{FAMILY.get(model, '-')}`)", ""]
        if chosen:
            first, *larger = pick_sentences(chosen, cell)
            lines += [f"Pick: {first}", ""] + [line for sentence in larger for line in (sentence, "")]
        if tables["goals"]:
            lines += ["Goals against another recipe's loss over fp32 (the share of it removed; interval: Welch's 95% "
                      "t of the difference of the two means over their draws, divided by the reference's mean loss), "
                      "or a ceiling on a recipe's own out-of-domain mean (interval: the 95% t over its draws):",
                      "", *goal_lines(tables["goals"]), ""]  # fmt: skip
        standard = [run for run in tables["runs"] if not run["short_of_standard"]]
        earlier = [run for run in tables["runs"] if run["short_of_standard"]]
        header = f"| run | draws (seeds) | threads | {' | '.join(names)} | size MB | compress s | peak RSS MB | files |"
        rule = "|---|---|---|" + "---|" * len(texts) + "---|---|---|---|"
        lines += [
            f"Scored out-of-domain tokens per draw: {', '.join(map(str, tokens))} (a `--max-windows` run scores "
            "fewer than the whole text).",
            "",
            f"Measured to the table's standard ({STANDARD}):" + ("" if standard else " no row yet."),
        ]
        if standard:
            lines += ["", header, rule, *(_run_line(run, texts) for run in standard)]
        capped = [f"- `{run['run']}`: {capped_phrase(run)}" for run in standard if "capped" in run]
        if capped:
            lines += ["", "Rows whose stage stopped at its time cap before the steps it asks (the ratio then "
                      "follows the machine's speed as well as the draw):", "", *capped]  # fmt: skip
        if earlier:
            lines += [
                "",
                "Earlier and exploratory measurements, short of that standard (the last column says how), kept for "
                "their history:",
                "",
                header.replace(" files |", " files | short of the standard by |"),
                rule + "---|",
                *(f"{_run_line(run, texts)} {'; '.join(run['short_of_standard'])} |" for run in earlier),
            ]
        if tables["pairs"]:
            header = f"| ours | rival | draws (seeds) | threads | {' | '.join(names)} | files |"
            rule = "|---|---|---|---|" + "---|" * len(texts) + "---|"
            standard = [pair for pair in tables["pairs"] if not pair["short_of_standard"]]
            earlier = [pair for pair in tables["pairs"] if pair["short_of_standard"]]
            lines += [
                "",
                "Paired on the same calibration ids, ours − rival per draw (negative: ours lower); the rival is "
                "llm-compressor's preset, the recipe as shipped with a stage setting changed (what the shipped "
                "setting buys), or the shipped recipe whose stages ours extends (what the added stages buy). A seed "
                "is the same ids on both sides by the seed's word, except where both checkpoints named their "
                "windows' digest: a differing digest drops the seed, an equal one is listed as `windows checked`. "
                "To the standard:" + ("" if standard else " no pair yet."),
            ]
            if standard:
                lines += ["", header, rule, *(_pair_line(pair, texts) for pair in standard)]
            if earlier:
                lines += [
                    "",
                    "Earlier and exploratory pairs, short of the standard:",
                    "",
                    header.replace(" files |", " files | short of the standard by |"),
                    rule + "---|",
                    *(f"{_pair_line(pair, texts)} {'; '.join(pair['short_of_standard'])} |" for pair in earlier),
                ]
        gaps = still_to_measure(tables["runs"])
        if gaps:
            lines += ["", f"Still to measure, per shipped recipe ({STANDARD}):", "", *gaps]
        peers = peers_to_pair(tables["runs"], tables["pairs"], ORDER)
        if peers:
            lines += ["", "llm-compressor's presets still to pair like for like with the recipe they compete with "
                      "(ours − theirs on the same windows and threads, to the standard):", "", *peers]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", nargs="+", default=SOURCES, help="result file stems, oldest first")
    parser.add_argument("--name", default="quality", help="output file stem (README.md is rewritten for 'quality')")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    missing = [stem for stem in args.sources if not (args.results / f"{stem}.json").is_file()]
    if missing:
        raise SystemExit(f"no result file {', '.join(missing)} in {args.results}: check --sources / --results")
    models = build(args.sources, args.results)
    command = " ".join(["python -m benchmarks.quality_table", *(shlex.quote(a) for a in sys.argv[1:])])
    stored = {"command": command, "pick_rule": PICK_RULE, "models": models}
    (args.results / f"{args.name}.json").write_text(json.dumps(stored, indent=2) + "\n")
    (args.results / f"{args.name}.md").write_text(markdown(models, command))
    if args.name == "quality" and args.results == RESULTS and args.sources == SOURCES:
        README.write_text(replace_section(README.read_text(encoding="utf-8"), readme_section(stored)))
        print(f"wrote {args.results / args.name}.{{md,json}} and README.md's results section")
    else:
        print(f"wrote {args.results / args.name}.{{md,json}}")


if __name__ == "__main__":
    main()
