"""One limit applied to one signal, judged on the signal's interval: the lines a reviewer reads.

Each constructor turns paired per-item scores into a :class:`Check` whose ``estimate`` is what the limit speaks of
(a perplexity ratio, an accuracy change in points, a mean KL), with its interval, the verdict and, when the interval
straddles the limit, about how many items would decide it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from compress.evals.gate import stats
from compress.evals.gate.stats import INCONCLUSIVE, PASS, Interval


@dataclass
class Check:
    layer: str
    metric: str
    candidate: float | None  # the candidate's own value (perplexity, accuracy, ms), for the table
    baseline: float | None
    estimate: float  # what the limit is about: ratio, change in points, mean KL
    low: float
    high: float
    limit: float
    limit_text: str  # "≤ 1.05 × baseline"
    verdict: str  # pass | block | inconclusive
    items: int
    confidence: float
    items_to_decide: int | None = None  # about how many items in all would decide an inconclusive check
    summary: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def describe(self) -> str:
        return self.summary


def _check(
    layer, metric, candidate, baseline, interval: Interval, limit, at_most, limit_text, wording, at=None
) -> Check:
    verdict = stats.verdict(interval, limit, at_most)
    needed = stats.items_to_decide(interval, limit, at) if verdict == INCONCLUSIVE else None
    check = Check(
        layer, metric, candidate, baseline, interval.estimate, interval.low, interval.high, limit, limit_text,
        verdict, interval.items, interval.confidence, needed,
    )  # fmt: skip
    check.summary = f"{wording(check)}: {verdict.upper()}" + _more(check)
    return check


def _more(check: Check) -> str:
    if check.verdict != INCONCLUSIVE:
        return ""
    if check.items_to_decide is None:
        return f" (the estimate sits on the limit: no number of items decides it; {check.items} scored)"
    return f" (about {check.items_to_decide} items would decide it; {check.items} scored)"


def _ci(check: Check, scale=lambda value: f"{value:.4g}") -> str:
    return f"{check.confidence:.0%} CI {scale(check.low)}–{scale(check.high)}"


def _ratio(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.4g}"


def ratio_check(layer, metric, candidate_nll: list[float], baseline_nll: list[float], max_ratio, confidence) -> Check:
    """Perplexity ratio from per-window mean NLLs: exp of the mean per-window difference, interval likewise."""
    interval = stats.paired_difference(candidate_nll, baseline_nll, confidence).map(math.exp)
    candidate, baseline = math.exp(_mean(candidate_nll)), math.exp(_mean(baseline_nll))

    def wording(check):
        side = "≤" if check.high <= max_ratio else ">" if check.low > max_ratio else "vs"
        return f"{metric} ×{_ratio(check.estimate)} ({_ci(check, _ratio)}) {side} the {max_ratio:g}× limit"

    return _check(layer, metric, candidate, baseline, interval, max_ratio, True, f"≤ {max_ratio:g} × baseline", wording)


def value_check(layer, metric, candidate_nll: list[float], max_value, confidence) -> Check:
    """Hard ceiling on the candidate's perplexity: exp of its mean window NLL and interval."""
    interval = stats.mean_interval(candidate_nll, confidence).map(math.exp)

    def wording(check):
        return f"{metric} {check.estimate:.4g} ({_ci(check)}) vs the {max_value:g} ceiling"

    return _check(layer, metric, interval.estimate, None, interval, max_value, True, f"≤ {max_value:g}", wording)


def drop_check(layer, metric, candidate: list[float], baseline: list[float], max_drop_points, confidence) -> Check:
    """Accuracy change in points from paired 0/1 outcomes; passes when the whole interval is above −max_drop."""
    interval = stats.paired_proportion_difference(candidate, baseline, confidence).map(_points)
    candidate_value, baseline_value = _mean(candidate), _mean(baseline)
    count = len(candidate)
    gained = sum(1 for c, b in zip(candidate, baseline, strict=True) if c and not b)
    lost = sum(1 for c, b in zip(candidate, baseline, strict=True) if b and not c)

    def at(items: int) -> Interval:  # the same flip rates over ``items`` items
        return stats.flips_interval(gained * items / count, lost * items / count, items, confidence).map(_points)

    def wording(check):
        return (
            f"{metric} {check.estimate:+.1f} points ({_ci(check, lambda v: f'{v:+.1f}')}; {candidate_value:.0%} vs "
            f"baseline {baseline_value:.0%}) against the −{max_drop_points:g}-point limit"
        )

    limit, limit_text = -max_drop_points, f"≥ baseline − {max_drop_points:g} points"
    return _check(layer, metric, candidate_value, baseline_value, interval, limit, False, limit_text, wording, at)


def mean_check(layer, metric, values: list[float], bound, at_most: bool, confidence, baseline=None) -> Check:
    """A hard bound on the mean of per-item values (mean KL per window, share of same-top positions)."""
    interval = stats.mean_interval(values, confidence)

    def wording(check):
        return f"{metric} {check.estimate:.4g} ({_ci(check)}) vs the {'≤' if at_most else '≥'} {bound:g} limit"

    limit_text = f"{'≤' if at_most else '≥'} {bound:g}"
    return _check(layer, metric, interval.estimate, baseline, interval, bound, at_most, limit_text, wording)


def accuracy_floor_check(layer, metric, outcomes: list[float], minimum, confidence) -> Check:
    """A hard floor on the candidate's accuracy, on its Wilson interval."""
    interval = stats.proportion_interval(outcomes, confidence)

    def wording(check):
        return f"{metric} {check.estimate:.0%} ({_ci(check, lambda v: f'{v:.0%}')}) vs the ≥ {minimum:g} minimum"

    return _check(layer, metric, interval.estimate, None, interval, minimum, False, f"≥ {minimum:g}", wording)


def log_ratio_check(layer, metric, candidate: list[float], baseline: list[float], max_ratio, confidence) -> Check:
    """Latency: the geometric mean of per-repeat candidate/baseline ratios (paired by repeat), interval likewise."""
    interval = stats.paired_difference(
        [math.log(value) for value in candidate], [math.log(value) for value in baseline], confidence
    ).map(math.exp)

    def wording(check):
        return f"{metric} ratio ×{check.estimate:.3f} ({_ci(check, lambda v: f'{v:.3f}')}) vs the {max_ratio:g}× limit"

    limit_text = f"≤ {max_ratio:g} × baseline"
    return _check(layer, metric, _median(candidate), _median(baseline), interval, max_ratio, True, limit_text, wording)


def at_chance(baseline_outcomes: list[float], chance: float, confidence: float) -> bool:
    """Whether the baseline's accuracy cannot be told apart from chance: its interval reaches down to it."""
    return stats.proportion_interval(baseline_outcomes, confidence).low <= chance


def _points(share: float) -> float:
    return share * 100


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
