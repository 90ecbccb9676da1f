"""One limit applied to one signal, judged on the signal's interval: the lines a reviewer reads.

Each constructor turns paired per-item scores into a :class:`Check` whose ``estimate`` is what the limit speaks of
(a perplexity ratio, an accuracy change in points, a mean KL), with its interval, the verdict and, when the interval
straddles the limit, about how many items would decide it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from compress.evals.gate import stats
from compress.evals.gate.stats import BLOCK, INCONCLUSIVE, PASS, Interval


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
    # the wider interval a BLOCK is read from when several blocking checks share the gate (familywise control)
    block_confidence: float | None = None
    block_low: float | None = None
    block_high: float | None = None
    domain: str | None = None  # the panel's kind of text it judged (gate.domains); None: the evaluation text

    @property
    def base_metric(self) -> str:
        """The metric without its domain: ``perplexity`` for ``perplexity [code]``."""
        return self.metric if self.domain is None else self.metric.removesuffix(f" [{self.domain}]")

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def describe(self) -> str:
        return self.summary


def _check(
    layer, metric, candidate, baseline, interval_at: Callable[[float], Interval], confidence, limit, at_most,
    limit_text, wording, at=None,
) -> Check:  # fmt: skip
    """``interval_at(level)``: the check's interval at any confidence level, kept (outside the dataclass fields, so
    gate.json stays plain data) for :func:`familywise`."""
    interval = interval_at(confidence)
    verdict = stats.verdict(interval, limit, at_most)
    needed = stats.items_to_decide(interval, limit, at) if verdict == INCONCLUSIVE else None
    check = Check(
        layer, metric, candidate, baseline, interval.estimate, interval.low, interval.high, limit, limit_text,
        verdict, interval.items, interval.confidence, needed,
    )  # fmt: skip
    check.summary = f"{wording(check)}: {verdict.upper()}" + _more(check)
    check._rejudge = (interval_at, at_most, wording)
    return check


def familywise(check: Check, block_confidence: float) -> Check:
    """Read ``check``'s BLOCK again from its interval at ``block_confidence`` (:func:`stats.familywise_confidence`):
    a block that the wider interval no longer supports becomes INCONCLUSIVE. A PASS stays as it is (intersection-
    union: every check must pass). Checks made without an interval function are left alone."""
    rejudge = getattr(check, "_rejudge", None)
    if rejudge is None or block_confidence <= check.confidence or check.verdict != BLOCK:
        return check
    interval_at, at_most, wording = rejudge
    wide = interval_at(block_confidence)
    check.block_confidence, check.block_low, check.block_high = block_confidence, wide.low, wide.high
    if stats.verdict(wide, check.limit, at_most) == BLOCK:
        return check
    check.verdict = INCONCLUSIVE
    check.summary = (
        f"{wording(check)}: INCONCLUSIVE (outside the limit at {check.confidence:.0%}, but not at the familywise "
        f"{block_confidence:.2%} a block needs: {wide.low:.4g}–{wide.high:.4g}; more items would decide it)"
    )
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


def ratio_check(
    layer, metric, candidate_nll: list[float], baseline_nll: list[float], max_ratio, confidence, positions=None
) -> Check:
    """Perplexity ratio from per-window mean NLLs: exp of the mean per-window difference, interval likewise (over
    :func:`stats.window_mean_interval` when ``positions`` place the windows in the text)."""

    def interval_at(level: float) -> Interval:
        return stats.paired_difference(candidate_nll, baseline_nll, level, positions).map(math.exp)

    candidate, baseline = math.exp(_mean(candidate_nll)), math.exp(_mean(baseline_nll))

    def wording(check):
        side = "≤" if check.high <= max_ratio else ">" if check.low > max_ratio else "vs"
        return f"{metric} ×{_ratio(check.estimate)} ({_ci(check, _ratio)}) {side} the {max_ratio:g}× limit"

    limit_text = f"≤ {max_ratio:g} × baseline"
    return _check(layer, metric, candidate, baseline, interval_at, confidence, max_ratio, True, limit_text, wording)


def value_check(layer, metric, candidate_nll: list[float], max_value, confidence, positions=None) -> Check:
    """Hard ceiling on the candidate's perplexity: exp of its mean window NLL and interval."""

    def interval_at(level: float) -> Interval:
        return stats.window_mean_interval(candidate_nll, positions, level).map(math.exp)

    def wording(check):
        return f"{metric} {check.estimate:.4g} ({_ci(check)}) vs the {max_value:g} ceiling"

    candidate = math.exp(_mean(candidate_nll))
    return _check(layer, metric, candidate, None, interval_at, confidence, max_value, True, f"≤ {max_value:g}", wording)


