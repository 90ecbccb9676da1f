"""The lm_eval layer's non-inferiority rule, its planned item count and pilot, and the baseline's cached outcomes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import save, scale_by_noise, tiny_model_for

from compress.base.errors import CompressError
from compress.evals.gate import item_plan, stats
from compress.evals.gate.checks import noninferiority_check
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.policy import resolve_policy


def outcomes(count: int, gained: int, lost: int) -> tuple[list[float], list[float]]:
    """Paired 0/1 outcomes with ``gained`` items only the candidate gets right and ``lost`` only the baseline does;
    the concordant rest half right, half wrong."""
    rest = count - gained - lost
    candidate = [1.0] * gained + [0.0] * lost + [1.0] * (rest // 2) + [0.0] * (rest - rest // 2)
    baseline = [0.0] * gained + [1.0] * lost + [1.0] * (rest // 2) + [0.0] * (rest - rest // 2)
    return candidate, baseline


def test_the_rule_passes_a_small_drop_blocks_a_large_one_and_is_inconclusive_between():
    passing = noninferiority_check("lm_eval", "acc", *outcomes(1000, 20, 25), 3.0, 0.95, 0.99375)
    assert passing.verdict == stats.PASS and passing.low > -3.0 and passing.estimate == pytest.approx(-0.5)
    blocking = noninferiority_check("lm_eval", "acc", *outcomes(1000, 30, 80), 3.0, 0.95, 0.99375)
    assert blocking.verdict == stats.BLOCK and blocking.estimate == pytest.approx(-5.0)
    assert "McNemar one-sided p=" in blocking.summary and blocking.block_confidence == 0.99375
    undecided = noninferiority_check("lm_eval", "acc", *outcomes(200, 8, 12), 3.0, 0.95, 0.99375)
    assert undecided.verdict == stats.INCONCLUSIVE and undecided.items_to_decide > 200
    needed = undecided.items_to_decide

    def verdict_at(items: int) -> str:
        gained, lost = round(8 * items / 200), round(12 * items / 200)
        return stats.noninferiority_verdict(gained, lost, items, 0.03, 0.95, 0.99375)[0]

    assert verdict_at(needed) == stats.BLOCK and verdict_at(needed - 1) == stats.INCONCLUSIVE


def test_a_significant_drop_inside_half_the_margin_is_not_blocked():
    # With BLOCK read at a laxer level than the PASS interval, significance alone would block a -1-point drop.
    gained, lost, count = 80, 100, 2000
    assert stats.drop_p_value(gained, lost) < 0.10
    verdict, interval = stats.noninferiority_verdict(gained, lost, count, 0.03, 0.9999, 0.80)
    assert interval.low < -0.03 and interval.estimate == pytest.approx(-0.01)
    assert verdict == stats.INCONCLUSIVE
    assert stats.noninferiority_verdict(30, 80, 1000, 0.03, 0.9999, 0.80)[0] == stats.BLOCK


def test_the_exact_mcnemar_p_value_is_the_binomial_tail():
    assert stats.drop_p_value(0, 5) == pytest.approx(1 / 32)
    assert stats.drop_p_value(3, 3) == pytest.approx(sum(math.comb(6, k) for k in range(3, 7)) / 64)
    assert stats.drop_p_value(4, 0) == 1.0


def test_planned_items_is_the_paired_normal_approximation():
    # (1.959964 + 0.841621)^2 * 0.12 / 0.03^2 = 7.848879 * 133.33 = 1046.5
    assert stats.planned_items(0.12, 0.03, 0.8, 0.95) == 1047
    # the familywise level of eight blocking checks: z = 2.734369, (2.734369 + 0.841621)^2 * 0.1 / 0.0009 = 1420.8
    assert stats.planned_items(0.1, 0.03, 0.8, 1 - 0.05 / 8) == 1421
    with pytest.raises(ValueError, match="a margin is a share"):
        stats.planned_items(0.1, 3.0, 0.8, 0.95)


def test_bad_plan_settings_are_named_with_their_fix():
    for settings, message in (
        ({"pilot_items": 5}, r"gate.lm_eval.pilot_items=5; use at least 10"),
        ({"power": 1.2}, r"gate.lm_eval.power=1.2; use a probability in \[0.5, 1\)"),
        ({"pilot_items": 100, "max_items": 50}, r"gate.lm_eval.max_items=50; use null or a count of at least 100"),
        ({"pilot_items": 100, "benchmark": None, "tasks": ["hellaswag"]}, r"pilot_items needs gate.lm_eval.benchmark"),
    ):
        with pytest.raises(CompressError, match=message):
            resolve_policy({"lm_eval": settings})


def test_the_pool_interleaves_benchmarks_in_proportion():
    order = item_plan.pooled_order([570, 1838])
    assert len(order) == 2408
    assert item_plan.counts_at(order, 2, 200) in ([47, 153], [48, 152])
    assert item_plan.counts_at(order, 2, 2408) == [570, 1838]


def gate_context(tmp_path: Path, **lm_eval) -> GateContext:
    policy = resolve_policy(
        {"cache_dir": str(tmp_path / "cache"), "lm_eval": {"benchmark": ["arc_easy", "piqa"], **lm_eval}}
    )
    return GateContext(policy, [], None, 512, tmp_path, selected=["lm_eval"])


def items_of(results: dict) -> list[int]:
    return [len(result["outcomes"]["acc"]) for result in results.values()]


def test_the_pilot_plans_the_count_from_the_discordance_it_measures(tmp_path, tokenizer):
    context = gate_context(tmp_path, pilot_items=20, max_items=60, batch_size=8, max_length=256)
    model = tiny_model_for(tokenizer)
    baseline = Subject("baseline", None, tokenizer, None, model=model)
    reference, plan = item_plan.measure_benchmarks(context, baseline, None)
    assert items_of(reference) == [14, 46] and plan["scored"] == 60  # the baseline: the whole pool, for any plan
    same = Subject("candidate", None, tokenizer, None, model=model)
    _, plan = item_plan.measure_benchmarks(context, same, reference)
    assert plan["discordance"] == 0.0 and plan["scored"] == 20  # no flips in the pilot: nothing more to score
    broken = Subject("candidate", None, tokenizer, None, model=scale_by_noise(tiny_model_for(tokenizer)))
    results, plan = item_plan.measure_benchmarks(context, broken, reference)
    assert plan["discordance"] > 0.1 and plan["planned"] > 60 and plan["scored"] == 60 and plan["pilot"] == 20
    assert items_of(results) == [14, 46]
    at_once, _ = item_plan.measure_benchmarks(
        gate_context(tmp_path, pilot_items=None, max_items=60, max_length=256), broken, reference
    )
    assert [result["outcomes"] for result in results.values()] == [result["outcomes"] for result in at_once.values()]


def test_a_cached_baseline_is_not_scored_again_and_another_setting_misses(tmp_path, tokenizer):
    folder = save(tiny_model_for(tokenizer), tokenizer, tmp_path / "base")
    context = gate_context(tmp_path, pilot_items=None, max_items=30, max_length=256)
    loaded = Subject("baseline", folder, tokenizer, None, folder, model=tiny_model_for(tokenizer))
    assert item_plan.cached_baseline(context, loaded) is None
    scored, _ = item_plan.measure_benchmarks(context, loaded, None)
    not_loaded = Subject("baseline", folder, tokenizer, None, folder)  # no model: scoring would fail
    assert item_plan.measure_benchmarks(context, not_loaded, None)[0] == scored
    assert item_plan.cached_baseline(context, not_loaded) == scored
    assert (
        item_plan.cached_baseline(gate_context(tmp_path, pilot_items=None, max_items=30, max_length=512), not_loaded)
        is None
    )
    with pytest.raises(AttributeError):  # a miss scores, and there is no model to score with
        item_plan.measure_benchmarks(
            gate_context(tmp_path, pilot_items=None, max_items=30, max_length=512), not_loaded, None
        )
