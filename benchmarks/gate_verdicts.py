"""The verdict a user gets, calibrated on resampled slices: the window layers (perplexity, KL) and the accuracy layer
(ARC-Easy through lm-eval) judged by the gate's own checks, then combined as the gate combines them.

Disjoint slices (``benchmarks/gate_calibration.py``) are what interval coverage needs, but 480 windows hold only 20-40
of them per gate: too few to show a rate of 95% or more. The verdict rates are therefore also read over resampled
slices, each drawn at random from the stored per-window scores and per-item outcomes (scored once):

- ``spread``: one window drawn at random from each of ``size`` equal stretches of the text, as evenly spread as the
  gate's own windows of a long text (``compress.evals.gate.windows.spread_order``), at random offsets;
- ``contiguous``: ``size`` consecutive windows from a random start (starts drawn without replacement);
- accuracy: the preset's ``lm_eval.limit`` items drawn without replacement from the stored items; when the limit is
  the whole task (the default preset scores every item), a bootstrap draw (with replacement) of as many items, as
  the spread of another sample of questions of the same kind.

Slices of one cell overlap (drawn from the same windows or items): they are not disjoint, and their rates are not
independent trials; the Clopper-Pearson bounds treat them as if they were. The combined verdict pairs the i-th
window slice with the i-th accuracy slice, drawn independently of each other.
"""

from __future__ import annotations

import math
import random

from compress.evals.gate import checks as gate_checks

VERDICTS = ("pass", "block", "inconclusive")
DRAWS = 200  # resampled slices per cell (>= 100: a rate of 95% then has a lower bound near 91%)


