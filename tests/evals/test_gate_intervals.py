"""The gate's statistics: intervals over windows of a text (near or spread), KL on the log scale, familywise BLOCKs."""

import math
import random

import pytest

from compress.evals.gate import checks, stats
from compress.evals.gate.policy import resolve_policy
from compress.evals.gate.runner import blocking_checks
from compress.evals.gate.windows import spread_order


def test_windows_spread_far_apart_keep_the_independent_interval():
    values = [random.Random(seed).gauss(0, 1) for seed in range(12)]
    far = stats.window_mean_interval(values, [stats.STRETCH_GAP * index for index in range(12)])
    independent = stats.mean_interval(values)
    assert (far.low, far.high) == pytest.approx((independent.low, independent.high))
    near = stats.window_mean_interval(values, [(stats.STRETCH_GAP - 1) * index for index in range(12)])
    assert near.high - near.low > far.high - far.low  # two degrees of freedom at least


def test_a_stretch_with_a_drifting_mean_gets_a_wider_interval():
    """Two halves of one text at different levels (two scenes): windows side by side are not independent draws, and
    the batch means over thirds must say so."""
    rng = random.Random(0)
    values = [(0.0 if index < 12 else 1.0) + rng.gauss(0, 0.2) for index in range(24)]
    independent = stats.mean_interval(values)
    stretch = stats.window_mean_interval(values, list(range(24)))
    assert stretch.estimate == pytest.approx(independent.estimate)
    assert stretch.high - stretch.low > 3 * (independent.high - independent.low)


def test_the_batch_means_follow_text_order_not_scoring_order():
    """The gate scores windows in spread order; the thirds are thirds of the text."""
    rng = random.Random(2)
    in_text = [(0.0 if index < 12 else 1.0) + rng.gauss(0, 0.2) for index in range(24)]
    order = spread_order(24)
    scored = [in_text[position] for position in order]
    read, expected = stats.window_mean_interval(scored, order), stats.window_mean_interval(in_text, list(range(24)))
    assert (read.low, read.high) == pytest.approx((expected.low, expected.high))


def test_the_batch_means_variance_is_that_of_three_batch_means():
    values = [1.0, 1.0, 2.0, 2.0, 6.0, 6.0]
    assert stats.batch_means_variance(values) == pytest.approx(7.0 / 3)  # means 1, 2, 6: variance 7, over 3
    five, independent = stats.window_mean_interval(values[:5]), stats.mean_interval(values[:5])
    assert (five.low, five.high) == pytest.approx((independent.low, independent.high))  # too few for thirds


def test_spread_order_lists_every_window_once_and_any_prefix_is_spread():
    for count in (1, 2, 7, 53, 64, 480):
        order = spread_order(count)
        assert sorted(order) == list(range(count))
    order = spread_order(480)
    for size in (12, 24):
        prefix = sorted(order[:size])
        gaps = [after - before for before, after in zip(prefix, prefix[1:], strict=False)]
        assert min(gaps) >= 480 // (2 * size) and max(gaps) <= 2 * 480 // size


def test_familywise_turns_a_marginal_block_inconclusive_and_keeps_a_clear_one():
    rng = random.Random(1)
    baseline = [rng.gauss(3.0, 0.3) for _ in range(24)]
    candidate = [value + 0.06 + rng.gauss(0, 0.05) for value in baseline]
    check = checks.ratio_check("perplexity", "perplexity", candidate, baseline, 1.05, 0.95)
    assert check.verdict == "block"
    margin = check.low * 0.9999  # a limit just under the 95% interval: blocks at 95%, not at 99.5%
    marginal = checks.ratio_check("perplexity", "perplexity", candidate, baseline, margin, 0.95)
    assert marginal.verdict == "block"
    level = stats.familywise_confidence(0.95, 10)
    assert level == pytest.approx(0.995)
    assert checks.familywise(marginal, level).verdict == "inconclusive"
    assert "familywise 99.50%" in marginal.summary and marginal.block_low < margin
    clear = checks.ratio_check("perplexity", "perplexity", candidate, baseline, 1.0, 0.95)
    assert checks.familywise(clear, level).verdict == "block" and clear.block_low > 1.0


