"""What a preset would need: the verdict rates of ``gate=default`` at other window counts per text (P(pass) of the
lossless checkpoints, P(block) of the rungs ≥ 5 points past the perplexity limit) and of its accuracy layer at other
limits and item counts, over the same resampled slices as ``benchmarks/gate_verdicts.py``. The gate's defaults are
read from these tables (docs/gate.md, "Power by design")."""

from __future__ import annotations

import random

from benchmarks.gate_verdicts import (
    ACCURACY_OF,
    DRAWS,
    accuracy_verdicts,
    combine,
    contiguous_draws,
    full_ratio,
    item_draws,
    rate_text,
    spread_draws,
    tally,
    window_verdicts,
)

WINDOW_COUNTS = (24, 32, 40, 48, 64)
# gate seconds per window added to the preset: three texts (the evaluation text and two panel domains), both sides,
# at 81 s for 24 windows of both sides on the idle 2-core machine (docs/gate.md, "Cost on a CPU"; an upper bound, as
# it holds each pass's fixed cost too)
SECONDS_PER_EXTRA_WINDOW = 3 * 81 / 24


def windows_needed(texts: dict, accuracy: dict, policy, family: float, seed: int = 0) -> dict:
    """What the preset would need for FP8 to pass: per window count, P(pass) of each lossless checkpoint (window
    layers on the headline text, and with its accuracy slices where stored) and P(block) of each rung ≥ 5 points
    past the perplexity limit on any text, over resampled spread slices (as the gate draws a long text's windows)."""
    rows = []
    headline = next(key for key in texts if key.startswith("shakespeare/"))
    limit = policy.perplexity.max_ratio
    arc = {}
    if accuracy:
        items, _ = item_draws(len(accuracy["baseline"]), policy.lm_eval.limit, DRAWS, seed + 1)
        arc = {
            name: accuracy_verdicts(
                accuracy[ACCURACY_OF[name]]["outcomes"], accuracy["baseline"], items, policy.lm_eval.max_drop_points,
                policy, family,
            )
            for name in ("rtn_int8", "fp8_dynamic") if ACCURACY_OF[name] in accuracy
        }  # fmt: skip
    for size in WINDOW_COUNTS:
        row: dict = {"windows": size, "pass": {}, "block": {}}
        for key, scores in texts.items():
            base = scores["models"]["baseline"]["window_nll"]
            if size > len(base) // 2:
                continue  # fewer than two windows to draw each from: the draws would barely differ
            slices = spread_draws(len(base), size, DRAWS, seed)
            for name, model in scores["models"].items():
                ratio = full_ratio(model.get("window_nll", base), base)
                if key == headline and name in ("rtn_int8", "fp8_dynamic"):
                    found = window_verdicts(model, base, slices, policy, family)
                    row["pass"][name] = tally(found["perplexity+kl"])
                    if name in arc:
                        row["pass"][f"{name} + accuracy"] = tally(combine(found["perplexity+kl"], arc[name]))
                    runs = contiguous_draws(len(base), size, DRAWS, seed)
                    row["pass"][f"{name}, contiguous"] = tally(
                        window_verdicts(model, base, runs, policy, family)["perplexity+kl"]
                    )
                elif name != "baseline" and ratio >= limit + 0.05:
                    found = window_verdicts(model, base, slices, policy, family)
                    row["block"][f"{name} ×{ratio:.3f} ({key})"] = tally(found["perplexity"])
        if row["pass"] or row["block"]:  # a count no text holds twice over: no row
            rows.append(row)
    return {"gate_windows": policy.perplexity.max_windows, "rows": rows}


def windows_markdown(found: dict, seconds_per_window: float | None) -> list[str]:
    """The window-count table, a column per count: P(pass) of the lossless checkpoints, P(block) of the rungs ≥ 5
    points past the limit (one row each, on the text named), and the extra cost."""
    rows = found["rows"]
    cells = {}  # row label → {windows: rate}
    for row in rows:
        for kind in ("pass", "block"):
            for name, rates in row[kind].items():
                cells.setdefault(f"P({kind}) {name}", {})[row["windows"]] = rate_text(rates, kind)
    lines = [
        "",
        f"### gate=default, windows per text: P(pass) of the lossless checkpoints, P(block) of those ≥ 5 points past "
        f"the limit ({DRAWS} resampled spread slices; the preset scores {found['gate_windows']})",
        "",
        "| windows per text |" + "".join(f" {row['windows']} |" for row in rows),
        "|---|" + "---|" * len(rows),
    ]
    for label, by in cells.items():
        lines.append(f"| {label} | " + " | ".join(by.get(row["windows"], "–") for row in rows) + " |")
    if seconds_per_window is not None:
        costs = [f"{(row['windows'] - found['gate_windows']) * seconds_per_window:+.0f} s" for row in rows]
        lines.append("| extra gate time | " + " | ".join(costs) + " |")
    return lines


ACCURACY_SETTINGS = ((3.0, 570), (3.0, 1140), (3.0, 1710), (4.0, 570), (5.0, 570))  # (limit in points, items)


def accuracy_needed(accuracy: dict, policy, family: float, seed: int = 0) -> list[dict]:
    """What the accuracy layer would need for FP8 to pass: per (limit, items), each stored candidate's verdict rates
    over bootstrap draws of that many items (beyond the stored items: the same flips at a larger count)."""
    if not accuracy:
        return []
    rows = []
    for max_drop, items in ACCURACY_SETTINGS:
        rng = random.Random(seed + 1)
        count = len(accuracy["baseline"])
        slices = [[rng.randrange(count) for _ in range(items)] for _ in range(DRAWS)]
        row: dict = {"max_drop_points": max_drop, "items": items, "candidates": {}}
        for name, candidate in accuracy.items():
            if name != "baseline":
                verdicts = accuracy_verdicts(
                    candidate["outcomes"], accuracy["baseline"], slices, max_drop, policy, family
                )
                row["candidates"][name] = {"change": candidate["change"], **tally(verdicts)}
        rows.append(row)
    return rows


def accuracy_markdown(rows: list[dict], family: float) -> list[str]:
    """The accuracy-layer table: P(pass) / P(block) of every stored candidate per limit and item count."""
    if not rows:
        return []
    names = list(rows[0]["candidates"])
    changes = {name: rows[0]["candidates"][name]["change"] for name in names}
    lines = [
        "",
        f"### gate=default, accuracy layer by limit and item count: P(pass) / P(block) ({DRAWS} bootstrap draws; "
        f"BLOCK at {family:.2%})",
        "",
        "| limit | items |" + "".join(f" {name} ({changes[name]:+.1f}) |" for name in names),
        "|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        cells = [f"{c['pass']:.0%} / {c['block']:.0%}" for c in row["candidates"].values()]
        lines.append(f"| −{row['max_drop_points']:g} points | {row['items']} | " + " | ".join(cells) + " |")
    return lines