def spread_draws(count: int, size: int, draws: int, seed: int) -> list[list[int]]:
    """``draws`` sets of ``size`` window indices out of ``count``, one at random from each of ``size`` equal
    stretches (stretch ``j`` holds indices ``j * count // size`` up to ``(j + 1) * count // size``)."""
    if not 1 <= size <= count:
        raise ValueError(f"cannot draw {size} spread windows out of {count}")
    rng = random.Random(seed)
    edges = [j * count // size for j in range(size + 1)]
    return [[rng.randrange(edges[j], edges[j + 1]) for j in range(size)] for _ in range(draws)]


def contiguous_draws(count: int, size: int, draws: int, seed: int) -> list[list[int]]:
    """``draws`` runs of ``size`` consecutive windows from random starts, without replacement while starts remain."""
    if not 1 <= size <= count:
        raise ValueError(f"cannot draw {size} consecutive windows out of {count}")
    rng = random.Random(seed)
    starts = list(range(count - size + 1))
    chosen = []
    while len(chosen) < draws:
        chosen += rng.sample(starts, min(len(starts), draws - len(chosen)))
    return [list(range(start, start + size)) for start in chosen]


def item_draws(count: int, size: int | None, draws: int, seed: int) -> tuple[list[list[int]], str]:
    """``draws`` sets of ``size`` item indices out of ``count`` (``None``: all of them) and how they were drawn:
    without replacement below ``count``, else a bootstrap (with replacement) of ``count`` items."""
    rng = random.Random(seed)
    if size is not None and size < count:
        return [rng.sample(range(count), size) for _ in range(draws)], "without replacement"
    return stratified_draws([count], draws, seed), "bootstrap (with replacement)"


def judge_windows(model: dict, base: list[float], indices: list[int], policy, family: float):
    """The perplexity and KL checks on one slice of windows, as the gate judges them: each window's text position
    given (neighbours read as one stretch), BLOCK read at the familywise level."""
    confidence = policy.confidence
    candidate = [model["window_nll"][index] for index in indices]
    baseline = [base[index] for index in indices]
    kl = [model["window_kl"][index] for index in indices]
    ratio = gate_checks.ratio_check(
        "perplexity", "perplexity", candidate, baseline, policy.perplexity.max_ratio, confidence, indices
    )
    divergence = gate_checks.kl_check("kl", "kl_mean", kl, policy.kl.max_mean, confidence, indices)
    return gate_checks.familywise(ratio, family), gate_checks.familywise(divergence, family)


def window_verdicts(model: dict, base: list[float], slices: list[list[int]], policy, family: float) -> dict:
    """Per slice, the perplexity and KL verdicts and the two layers combined."""
    found = {"perplexity": [], "kl": []}
    for indices in slices:
        ratio, divergence = judge_windows(model, base, indices, policy, family)
        found["perplexity"].append(ratio.verdict)
        found["kl"].append(divergence.verdict)
    found["perplexity+kl"] = combine(found["perplexity"], found["kl"])
    return found


def accuracy_verdicts(
    candidate: list[float], baseline: list[float], slices: list[list[int]], max_drop_points: float, policy, family
) -> list[str]:
    """Per slice of items, the lm_eval layer's accuracy check (paired change in points, BLOCK at the familywise
    level)."""
    verdicts = []
    for indices in slices:
        check = gate_checks.drop_check(
            "lm_eval",
            "acc",
            [candidate[index] for index in indices],
            [baseline[index] for index in indices],
            max_drop_points,
            policy.confidence,
        )
        verdicts.append(gate_checks.familywise(check, family).verdict)
    return verdicts


def combine(*layers: list[str]) -> list[str]:
    """The gate's verdict per slice from its blocking layers' verdicts: any BLOCK blocks, all PASS passes, anything
    else is INCONCLUSIVE."""
    lengths = {len(verdicts) for verdicts in layers}
    if len(lengths) != 1:
        raise ValueError(f"layers judged different numbers of slices: {sorted(lengths)}")
    return [
        "block" if "block" in row else "pass" if all(verdict == "pass" for verdict in row) else "inconclusive"
        for row in zip(*layers, strict=True)
    ]


def tally(verdicts: list[str]) -> dict:
    """Each verdict's share of the slices with its 95% Clopper-Pearson bounds, and the number of slices."""
    if not verdicts:
        raise ValueError("no slices to tally")
    found: dict = {"slices": len(verdicts)}
    for verdict in VERDICTS:
        hits = verdicts.count(verdict)
        found[verdict] = hits / len(verdicts)
        found[f"{verdict}_bounds"] = clopper_pearson(hits, len(verdicts))
    return found


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval of a binomial proportion (bisection on the binomial tail)."""

    def tail(p: float, at_least: int) -> float:  # in logs: binomial terms of thousands of trials overflow a float
        if p <= 0.0 or p >= 1.0:
            return float(p >= 1.0)
        log_choose = math.lgamma(trials + 1)
        return sum(
            math.exp(log_choose - math.lgamma(k + 1) - math.lgamma(trials - k + 1) + k * math.log(p)
                     + (trials - k) * math.log1p(-p))
            for k in range(at_least, trials + 1)
        )  # fmt: skip

    def solve(target: float, at_least: int) -> float:
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if tail(middle, at_least) < target else (low, middle)
        return (low + high) / 2

    alpha = (1 - confidence) / 2
    lower = 0.0 if successes == 0 else solve(alpha, successes)
    upper = 1.0 if successes == trials else solve(1 - alpha, successes + 1)
    return lower, upper


def accuracy_change(candidate: list[float], baseline: list[float]) -> float:
    """The full-set accuracy change in points."""
    return 100 * (sum(candidate) - sum(baseline)) / len(baseline)


# window checkpoint → the ARC-Easy outcomes of the same scheme (benchmarks/accuracy_task.py): RTN int4 g64 symmetric
# on the decoder linears both; RTN int8 is g64 in the window scores and per output channel on ARC (both lossless)
ACCURACY_OF = {"rtn_int8": "rtn_int8", "fp8_dynamic": "fp8_dynamic", "rtn_int4": "rtn_int4_g64"}


def load_accuracy(results, stem: str = "accuracy-task") -> dict:
    """The stored per-item outcomes of one benchmark (ARC-Easy: ``accuracy-task``; others ``accuracy-<name>``):
    ``baseline`` → its 0/1 list; each candidate scored on the same items → ``{"outcomes", "ladder_fraction",
    "change"}`` (``benchmarks/results/<stem>*.json``)."""
    import json

    path = results / f"{stem}.json"
    if not path.is_file():
        return {}
    baseline = json.loads(path.read_text(encoding="utf-8"))["outcomes"]["acc"]
    found: dict = {"baseline": baseline}
    for each in sorted(results.glob(f"{stem}-*.json")):
        report = json.loads(each.read_text(encoding="utf-8"))
        outcomes = report["outcomes"]["acc"]
        if len(outcomes) == len(baseline):
            change = accuracy_change(outcomes, baseline)
            found[report["candidate"]] = {
                "outcomes": outcomes, "ladder_fraction": report.get("ladder_fraction"), "change": change,
            }  # fmt: skip
    return found


def verdict_rates(scores: dict, accuracy: dict, policy, family: float, size: int, seed: int = 0) -> dict:
    """One gate's verdict rates over resampled slices: per window checkpoint and slice kind the perplexity, KL and
    combined window verdicts; per ARC candidate the accuracy layer's; and, where a checkpoint has both, the verdict
    the gate gives (window slice ``i`` of the spread kind paired with accuracy slice ``i``)."""
    base = scores["models"]["baseline"]["window_nll"]
    count = len(base)
    draws = {"spread": spread_draws(count, size, DRAWS, seed), "contiguous": contiguous_draws(count, size, DRAWS, seed)}
    windows = {kind: {} for kind in draws}
    for name, model in scores["models"].items():
        if name != "baseline":
            for kind, slices in draws.items():
                windows[kind][name] = window_verdicts(model, base, slices, policy, family)
    found: dict = {
        "windows": {kind: {name: {layer: tally(v) for layer, v in rows.items()} for name, rows in found.items()}
                    for kind, found in windows.items()},
        "accuracy": {}, "combined": {},
    }  # fmt: skip
    if not accuracy:
        return found
    baseline = accuracy["baseline"]
    limit, max_drop = policy.lm_eval.limit, policy.lm_eval.max_drop_points
    slices, how = item_draws(len(baseline), limit, DRAWS, seed + 1)
    found["accuracy_draw"] = {"items": len(slices[0]), "of": len(baseline), "how": how, "max_drop_points": max_drop}
    verdicts = {}
    for name, candidate in accuracy.items():
        if name != "baseline":
            verdicts[name] = accuracy_verdicts(candidate["outcomes"], baseline, slices, max_drop, policy, family)
            found["accuracy"][name] = {
                "change": candidate["change"], "ladder_fraction": candidate["ladder_fraction"],
                "class": accuracy_class(candidate["change"], max_drop), **tally(verdicts[name]),
            }  # fmt: skip
    for name, arc in ({name: name for name in verdicts} | ACCURACY_OF).items():  # a rung pairs with its ARC namesake
        if name in windows["spread"] and arc in verdicts:
            rows = windows["spread"][name]
            deciding = [rows["perplexity"], rows["kl"]] + ([verdicts[arc]] if policy.lm_eval.blocking else [])
            found["combined"][name] = {"accuracy_of": arc, "accuracy_blocking": policy.lm_eval.blocking,
                                       **tally(combine(*deciding))}  # fmt: skip
    return found


def accuracy_class(change: float, max_drop: float) -> str:
    """Where a full-set accuracy change sits against the limit (−``max_drop`` points)."""
    if change >= -max_drop + 2:
        return "≥2 points inside"
    if change <= -max_drop - 5:
        return "≥5 points outside"
    return "near the limit"


def rate_text(row: dict, verdict: str) -> str:
    low, high = row[f"{verdict}_bounds"]
    return f"{row[verdict]:.0%} ({low:.0%}–{high:.0%})"


def rate_cells(row: dict) -> str:
    return " | ".join(rate_text(row, verdict) for verdict in VERDICTS)


def markdown(gate: str, size: int, family: float, found: dict) -> list[str]:
    """The resampled sections of one gate: window layers per slice kind, the accuracy layer, the combined verdict."""
    head = "| P(pass) (95% CP) | P(block) (95% CP) | P(inconclusive) (95% CP) |"
    lines = []
    for kind, rows in found["windows"].items():
        lines += [
            "",
            f"### gate={gate}, {DRAWS} resampled {kind} slices of {size} windows (overlapping; BLOCK at {family:.2%})",
            "",
            f"| checkpoint | layer {head}",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {layer} | {rate_cells(row)} |"
            for name, layers in rows.items()
            for layer, row in layers.items()
        ]
    if found["accuracy"]:
        draw = found["accuracy_draw"]
        lines += [
            "",
            f"### gate={gate}, accuracy layer: {DRAWS} slices of {draw['items']} of the {draw['of']} ARC-Easy items, "
            f"{draw['how']}; limit −{draw['max_drop_points']:g} points, BLOCK at {family:.2%}",
            "",
            "Per-item outcomes: `benchmarks/results/accuracy-task*.json`, each with the command that scored it "
            "(listed in accuracy-task.md).",
            "",
            f"| candidate | ladder fraction | change, all items (points) | class {head}",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in found["accuracy"].items():
            fraction = "–" if row["ladder_fraction"] is None else f"{row['ladder_fraction']:g}"
            lines.append(f"| {name} | {fraction} | {row['change']:+.1f} | {row['class']} | {rate_cells(row)} |")
    if found["combined"]:
        deciding = all(row["accuracy_blocking"] for row in found["combined"].values())
        layers = "+ accuracy (item slice i)" if deciding else "(the accuracy layer is advisory here: reported above)"
        lines += [
            "",
            f"### gate={gate}, the verdict a user gets: perplexity + KL (spread slice i) {layers}",
            "",
            f"| checkpoint | its ARC outcomes {head}",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {name} | {row['accuracy_of']} | {rate_cells(row)} |" for name, row in found["combined"].items()]
    return lines


def full_ratio(candidate_nll: list[float], baseline_nll: list[float]) -> float:
    """The perplexity ratio over every stored window of a text (what a slice's interval should hold)."""
    return math.exp((sum(candidate_nll) - sum(baseline_nll)) / len(baseline_nll))


def pooled_accuracy(parts: dict[str, dict]) -> dict:
    """Several benchmarks' :func:`load_accuracy` as one item set, as ``gate.lm_eval.benchmark: [a, b]`` judges them:
    the outcomes concatenated in ``parts`` order, for the candidates stored on every benchmark; ``sizes`` keeps each
    benchmark's item count (its stratum)."""
    names = [name for name in next(iter(parts.values())) if all(name in part for part in parts.values())]
    pooled: dict = {"sizes": {bench: len(part["baseline"]) for bench, part in parts.items()}}
    pooled["baseline"] = [value for part in parts.values() for value in part["baseline"]]
    for name in names:
        if name != "baseline":
            outcomes = [value for part in parts.values() for value in part[name]["outcomes"]]
            pooled[name] = {
                "outcomes": outcomes, "change": accuracy_change(outcomes, pooled["baseline"]),
                "ladder_fraction": parts[next(iter(parts))][name]["ladder_fraction"],
                "changes": {bench: part[name]["change"] for bench, part in parts.items()},
            }  # fmt: skip
    return pooled


def stratified_draws(sizes: list[int], draws: int, seed: int) -> list[list[int]]:
    """``draws`` bootstrap draws of a pooled item set: each benchmark's items resampled with replacement within its
    own block of indices (the gate scores every item of each, so the mix is fixed)."""
    rng = random.Random(seed)
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    return [
        [start + rng.randrange(size) for start, size in zip(starts, sizes, strict=True) for _ in range(size)]
        for _ in range(draws)
    ]


def pooled_rates(pooled: dict, policy, family: float, seed: int = 0) -> dict:
    """Each stored candidate's verdict rates under the pooled accuracy check (``policy.lm_eval.max_drop_points``,
    BLOCK at ``family``) over stratified bootstrap draws of the pooled items, with Clopper-Pearson bounds."""
    slices = stratified_draws(list(pooled["sizes"].values()), DRAWS, seed + 1)
    return {
        name: {
            "change": candidate["change"],
            "changes": candidate["changes"],
            **tally(
                accuracy_verdicts(
                    candidate["outcomes"], pooled["baseline"], slices, policy.lm_eval.max_drop_points, policy, family
                )
            ),
        }  # fmt: skip
        for name, candidate in pooled.items()
        if name not in ("sizes", "baseline")
    }