def test_familywise_never_touches_a_pass():
    outcomes = [1.0] * 40
    check = checks.drop_check("lm_eval", "acc", outcomes, outcomes, 30.0, 0.95)
    assert check.verdict == "pass"
    assert checks.familywise(check, 0.999).verdict == "pass" and check.block_confidence is None


def test_the_family_counts_the_blocking_limits_the_policy_sets():
    default = resolve_policy(None)
    # perplexity and kl on 3 texts (the evaluation text, code, technical): 6; lm_eval 1 (pooled); latency 1 (auto
    # counts: stricter is safe); json, needle, long_context advisory by default
    assert blocking_checks(default, default.layers) == 8
    fewer = resolve_policy({"domains": [], "latency": {"enabled": False}, "lm_eval": {"blocking": False}})
    assert blocking_checks(fewer, fewer.layers) == 2
    powered = resolve_policy({"domains": [], "lm_eval": {"blocking": True}, "json": {"blocking": True},
                              "needle": {"blocking": True}, "long_context": {"blocking": True}})  # fmt: skip
    # perplexity 1, kl 1, lm_eval 1, json 2, needle 1, long_context 3 (one per task), latency 1
    assert blocking_checks(powered, powered.layers) == 10
    assert blocking_checks(default, ["perplexity", "kl"]) == 6


def test_each_domain_of_the_panel_adds_its_window_checks_to_the_family():
    one = resolve_policy({"domains": ["code"]})
    assert blocking_checks(one, ["perplexity", "kl"]) == 2 * 2


def test_an_unknown_domain_is_refused_naming_the_choices():
    from compress.base.errors import CompressError

    with pytest.raises(CompressError, match=r"gate.domains has unknown domains \['poetry'\]; choose from .*code"):
        resolve_policy({"domains": ["poetry"]})


def test_the_kl_check_reads_its_interval_on_the_log_scale():
    """KL is positive and differs between stretches of text by a factor: its interval is read on the log scale
    (delta method), never below zero, longer above the estimate than below it."""
    values = [0.0001, 0.0002, 0.0001, 0.006, 0.0001, 0.0002, 0.004, 0.0001]
    far = [stats.STRETCH_GAP * index for index in range(len(values))]
    linear = stats.window_mean_interval(values, far)
    assert linear.low < 0  # the symmetric interval would claim a negative KL possible
    check = checks.kl_check("kl", "kl_mean", values, 0.05, 0.95, far)
    spread = (linear.high - linear.estimate) / linear.estimate
    assert check.estimate == pytest.approx(linear.estimate)
    expected = (linear.estimate / math.exp(spread), linear.estimate * math.exp(spread))
    assert (check.low, check.high) == pytest.approx(expected)
    assert 0 < check.low and check.high - check.estimate > check.estimate - check.low and check.verdict == stats.PASS


def test_windows_that_agree_still_get_the_floor_of_kl_spread():
    """Eight windows of nearly equal KL would give a near-zero interval; the relative spread is floored."""
    values = [0.0300, 0.0301, 0.0299, 0.0300, 0.0302, 0.0298, 0.0300, 0.0301]
    far = [stats.STRETCH_GAP * index for index in range(len(values))]
    interval = stats.log_mean_interval(values, far)
    relative = stats._critical(0.95, len(values) - 1) * stats.KL_SPREAD_FLOOR / math.sqrt(len(values))
    assert interval.high == pytest.approx(interval.estimate * math.exp(relative))
    assert interval.low == pytest.approx(interval.estimate / math.exp(relative))


def test_a_stretch_of_windows_widens_the_kl_interval_by_its_batch_means():
    rng = random.Random(3)
    values = [(0.01 if index < 12 else 0.05) * math.exp(rng.gauss(0, 0.3)) for index in range(24)]
    far = stats.log_mean_interval(values, [stats.STRETCH_GAP * index for index in range(24)])
    near = stats.log_mean_interval(values, list(range(24)))
    assert near.high / near.estimate > 2 * (far.high / far.estimate - 1) + 1
