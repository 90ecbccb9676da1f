"""The gate's intervals recounted at every size and layout it decides on, and its operating characteristic.

Both read the per-window scores ``benchmarks/gate_calibration.py`` stored (``texts`` of its results file: the
baseline and each calibrated checkpoint scored in one full pass over a long text) and judge slices of them with the
gate's own checks (``compress.evals.gate.checks.ratio_check`` / ``kl_check``, each slice's windows placed at their
positions in the text, as the gate places them):

- *coverage*: for each text, checkpoint, metric (perplexity ratio, mean KL), layout and size, the disjoint slices'
  95% intervals, how often they hold the whole text's value and how often that value lies above the upper end (the
  false-PASS side), with Clopper-Pearson bounds. Layouts: ``contiguous`` (consecutive windows: a short text, and at
  56 windows a run's own pass over the default evaluation text, 53-56 windows), ``spread`` (every n-th window of the
  long text) and ``gate`` (in each stretch of 56 windows, the first k of the gate's spread order: what gate=quick and
  gate=default score of the 56-window default evaluation text). Every slice's interval is stored, so anyone can
  recount.
- *operating characteristic*: per preset, P(PASS), P(BLOCK), P(INCONCLUSIVE) of each window layer on the preset's
  window count in the ``gate`` layout, BLOCK read at the preset's familywise level, against each checkpoint's
  whole-text value: the checkpoints of known quality and the ladder rungs placed near the limits.
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.gate_verdicts import clopper_pearson
from compress.evals.gate import checks
from compress.evals.gate.windows import spread_order

SIZES = (12, 24, 32, 48, 56)
LAYOUTS = ("contiguous", "spread", "gate")
GATE_TEXT_WINDOWS = 56  # windows of 512 tokens in the default evaluation text
LONG_TEXT = 1200  # texts with at least this many windows decide the goals; shorter ones are reported as a check
COVERAGE_GOAL, UPPER_MISS_GOAL = 0.93, 0.035
PASS_AT_LIMIT_GOAL, BLOCK_INSIDE_GOAL, INSIDE_SHARE = 0.05, 0.025, 0.7
METRICS = ("perplexity", "kl")


def layout_slices(count: int, size: int, layout: str) -> list[list[int]]:
    """Disjoint sets of ``size`` window indices out of ``count`` laid out as ``layout`` (module docstring)."""
    if layout == "contiguous":
        return [list(range(start, start + size)) for start in range(0, count - size + 1, size)]
    if layout == "spread":
        stride = count // size
        return [list(range(offset, offset + stride * size, stride)) for offset in range(stride)]
    if layout == "gate":
        chosen = sorted(spread_order(GATE_TEXT_WINDOWS)[:size])
        starts = range(0, count - GATE_TEXT_WINDOWS + 1, GATE_TEXT_WINDOWS)
        return [[start + index for index in chosen] for start in starts]
    raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def whole_text(model: dict, base: list[float]) -> dict[str, float]:
    """The values every slice estimates: the whole text's perplexity ratio and mean KL."""
    differences = [c - b for c, b in zip(model["window_nll"], base, strict=True)]
    return {
        "perplexity": math.exp(sum(differences) / len(differences)),
        "kl": sum(model["window_kl"]) / len(model["window_kl"]),
    }


def judge(model: dict, base: list[float], indices: list[int], policy, confidence: float, family: float | None):
    """The gate's perplexity and KL checks on one slice (BLOCK re-read at ``family`` when given)."""
    ratio = checks.ratio_check(
        "perplexity", "perplexity", [model["window_nll"][i] for i in indices], [base[i] for i in indices],
        policy.perplexity.max_ratio, confidence, indices,
    )  # fmt: skip
    kl = checks.kl_check("kl", "kl_mean", [model["window_kl"][i] for i in indices], policy.kl.max_mean, confidence,
                         indices)  # fmt: skip
    if family is not None:
        ratio, kl = checks.familywise(ratio, family), checks.familywise(kl, family)
    return {"perplexity": ratio, "kl": kl}


def _rate(hits: int, trials: int) -> dict:
    low, high = clopper_pearson(hits, trials)
    return {"rate": hits / trials, "bounds": [low, high]}