def drop_check(layer, metric, candidate: list[float], baseline: list[float], max_drop_points, confidence) -> Check:
    """Accuracy change in points from paired 0/1 outcomes; passes when the whole interval is above −max_drop."""

    def interval_at(level: float) -> Interval:
        return stats.paired_proportion_difference(candidate, baseline, level).map(_points)

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
    return _check(
        layer, metric, candidate_value, baseline_value, interval_at, confidence, limit, False, limit_text, wording, at
    )


def noninferiority_check(
    layer, metric, candidate: list[float], baseline: list[float], max_drop_points, confidence, block_confidence
) -> Check:
    """Accuracy change in points from paired 0/1 outcomes under :func:`stats.noninferiority_verdict`: PASS on the
    interval at ``confidence``, BLOCK on the exact McNemar test at ``block_confidence`` (the gate's familywise level,
    applied here: :func:`familywise` leaves this check alone) beyond half the limit."""
    stats._same_items(candidate, baseline)
    count = len(candidate)
    gained = sum(1 for c, b in zip(candidate, baseline, strict=True) if c and not b)
    lost = sum(1 for c, b in zip(candidate, baseline, strict=True) if b and not c)
    margin = max_drop_points / 100
    verdict, interval = stats.noninferiority_verdict(gained, lost, count, margin, confidence, block_confidence)
    points = interval.map(_points)
    needed = None
    if verdict == INCONCLUSIVE:
        needed = stats.noninferiority_items_to_decide(gained, lost, count, margin, confidence, block_confidence)
    check = Check(
        layer, metric, _mean(candidate), _mean(baseline), points.estimate, points.low, points.high, -max_drop_points,
        f"≥ baseline − {max_drop_points:g} points", verdict, count, confidence, needed,
        block_confidence=block_confidence,
    )  # fmt: skip
    p_value = stats.drop_p_value(gained, lost)
    check.summary = (
        f"{metric} {check.estimate:+.1f} points ({_ci(check, lambda v: f'{v:+.1f}')}; {check.candidate:.0%} vs "
        f"baseline {check.baseline:.0%}; {gained} gained, {lost} lost, McNemar one-sided p={p_value:.2g} against "
        f"{(1 - block_confidence) / 2:.2g}) against the −{max_drop_points:g}-point limit (a block also needs the "
        f"estimate past −{max_drop_points / 2:g}): {verdict.upper()}" + _more(check)
    )
    return check


def kl_check(layer, metric, values: list[float], bound, confidence, positions=None) -> Check:
    """A ceiling on the mean KL per window, its interval on the log scale (:func:`stats.log_mean_interval`)."""
    return mean_check(layer, metric, values, bound, True, confidence, None, positions, stats.log_mean_interval)


def mean_check(
    layer, metric, values: list[float], bound, at_most: bool, confidence, baseline=None, positions=None,
    interval=stats.window_mean_interval,
) -> Check:  # fmt: skip
    """A hard bound on the mean of per-item values (mean KL per window, share of same-top positions), ``interval``
    reading the windows' places in the text from ``positions``."""

    def interval_at(level: float) -> Interval:
        return interval(values, positions, level)

    def wording(check):
        return f"{metric} {check.estimate:.4g} ({_ci(check)}) vs the {'≤' if at_most else '≥'} {bound:g} limit"

    limit_text = f"{'≤' if at_most else '≥'} {bound:g}"
    return _check(layer, metric, _mean(values), baseline, interval_at, confidence, bound, at_most, limit_text, wording)


def accuracy_floor_check(layer, metric, outcomes: list[float], minimum, confidence) -> Check:
    """A hard floor on the candidate's accuracy, on its Wilson interval."""

    def interval_at(level: float) -> Interval:
        return stats.proportion_interval(outcomes, level)

    def wording(check):
        return f"{metric} {check.estimate:.0%} ({_ci(check, lambda v: f'{v:.0%}')}) vs the ≥ {minimum:g} minimum"

    share = _mean(outcomes)
    return _check(layer, metric, share, None, interval_at, confidence, minimum, False, f"≥ {minimum:g}", wording)


def log_ratio_check(layer, metric, candidate: list[float], baseline: list[float], max_ratio, confidence) -> Check:
    """Latency: the geometric mean of per-repeat candidate/baseline ratios (paired by repeat), interval likewise."""
    log_candidate, log_baseline = [math.log(value) for value in candidate], [math.log(value) for value in baseline]

    def interval_at(level: float) -> Interval:
        return stats.paired_difference(log_candidate, log_baseline, level).map(math.exp)

    def wording(check):
        return f"{metric} ratio ×{check.estimate:.3f} ({_ci(check, lambda v: f'{v:.3f}')}) vs the {max_ratio:g}× limit"

    limit_text = f"≤ {max_ratio:g} × baseline"
    return _check(
        layer, metric, _median(candidate), _median(baseline), interval_at, confidence, max_ratio, True, limit_text,
        wording,
    )  # fmt: skip


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
