"""``benchmarks/gate_verdicts.py``: how slices are resampled from stored scores, and how the layers' verdicts combine
into the gate's, on tiny deterministic inputs (the gate's own checks judge every slice)."""

from __future__ import annotations

import json

import pytest

from benchmarks import gate_budget
from benchmarks import gate_verdicts as gv
from compress.commands.gate import load_policy
from compress.evals.gate.policy import resolve_policy


def test_spread_draws_take_one_window_from_each_stretch():
    draws = gv.spread_draws(100, 10, 50, seed=3)
    assert len(draws) == 50 and draws == gv.spread_draws(100, 10, 50, seed=3)
    for indices in draws:
        assert [index // 10 for index in indices] == list(range(10))
    assert len({tuple(indices) for indices in draws}) > 1  # random offsets, not one fixed slice
    with pytest.raises(ValueError, match="cannot draw 11 spread windows out of 10"):
        gv.spread_draws(10, 11, 1, seed=0)


def test_contiguous_draws_use_distinct_starts_while_they_last():
    draws = gv.contiguous_draws(12, 4, 9, seed=1)
    assert all(indices == list(range(indices[0], indices[0] + 4)) for indices in draws)
    assert sorted(indices[0] for indices in draws) == list(range(9))  # 9 starts exist: each once
    assert len(gv.contiguous_draws(12, 4, 20, seed=1)) == 20  # more draws than starts: starts repeat


def test_item_draws_without_replacement_below_the_task_and_bootstrap_at_it():
    slices, how = gv.item_draws(30, 10, 5, seed=0)
    assert how == "without replacement" and all(len(set(s)) == 10 for s in slices)
    slices, how = gv.item_draws(30, None, 5, seed=0)
    assert how == "bootstrap (with replacement)" and all(len(s) == 30 for s in slices)
    assert any(len(set(s)) < 30 for s in slices)  # a bootstrap repeats items
    assert gv.item_draws(30, 30, 1, seed=0)[1] == "bootstrap (with replacement)"


def test_combine_any_block_blocks_all_pass_passes_else_inconclusive():
    windows = ["pass", "pass", "block", "inconclusive", "pass"]
    accuracy = ["pass", "inconclusive", "inconclusive", "block", "block"]
    assert gv.combine(windows, accuracy) == ["pass", "inconclusive", "block", "block", "block"]
    with pytest.raises(ValueError, match="different numbers of slices"):
        gv.combine(["pass"], ["pass", "pass"])


def test_tally_gives_every_verdict_its_clopper_pearson_bounds():
    found = gv.tally(["pass"] * 19 + ["inconclusive"])
    assert found["slices"] == 20 and found["pass"] == 0.95 and found["block"] == 0
    assert found["block_bounds"][1] == pytest.approx(1 - 0.025 ** (1 / 20), abs=1e-6)  # 0 of 20: 16.8%
    assert found["inconclusive_bounds"][0] > 0
    low, high = gv.clopper_pearson(100, 100)
    assert high == 1.0 and low == pytest.approx(0.025 ** (1 / 100), abs=1e-6)


def _quick():
    return resolve_policy(load_policy("quick", []))


def test_accuracy_verdicts_pass_a_lossless_candidate_and_block_a_large_drop():
    policy = _quick()
    baseline = [1.0, 0.0] * 150  # 300 items, half right
    slices, _ = gv.item_draws(300, 200, 20, seed=0)
    assert set(gv.accuracy_verdicts(baseline, baseline, slices, 5.0, policy, 0.99)) == {"pass"}
    lost = [0.0 if index % 4 == 0 else value for index, value in enumerate(baseline)]  # −25 points
    assert set(gv.accuracy_verdicts(lost, baseline, slices, 5.0, policy, 0.99)) == {"block"}


def test_window_verdicts_judge_both_layers_and_their_combination():
    policy = _quick()
    base = [3.0 + 0.01 * (index % 7) for index in range(48)]
    same = {"window_nll": base, "window_kl": [0.001] * 48}
    worse = {"window_nll": [value + 0.2 + 0.001 * (index % 3) for index, value in enumerate(base)],
             "window_kl": [0.2] * 48}  # fmt: skip
    slices = gv.spread_draws(48, 12, 10, seed=0)
    found = gv.window_verdicts(same, base, slices, policy, 0.99)
    assert set(found["perplexity+kl"]) == {"pass"}
    found = gv.window_verdicts(worse, base, slices, policy, 0.99)
    assert set(found["perplexity"]) == {"block"} and set(found["perplexity+kl"]) == {"block"}


def test_verdict_rates_pair_each_window_slice_with_an_accuracy_slice(tmp_path):
    base = [3.0 + 0.01 * (index % 5) for index in range(48)]
    scores = {"models": {"baseline": {"window_nll": base},
                         "rtn_int8": {"window_nll": base, "window_kl": [0.001] * 48}}}  # fmt: skip
    outcomes = [1.0, 0.0] * 150
    (tmp_path / "accuracy-task.json").write_text(json.dumps({"outcomes": {"acc": outcomes}}))
    lost = [0.0 if index % 4 == 0 else value for index, value in enumerate(outcomes)]
    (tmp_path / "accuracy-task-rtn_int8.json").write_text(
        json.dumps({"candidate": "rtn_int8", "outcomes": {"acc": lost}})
    )
    accuracy = gv.load_accuracy(tmp_path)
    assert accuracy["rtn_int8"]["change"] == pytest.approx(-25.0)
    found = gv.verdict_rates(scores, accuracy, _quick(), 0.99, 12)
    assert found["windows"]["spread"]["rtn_int8"]["perplexity+kl"]["pass"] == 1.0
    assert found["accuracy"]["rtn_int8"]["block"] == 1.0 and found["accuracy"]["rtn_int8"]["slices"] == gv.DRAWS
    assert found["combined"]["rtn_int8"]["pass"] == 1.0  # quick's accuracy layer is advisory: reported, not deciding
    deciding = _quick()
    deciding.lm_eval.blocking = True
    blocked = gv.verdict_rates(scores, accuracy, deciding, 0.99, 12)["combined"]["rtn_int8"]
    assert blocked["block"] == 1.0  # a blocking accuracy layer's BLOCK is the gate's
    assert found["accuracy_draw"] == {"items": 200, "of": 300, "how": "without replacement", "max_drop_points": 5.0}


def test_windows_needed_reads_lossless_passes_and_far_rungs_blocks_per_window_count():
    policy = resolve_policy(load_policy("default", []))
    base = [3.0 + 0.01 * (index % 5) for index in range(96)]
    lossless = {"window_nll": base, "window_kl": [0.001] * 96}
    far = {"window_nll": [value + 0.1 for value in base], "window_kl": [0.001] * 96}  # ×1.105: 5.5 points past
    texts = {
        "shakespeare/96": {"models": {"baseline": {"window_nll": base}, "rtn_int8": lossless}},
        "python_code/96": {"models": {"baseline": {"window_nll": base}, "ladder+5": far}},
    }
    longer = base + base[:24]  # the same rung on a longer cut of the text: a row of its own, not a clash
    far_longer = {"window_nll": [value + 0.1 for value in longer], "window_kl": [0.001] * 120}
    texts["python_code/120"] = {"models": {"baseline": {"window_nll": longer}, "ladder+5": far_longer}}
    found = gate_budget.windows_needed(texts, {}, policy, 0.99)
    assert found["gate_windows"] == policy.perplexity.max_windows
    sizes = [row["windows"] for row in found["rows"]]
    assert sizes == [size for size in gate_budget.WINDOW_COUNTS if size <= 48]  # more than half the text: not drawn
    for row in found["rows"]:
        assert row["pass"]["rtn_int8"]["pass"] == 1.0 and row["pass"]["rtn_int8, contiguous"]["pass"] == 1.0
        assert row["block"]["ladder+5 ×1.105 (python_code/96)"]["block"] == 1.0
        assert "ladder+5 ×1.105 (python_code/120)" in row["block"]
    lines = gate_budget.windows_markdown(found, 10.0)
    assert lines[3] == "| windows per text |" + "".join(f" {size} |" for size in sizes)
    assert lines[-1].endswith(f"| {(48 - policy.perplexity.max_windows) * 10:+.0f} s |")


def test_accuracy_needed_passes_more_often_with_more_items_or_a_looser_limit():
    policy = resolve_policy(load_policy("default", []))
    baseline = [1.0, 0.0] * 285  # 570 items
    near = list(baseline)
    for index in range(0, 80, 2):  # 40 right answers lost, 30 wrong ones gained: −1.8 points, 12% churn
        near[index] = 0.0
    for index in range(1, 61, 2):
        near[index] = 1.0
    accuracy = {"baseline": baseline, "near": {"outcomes": near, "ladder_fraction": None, "change": -1.75}}
    rows = {(row["max_drop_points"], row["items"]): row["candidates"]["near"] for row in
            gate_budget.accuracy_needed(accuracy, policy, 0.99)}  # fmt: skip
    assert set(rows) == set(gate_budget.ACCURACY_SETTINGS)
    assert rows[(3.0, 570)]["pass"] < rows[(3.0, 1710)]["pass"] and rows[(3.0, 570)]["pass"] < rows[(5.0, 570)]["pass"]
    assert all(row["slices"] == gv.DRAWS for row in rows.values())
    assert gate_budget.accuracy_markdown([], 0.99) == []


def test_a_ladder_rung_moves_each_decoder_weight_that_fraction_of_the_way_to_its_rtn_grid():
    import torch
    from helpers import build_tiny_llama

    from benchmarks.accuracy_task import round_to_nearest
    from compress.grids.int_grid import WeightScheme, fake_quantize

    original = build_tiny_llama()
    weight = original.model.layers[0].mlp.down_proj.weight.detach().clone()
    target = fake_quantize(weight, WeightScheme(bits=3, group_size=64, symmetric=True))
    for fraction in (0.0, 0.5, 1.0):
        model = build_tiny_llama()
        round_to_nearest(model, "rtn_int3_g64", fraction)
        moved = model.model.layers[0].mlp.down_proj.weight
        torch.testing.assert_close(moved, weight + fraction * (target - weight))
        torch.testing.assert_close(model.model.embed_tokens.weight, original.model.embed_tokens.weight)  # kept


def test_a_rung_names_its_fraction_and_bits_and_pairs_with_its_arc_namesake():
    from benchmarks.ladder import parse_rung

    assert parse_rung("rtn_int3_g64-f0.72=0.72:3") == ("rtn_int3_g64-f0.72", (0.72, 3))
    assert parse_rung("ladder+5=0.9") == ("ladder+5", (0.9, 4))