def recount(texts: dict, policy) -> dict:
    """Per text, checkpoint, metric, layout and size: every disjoint slice's interval; and per (text, metric, layout,
    size) the coverage and false-PASS-side miss over all checkpoints' slices."""
    intervals, cells = {}, []
    for key, scores in texts.items():
        base = scores["models"]["baseline"]["window_nll"]
        count = len(base)
        tallies: dict = {}
        for name, model in scores["models"].items():
            if name == "baseline":
                continue
            truth = whole_text(model, base)
            stored = intervals.setdefault(key, {}).setdefault(name, {"whole_text": truth})
            for layout in LAYOUTS:
                for size in SIZES:
                    slices = layout_slices(count, size, layout)
                    if not slices:
                        continue
                    read = [judge(model, base, indices, policy, policy.confidence, None) for indices in slices]
                    for metric in METRICS:
                        lows = [found[metric].low for found in read]
                        highs = [found[metric].high for found in read]
                        stored.setdefault(metric, {}).setdefault(layout, {})[str(size)] = {
                            "low": [float(f"{value:.6g}") for value in lows],
                            "high": [float(f"{value:.6g}") for value in highs],
                        }
                        tally = tallies.setdefault((metric, layout, size), [0, 0, 0, 0.0])
                        tally[0] += len(slices)
                        tally[1] += sum(low <= truth[metric] <= high for low, high in zip(lows, highs, strict=True))
                        tally[2] += sum(truth[metric] > high for high in highs)
                        tally[3] += sum((high - low) / 2 for low, high in zip(lows, highs, strict=True))
        for (metric, layout, size), (slices, covered, above, width) in sorted(tallies.items()):
            cells.append({
                "text": key, "windows": count, "decides": count >= LONG_TEXT, "metric": metric, "layout": layout,
                "size": size, "slices": slices, "coverage": _rate(covered, slices), "above_upper": _rate(above, slices),
                "mean_half_width": width / slices,
                "meets": covered / slices >= COVERAGE_GOAL and above / slices <= UPPER_MISS_GOAL,
            })  # fmt: skip
    return {
        "protocol": {"sizes": list(SIZES), "layouts": list(LAYOUTS), "gate_text_windows": GATE_TEXT_WINDOWS,
                     "confidence": policy.confidence, "coverage_goal": COVERAGE_GOAL,
                     "above_upper_goal": UPPER_MISS_GOAL, "long_text": LONG_TEXT},
        "cells": cells, "slices": intervals,
    }  # fmt: skip


def operating_characteristic(texts: dict, presets: dict) -> dict:
    """Per preset (name → (policy, familywise level, windows)), per long text and checkpoint: each window layer's
    verdict rates over the disjoint ``gate``-layout slices, against the whole-text value."""
    found = {}
    for preset, (policy, family, size) in presets.items():
        limits = {"perplexity": policy.perplexity.max_ratio, "kl": policy.kl.max_mean}
        rows = []
        for key, scores in texts.items():
            base = scores["models"]["baseline"]["window_nll"]
            if len(base) < LONG_TEXT:
                continue
            slices = layout_slices(len(base), size, "gate")
            for name, model in scores["models"].items():
                if name == "baseline":
                    continue
                truth = whole_text(model, base)
                read = [judge(model, base, indices, policy, policy.confidence, family) for indices in slices]
                for metric in METRICS:
                    verdicts = [found_[metric].verdict for found_ in read]
                    rows.append({
                        "text": key, "checkpoint": name, "metric": metric, "whole_text": truth[metric],
                        "limit": limits[metric], "slices": len(slices),
                        **{verdict: _rate(verdicts.count(verdict), len(slices))
                           for verdict in ("pass", "block", "inconclusive")},
                    })  # fmt: skip
        found[preset] = {"windows": size, "family_confidence": family, "limits": limits, "rows": rows,
                         "goals": _goals(rows, limits), "band": _band(rows)}  # fmt: skip
    return found


def _loss(metric: str, value: float) -> float:
    """What the limit allows of: the ratio's excess over 1, or the KL itself."""
    return value - 1 if metric == "perplexity" else value


def _goals(rows: list[dict], limits: dict) -> dict:
    """At or past the limit P(PASS) ≤ 5%; at ≤ 0.7 of the allowed loss P(BLOCK) ≤ 2.5%; each row that misses."""
    found = {}
    for metric, limit in limits.items():
        allowed = _loss(metric, limit)
        past = [row for row in rows if row["metric"] == metric and row["whole_text"] >= limit]
        inside = [
            row
            for row in rows
            if row["metric"] == metric and _loss(metric, row["whole_text"]) <= INSIDE_SHARE * allowed
        ]
        found[metric] = {
            "at_or_past_limit": len(past), "inside": len(inside),
            "pass_misses": [f"{row['checkpoint']} on {row['text']}" for row in past
                            if row["pass"]["rate"] > PASS_AT_LIMIT_GOAL],
            "block_misses": [f"{row['checkpoint']} on {row['text']}" for row in inside
                             if row["block"]["rate"] > BLOCK_INSIDE_GOAL],
        }  # fmt: skip
    return found


