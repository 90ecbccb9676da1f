"""Gate v3's statistics: intervals over blocks of neighbouring windows, spread windows, familywise BLOCKs."""

import math
import random

import pytest

from compress.evals.gate import checks, stats
from compress.evals.gate.policy import resolve_policy
from compress.evals.gate.runner import blocking_checks
from compress.evals.gate.windows import spread_order


def test_blocks_follow_stretches_of_adjacent_windows():
    assert stats.blocks_of([0, 1, 2, 3, 4, 5, 6, 7, 8], 4) == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert stats.blocks_of([0, 8, 4, 12], 4) == [0, 2, 1, 3]  # spread windows: each its own block
    assert stats.blocks_of([5, 6, 20, 21, 22], 2) == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="at least one item"):
        stats.blocks_of([0, 1], 0)


def test_spread_windows_keep_the_independent_interval():
    values = [random.Random(seed).gauss(0, 1) for seed in range(12)]
    spread = stats.block_mean_interval(values, [3 * index for index in range(12)], 4)
    independent = stats.mean_interval(values)
    assert (spread.low, spread.high) == pytest.approx((independent.low, independent.high))


def test_a_contiguous_run_with_a_drifting_mean_gets_a_wider_interval():
    """Two halves of one text at different levels (two scenes): windows side by side are not independent draws, and
    reading the run in blocks must say so."""
    rng = random.Random(0)
    values = [(0.0 if index < 12 else 1.0) + rng.gauss(0, 0.2) for index in range(24)]
    independent = stats.mean_interval(values)
    blocked = stats.block_mean_interval(values, list(range(24)), 4)
    assert blocked.estimate == pytest.approx(independent.estimate)
    assert blocked.high - blocked.low > 1.5 * (independent.high - independent.low)


def test_a_short_run_is_read_across_at_least_three_blocks():
    values = [0.1, 0.2, 0.3, 0.2, 0.1, 0.3, 0.2, 0.25]
    assert stats.block_mean_interval(values[:3], [0, 1, 2], 4) == stats.mean_interval(values[:3])  # too few to block
    eight = stats.block_mean_interval(values, list(range(8)), 4)  # blocks of two, not two blocks of four
    two_each = stats.block_mean_interval(values, list(range(8)), 2)
    assert (eight.low, eight.high) == (two_each.low, two_each.high) and math.isfinite(eight.high)


def test_twelve_contiguous_windows_are_three_blocks_of_four():
    """The quick gate's 12 windows side by side: blocks of three under-covered on code (a file spans more than three
    windows: 92% / 88% over 100 slices, gate-calibration.md), so the run is read as three blocks of four."""
    values = [random.Random(seed).gauss(0, 1) for seed in range(12)]
    read = stats.block_mean_interval(values, list(range(12)), 8)
    fours = stats.block_mean_interval(values, list(range(12)), 4)
    threes = stats.block_mean_interval(values, list(range(12)), 3)
    assert (read.low, read.high) == (fours.low, fours.high) != (threes.low, threes.high)


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
    # perplexity and kl on 3 texts (the evaluation text, code, technical): 6; latency 1 (auto counts: stricter is
    # safe); lm_eval, json, needle, long_context advisory by default
    assert blocking_checks(default, default.layers) == 7
    fewer = resolve_policy({"domains": [], "latency": {"enabled": False}})
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
    linear = stats.block_mean_interval(values)
    assert linear.low < 0  # the symmetric interval would claim a negative KL possible
    check = checks.kl_check("kl", "kl_mean", values, 0.05, 0.95)
    spread = (linear.high - linear.estimate) / linear.estimate
    assert check.estimate == pytest.approx(linear.estimate)
    expected = (linear.estimate / math.exp(spread), linear.estimate * math.exp(spread))
    assert (check.low, check.high) == pytest.approx(expected)
    assert 0 < check.low and check.high - check.estimate > check.estimate - check.low and check.verdict == stats.PASS
    near = checks.kl_check("kl", "kl_mean", [0.049, 0.051, 0.050, 0.052], 0.05, 0.95)
    assert near.verdict == stats.INCONCLUSIVE


def test_welch_difference_matches_the_textbook_case_and_is_exact_without_spread():
    """[1, 2, 3] against [4, 5, 6]: variances 1 and 1, standard error sqrt(2/3), 4 degrees of freedom (t 2.776)."""
    found = stats.welch_difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert found.estimate == pytest.approx(-3.0)
    assert found.high - found.estimate == pytest.approx(2.776 * math.sqrt(2 / 3), rel=2e-3)
    assert found.estimate - found.low == pytest.approx(found.high - found.estimate)
    still = stats.welch_difference([2.0, 2.0], [1.0, 1.0, 1.0])
    assert (still.low, still.high) == (1.0, 1.0)
