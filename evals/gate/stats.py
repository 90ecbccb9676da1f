"""Paired intervals and the three verdicts every blocking gate check uses.

Both sides of the gate are scored on the same items (perplexity windows, multiple-choice questions, needle prompts),
so each check is a statement about the mean of per-item *differences*, which cancels the items' own difficulty:
- continuous scores (per-window NLL, per-window KL, per-repeat log latency): Student-t interval of the mean; windows
  that lie near one another in a text are not independent draws (a scene shares its vocabulary and its difficulty),
  so their variance is read from batch means over thirds of the stretch (:func:`window_mean_interval`), and KL's on
  the log scale (:func:`log_mean_interval`);
- 0/1 outcomes (accuracies): the Agresti–Min interval for a difference of paired proportions (Wald after adding
  half a count to each cell of the 2×2 table), which stays honest when no item flips: ten agreeing prompts give
  ±16 points, not a zero-width interval.
A check PASSes when its whole interval lies inside the limit, BLOCKs when it lies entirely outside, and is
INCONCLUSIVE when it straddles the limit: the items measured cannot tell.

Familywise: a gate runs several blocking checks, and a lossless checkpoint must not be blocked by one of them by
chance. A BLOCK is therefore read from a wider interval (:func:`familywise_confidence`, Bonferroni over the blocking
checks: Holm's step-down rejects at least one hypothesis exactly when its smallest p-value clears Bonferroni's level,
and the gate's verdict only asks whether any check blocks). A PASS needs every check to pass, an intersection-union
test whose error is each check's own, so it keeps the unadjusted interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

PASS, BLOCK, INCONCLUSIVE = "pass", "block", "inconclusive"
STRETCH_GAP = 40  # windows nearer than this to one another share a stretch of text (gate-calibration.md, "intervals")
BATCHES = 3  # a stretch is read as this many consecutive batches
KL_SPREAD_FLOOR = 0.22  # the least relative spread of per-window KL an interval assumes (gate-calibration.md)
VERDICTS = (PASS, BLOCK, INCONCLUSIVE)


@dataclass
class Interval:
    """A mean over ``items`` with its two-sided interval at ``confidence``."""

    estimate: float
    low: float
    high: float
    items: int
    confidence: float

    def map(self, function) -> Interval:
        """The same interval on another (monotone increasing) scale, e.g. ``math.exp`` for a log ratio."""
        return Interval(function(self.estimate), function(self.low), function(self.high), self.items, self.confidence)


def _critical(confidence: float, degrees: int | None) -> float:
    """The two-sided critical value: normal, or Student-t with ``degrees`` degrees of freedom (exact for 1 and 2,
    else the Cornish-Fisher expansion of Abramowitz & Stegun 26.7.5: within 0.12% of the table at 95% from 3 degrees
    of freedom, within 0.4% at 99.8% from 5)."""
    tail = (1 + confidence) / 2
    z = NormalDist().inv_cdf(tail)
    if degrees is None:
        return z
    if degrees == 1:
        return math.tan(math.pi * (tail - 0.5))
    if degrees == 2:
        return (2 * tail - 1) / math.sqrt(2 * tail * (1 - tail))
    n = degrees
    return (
        z
        + (z**3 + z) / (4 * n)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * n**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * n**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * n**4)
    )


def mean_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """Student-t interval of the mean of ``values`` (paired differences, or one side's per-item scores)."""
    count = len(values)
    if count == 0:
        raise ValueError("an interval needs at least one item")
    mean = sum(values) / count
    if count == 1:
        return Interval(mean, -math.inf, math.inf, 1, confidence)
    half = _critical(confidence, count - 1) * math.sqrt(_variance(values)) / math.sqrt(count)
    return Interval(mean, mean - half, mean + half, count, confidence)


def welch_difference(first: list[float], second: list[float], confidence: float = 0.95) -> Interval:
    """Welch's interval of mean(first) − mean(second) over two independent samples of two or more each (not
    paired: e.g. two recipes' calibration draws, each cutting its own ids); degrees of freedom rounded down."""
    sides = [(_variance(values) / len(values), len(values) - 1) for values in (first, second)]
    spread = math.sqrt(sum(variance for variance, _ in sides))
    half = 0.0
    if spread:
        degrees = spread**4 / sum(variance**2 / free for variance, free in sides if variance)
        half = _critical(confidence, max(1, math.floor(degrees))) * spread
    difference = sum(first) / len(first) - sum(second) / len(second)
    return Interval(difference, difference - half, difference + half, len(first) + len(second), confidence)


def _variance(values: list[float]) -> float:
    """The sample variance (n − 1 in the denominator)."""
    mean = sum(values) / len(values)
    return sum((value - mean) ** 2 for value in values) / (len(values) - 1)


def batch_means_variance(values: list[float]) -> float:
    """Variance of the mean of ``values`` (in text order) from the means of :data:`BATCHES` consecutive batches: a
    dependence that reaches across the whole stretch shows up in it, where fixed blocks of a few windows miss it."""
    size = len(values) // BATCHES
    means = [sum(values[index * size : (index + 1) * size]) / size for index in range(BATCHES)]
    return _variance(means) / BATCHES


@dataclass
class _WindowSpread:
    mean: float
    variance: float  # of the mean, as used
    independent: float  # of the mean, were the windows independent
    degrees: int


def _window_spread(values: list[float], positions: list[int] | None) -> _WindowSpread:
    """Windows nearer than :data:`STRETCH_GAP` to one another are not independent draws (a scene or a source file
    shares its vocabulary and its difficulty, so the variance of a mean over k of them falls slower than 1/k): from
    six windows on, their variance is the larger of the independent one and the batch-means one over thirds in text
    order, with two degrees of freedom. Windows spread farther apart are independent (k − 1 degrees of freedom)."""
    count = len(values)
    places = positions if positions is not None else list(range(count))
    order = sorted(range(count), key=places.__getitem__)
    mean = sum(values) / count
    independent = _variance(values) / count
    nearest = min((places[b] - places[a] for a, b in zip(order, order[1:], strict=False)), default=STRETCH_GAP)
    if count >= 2 * BATCHES and nearest < STRETCH_GAP:
        batched = batch_means_variance([values[index] for index in order])
        return _WindowSpread(mean, max(batched, independent), independent, BATCHES - 1)
    return _WindowSpread(mean, independent, independent, count - 1)


def window_mean_interval(values: list[float], positions: list[int] | None = None, confidence: float = 0.95) -> Interval:
    """Interval of the mean of per-window ``values`` whose windows lie at ``positions`` in the text (None: side by
    side), its variance as :func:`_window_spread` reads it; its coverage at 12 to 56 windows, contiguous and
    spread, on 1200-window texts is in gate-calibration.md ("intervals")."""
    count = len(values)
    if count == 0:
        raise ValueError("an interval needs at least one item")
    if count == 1:
        return Interval(values[0], -math.inf, math.inf, 1, confidence)
    spread = _window_spread(values, positions)
    half = _critical(confidence, spread.degrees) * math.sqrt(spread.variance)
    return Interval(spread.mean, spread.mean - half, spread.mean + half, count, confidence)


def log_mean_interval(values: list[float], positions: list[int] | None = None, confidence: float = 0.95) -> Interval:
    """Interval of a positive mean read on the log scale, for KL: it cannot go below zero, and per-window KL is
    skewed (skewness 6-9) and differs between stretches of text by a factor. The relative half-width is the delta
    method's, t · (s / mean) / √k times the stretch's inflation, with s / mean floored at :data:`KL_SPREAD_FLOOR`: a
    few windows that happen to agree must not give a narrow interval, and the rare window of large KL that a slice
    missed pulls the text's mean above it (the floor is fitted on the calibration texts: gate-calibration.md)."""
    count = len(values)
    if count == 0:
        raise ValueError("an interval needs at least one item")
    mean = sum(values) / count
    if count == 1 or mean <= 0:
        return window_mean_interval(values, positions, confidence)
    spread = _window_spread(values, positions)
    relative = max(math.sqrt(spread.independent * count) / mean, KL_SPREAD_FLOOR) / math.sqrt(count)
    inflation = math.sqrt(spread.variance / spread.independent) if spread.independent > 0 else 1.0
    factor = math.exp(_critical(confidence, spread.degrees) * relative * inflation)
    return Interval(mean, mean / factor, mean * factor, count, confidence)


def paired_difference(
    candidate: list[float],
    baseline: list[float],
    confidence: float = 0.95,
    positions: list[int] | None = None,
) -> Interval:
    """Interval of mean(candidate − baseline) over paired continuous scores (read as :func:`window_mean_interval`
    when ``positions`` place the items in a text)."""
    _same_items(candidate, baseline)
    differences = [c - b for c, b in zip(candidate, baseline, strict=True)]
    if positions is None:
        return mean_interval(differences, confidence)
    return window_mean_interval(differences, positions, confidence)


def paired_proportion_difference(candidate: list[float], baseline: list[float], confidence: float = 0.95) -> Interval:
    """Agresti–Min interval of (candidate accuracy − baseline accuracy) over paired 0/1 outcomes."""
    _same_items(candidate, baseline)
    gained = sum(1 for c, b in zip(candidate, baseline, strict=True) if c and not b)
    lost = sum(1 for c, b in zip(candidate, baseline, strict=True) if b and not c)
    return flips_interval(gained, lost, len(candidate), confidence)


def flips_interval(gained: float, lost: float, count: int, confidence: float = 0.95) -> Interval:
    """The Agresti–Min interval from the counts of items only the candidate (``gained``) or only the baseline
    (``lost``) got right, out of ``count``; fractional counts project the same flip rates onto another count."""
    estimate = (gained - lost) / count
    adjusted_gained, adjusted_lost, adjusted_count = gained + 0.5, lost + 0.5, count + 2
    centre = (adjusted_gained - adjusted_lost) / adjusted_count
    variance = ((adjusted_gained + adjusted_lost) - (adjusted_gained - adjusted_lost) ** 2 / adjusted_count) / (
        adjusted_count**2
    )
    z = _critical(confidence, None)
    half = z * math.sqrt(variance)
    low, high = max(-1.0, centre - half), min(1.0, centre + half)
    return Interval(estimate, low, high, count, confidence)


def proportion_interval(outcomes: list[float], confidence: float = 0.95) -> Interval:
    """Wilson score interval of one side's accuracy (is the baseline distinguishable from chance?)."""
    count = len(outcomes)
    if count == 0:
        raise ValueError("an interval needs at least one item")
    share = sum(outcomes) / count
    z = _critical(confidence, None)
    denominator = 1 + z**2 / count
    centre = (share + z**2 / (2 * count)) / denominator
    half = z * math.sqrt(share * (1 - share) / count + z**2 / (4 * count**2)) / denominator
    return Interval(share, max(0.0, centre - half), min(1.0, centre + half), count, confidence)


def familywise_confidence(confidence: float, checks: int) -> float:
    """The two-sided level at which each of ``checks`` blocking checks may BLOCK so that a checkpoint inside every
    limit is wrongly blocked by any of them with probability at most (1 − ``confidence``) / 2 (Bonferroni)."""
    return 1 - (1 - confidence) / max(1, checks)


def verdict(interval: Interval, limit: float, at_most: bool) -> str:
    """PASS when the whole interval satisfies ``estimate ≤ limit`` (``at_most``) or ``≥ limit``; BLOCK when none of
    it does; INCONCLUSIVE when it straddles the limit."""
    low, high = interval.low, interval.high
    if at_most:
        return PASS if high <= limit else BLOCK if low > limit else INCONCLUSIVE
    return PASS if low >= limit else BLOCK if high < limit else INCONCLUSIVE


def items_to_decide(interval: Interval, limit: float, at=None) -> int | None:
    """About how many items in all would give an interval that excludes ``limit`` if the estimate and the per-item
    spread stayed as measured; None when the estimate sits on the limit (no number of items would decide) or the
    interval is unbounded. ``at(items)`` is the interval such a count would give (default: the half-width falls as
    1/√items, as a mean's does)."""
    half = interval.high - interval.estimate if limit > interval.estimate else interval.estimate - interval.low
    if interval.estimate == limit or not math.isfinite(half):
        return None
    if at is None:
        return max(interval.items + 1, math.ceil(interval.items * (half / abs(interval.estimate - limit)) ** 2))
    low, high = interval.items, interval.items
    while verdict(at(high), limit, at_most=True) == INCONCLUSIVE:
        low, high = high, high * 2
        if high > 10**7:
            return None
    while high - low > 1:  # the smallest count that decides
        middle = (low + high) // 2
        low, high = (middle, high) if verdict(at(middle), limit, at_most=True) == INCONCLUSIVE else (low, middle)
    return high


def _same_items(candidate: list[float], baseline: list[float]) -> None:
    if len(candidate) != len(baseline):
        raise ValueError(f"paired scores need the same items: {len(candidate)} candidate vs {len(baseline)} baseline")


def drop_p_value(gained: int, lost: int) -> float:
    """Exact one-sided McNemar test of "the candidate is no worse" on paired 0/1 outcomes: conditional on the
    ``gained + lost`` discordant items, each is a loss with probability 1/2 under that hypothesis, so the p-value is
    P(Binomial(gained + lost, 1/2) ≥ lost). Concordant items carry no information about the difference."""
    discordant = gained + lost
    if lost == 0:
        return 1.0
    tail = sum(math.comb(discordant, losses) for losses in range(lost, discordant + 1))
    return tail / 2**discordant


def noninferiority_verdict(gained: int, lost: int, count: int, margin: float, confidence: float,
                           block_confidence: float) -> tuple[str, Interval]:  # fmt: skip
    """The verdict on an accuracy change (a share, ``margin`` > 0 the largest drop allowed) and its Agresti–Min
    interval at ``confidence``. PASS: the interval's lower end is above −``margin``. BLOCK: not a pass, the exact
    McNemar test (:func:`drop_p_value`) rejects "no drop" at the one-sided level of ``block_confidence`` (the gate's
    familywise level), and the estimate is past −``margin``/2. The half-margin indifference zone keeps a real but
    small drop (a lossless quantizer's −0.2 points) from blocking merely because many items make it significant:
    the rule blocks what it can tell is a drop of more than half the allowed one. Else INCONCLUSIVE."""
    interval = flips_interval(gained, lost, count, confidence)
    if interval.low > -margin:
        return PASS, interval
    significant = drop_p_value(gained, lost) <= (1 - block_confidence) / 2
    return (BLOCK if significant and interval.estimate < -margin / 2 else INCONCLUSIVE), interval


def noninferiority_items_to_decide(gained: int, lost: int, count: int, margin: float, confidence: float,
                                   block_confidence: float) -> int | None:  # fmt: skip
    """The smallest item count in all that :func:`noninferiority_verdict` would decide if the flip rates stayed as
    measured (counts rounded to whole items); None when none up to ten million would (no flips measured, or the
    estimate sits on the edge of the indifference zone)."""

    def decided(items: int) -> bool:
        scaled_gained, scaled_lost = round(gained * items / count), round(lost * items / count)
        verdict = noninferiority_verdict(scaled_gained, scaled_lost, items, margin, confidence, block_confidence)[0]
        return verdict != INCONCLUSIVE

    low, high = count, 2 * count
    while not decided(high):
        low, high = high, high * 2
        if high > 10**7:
            return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if decided(middle) else (middle, high)
    return high


def planned_items(discordance: float, margin: float, power: float, confidence: float) -> int:
    """Items a paired 0/1 comparison needs for the exact McNemar test at the two-sided level ``confidence`` (one-sided
    (1 − confidence)/2, the BLOCK level) to reject "no drop" with probability ``power`` when the true drop is
    ``margin`` (a share) and a share ``discordance`` of the items flip one way or the other: (z_block + z_power)² ·
    discordance / margin², the normal approximation (the variance of a paired difference is discordance − drop²,
    bounded by discordance, so the count errs high)."""
    if not 0 < margin < 1:
        raise ValueError(f"a margin is a share in (0, 1), not {margin}")
    z_block = NormalDist().inv_cdf((1 + confidence) / 2)
    z_power = NormalDist().inv_cdf(power)
    return max(1, math.ceil((z_block + z_power) ** 2 * discordance / margin**2))