def _band(rows: list[dict]) -> dict:
    """Per metric, the whole-text values between which neither PASS nor BLOCK comes out in half the slices: above
    the largest value that still passes in ≥ half of them, below the smallest that blocks in ≥ half."""
    found = {}
    for metric in METRICS:
        own = [row for row in rows if row["metric"] == metric]
        passing = [row["whole_text"] for row in own if row["pass"]["rate"] >= 0.5]
        blocking = [row["whole_text"] for row in own if row["block"]["rate"] >= 0.5]
        found[metric] = {"passes_up_to": max(passing, default=None), "blocks_from": min(blocking, default=None)}
    return found


def coverage_markdown(recounted: dict) -> list[str]:
    cells = recounted["cells"]
    decides = [cell for cell in cells if cell["decides"]]
    missed = [cell for cell in decides if not cell["meets"]]
    verdict = "every cell meets both goals" if not missed else f"{len(missed)} of {len(decides)} cells miss"
    confidence = recounted["protocol"]["confidence"]
    lines = [
        "",
        "## Intervals: coverage at every size and layout the gate decides on",
        "",
        f"Disjoint slices of each stored text, judged by the gate's own checks at {confidence:.0%} "
        f"(`benchmarks/gate_intervals.py`; every slice's interval is stored in gate-calibration.json, `intervals`). "
        f"Goals per cell on the texts of ≥ {LONG_TEXT} windows: coverage ≥ {COVERAGE_GOAL:.0%}, the whole text's "
        f"value above the upper end (false-PASS side) in ≤ {UPPER_MISS_GOAL:.1%}. Over {len(decides)} such cells: "
        f"{verdict}. Layout `gate`: in each stretch of {GATE_TEXT_WINDOWS} windows the windows gate=quick/default "
        "score of the default evaluation text; `contiguous` at 56 windows is a run's own pass.",
        "",
        "| text | metric | layout | windows | slices | coverage (95% CP) | above upper end (95% CP) "
        "| mean half-width | goals |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        coverage, above = cell["coverage"], cell["above_upper"]
        goals = ("yes" if cell["meets"] else "**no**") if cell["decides"] else "check text"
        lines.append(
            f"| {cell['text']} | {cell['metric']} | {cell['layout']} | {cell['size']} | {cell['slices']} "
            f"| {coverage['rate']:.1%} ({coverage['bounds'][0]:.1%}–{coverage['bounds'][1]:.1%}) "
            f"| {above['rate']:.1%} ({above['bounds'][0]:.1%}–{above['bounds'][1]:.1%}) "
            f"| {cell['mean_half_width']:.4f} | {goals} |"
        )
    return lines


def _value(metric: str, value: float | None) -> str:
    if value is None:
        return "none"
    return f"×{value:.3f}" if metric == "perplexity" else f"{value:.3f}"


def oc_markdown(oc: dict, plot: str) -> list[str]:
    lines = [
        "",
        "## Operating characteristic at the limits",
        "",
        f"![operating characteristic]({plot}) Per preset, each window layer's verdict rates over the disjoint "
        f"`gate`-layout slices of the {LONG_TEXT}-window texts, against the checkpoint's whole-text value (BLOCK at "
        f"the preset's familywise level). Goals: at or past the limit P(PASS) ≤ {PASS_AT_LIMIT_GOAL:.0%}; at ≤ "
        f"{INSIDE_SHARE:g} of the allowed loss (ratio ≤ ×1.035, KL ≤ 0.035) P(BLOCK) ≤ {BLOCK_INSIDE_GOAL:.1%}.",
    ]
    for preset, found in oc.items():
        lines += ["", f"### gate={preset}: {found['windows']} windows, BLOCK at {found['family_confidence']:.2%}", ""]
        for metric, goal in found["goals"].items():
            band = found["band"][metric]
            misses = goal["pass_misses"] + goal["block_misses"]
            lines.append(
                f"- {metric} (limit {_value(metric, found['limits'][metric])}): "
                f"{goal['at_or_past_limit']} rows at or past the limit, {goal['inside']} at ≤ {INSIDE_SHARE:g} of "
                f"the allowed loss; goals {'met' if not misses else 'missed by ' + ', '.join(misses)}. PASS in ≥ half "
                f"the slices up to {_value(metric, band['passes_up_to'])}, BLOCK in ≥ half from "
                f"{_value(metric, band['blocks_from'])}: between them the verdict is mostly INCONCLUSIVE."
            )
        lines += ["", "| text | checkpoint | metric | whole text | slices | P(pass) (95% CP) | P(block) (95% CP) | "
                  "P(inconclusive) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in sorted(found["rows"], key=lambda row: (row["metric"], row["whole_text"])):
            rates = [
                f"{row[verdict]['rate']:.0%} ({row[verdict]['bounds'][0]:.0%}–{row[verdict]['bounds'][1]:.0%})"
                for verdict in ("pass", "block")
            ]
            lines.append(
                f"| {row['text']} | {row['checkpoint']} | {row['metric']} | {_value(row['metric'], row['whole_text'])} "
                f"| {row['slices']} | {rates[0]} | {rates[1]} | {row['inconclusive']['rate']:.0%} |"
            )
    return lines


def plot(oc: dict, path: Path) -> None:
    """P(verdict) against the whole-text value, one panel per preset and metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(oc)
    figure, axes = plt.subplots(len(presets), 2, figsize=(11, 3.6 * len(presets)), squeeze=False)
    colours = {"pass": "tab:green", "block": "tab:red", "inconclusive": "tab:grey"}
    for row_index, preset in enumerate(presets):
        found = oc[preset]
        for column, metric in enumerate(METRICS):
            axis = axes[row_index][column]
            own = [row for row in found["rows"] if row["metric"] == metric]
            for text, marker in zip(sorted({row["text"] for row in own}), "os^v", strict=False):
                rows = sorted((row for row in own if row["text"] == text), key=lambda row: row["whole_text"])
                values = [row["whole_text"] for row in rows]
                for verdict, colour in colours.items():
                    label = f"{verdict}, {text.split('/')[0]}"
                    rates = [row[verdict]["rate"] for row in rows]
                    axis.plot(values, rates, marker=marker, ls="-", color=colour, label=label, ms=4, alpha=0.8)
            limit = found["limits"][metric]
            inside = 1 + INSIDE_SHARE * (limit - 1) if metric == "perplexity" else INSIDE_SHARE * limit
            axis.axvline(limit, color="black", lw=1)
            axis.axvline(inside, color="black", lw=1, ls=":")
            axis.set_xlabel("whole-text perplexity ratio" if metric == "perplexity" else "whole-text mean KL (nats)")
            axis.set_ylabel("share of slices")
            axis.set_title(f"gate={preset}, {metric}: {found['windows']} windows")
            axis.set_ylim(-0.03, 1.03)
            if metric == "kl":
                axis.set_xscale("log")
            axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


DOCS_BEGIN = "<!-- figures: benchmarks/results/gate-calibration.json, written by benchmarks/gate_intervals.py -->"
DOCS_END = "<!-- end of figures -->"


def docs_summary(recounted: dict, oc: dict) -> str:
    """The block of docs/gate.md that quotes these results: the worst cell of each layout and metric, and each
    preset's goals and INCONCLUSIVE band (a test re-renders it from the results file and compares)."""
    lines = [
        DOCS_BEGIN,
        "",
        "| metric | layout | worst coverage (cell) | worst false-PASS-side miss (cell) |",
        "|---|---|---|---|",
    ]
    decides = [cell for cell in recounted["cells"] if cell["decides"]]
    for metric in METRICS:
        for layout in LAYOUTS:
            own = [cell for cell in decides if cell["metric"] == metric and cell["layout"] == layout]
            low = min(own, key=lambda cell: cell["coverage"]["rate"])
            high = max(own, key=lambda cell: cell["above_upper"]["rate"])
            lines.append(
                f"| {metric} | {layout} | {low['coverage']['rate']:.1%} ({low['text']}, {low['size']} windows) "
                f"| {high['above_upper']['rate']:.1%} ({high['text']}, {high['size']} windows) |"
            )
    lines += ["", "| preset | metric | goals at the limits | PASS in ≥ half the slices up to | BLOCK in ≥ half from |",
              "|---|---|---|---|---|"]  # fmt: skip
    for preset, found in oc.items():
        for metric, goal in found["goals"].items():
            misses = goal["pass_misses"] + goal["block_misses"]
            band = found["band"][metric]
            lines.append(
                f"| {preset} ({found['windows']} windows) | {metric} | {'met' if not misses else 'missed'} "
                f"| {_value(metric, band['passes_up_to'])} | {_value(metric, band['blocks_from'])} |"
            )
    return "\n".join([*lines, "", DOCS_END])
