"""The long-context layer: prompts of the promised length whose answers really are in them (read back from the
prompt text alone, as a perfect reader would), exact-match scoring, and end-to-end runs with an oracle, a wrong
generator and a tiny random model."""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter

import pytest
import torch
from helpers import tiny_model_for

from compress.evals import long_context
from compress.evals.generation import TransformersGenerator
from compress.evals.long_context import TASKS, WORDS, build_item, evaluate_long_context, minimum_length, score
from compress.evals.needle import haystack

ASSIGNMENT = re.compile(r"\nVAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))\.\n")
OPENINGS = {
    "variable_tracking": "holds the number",
    "multi_key": "The special magic number for {key} is",
    "frequent_words": "The three most frequent words are",
}


@pytest.fixture(scope="module")
def filler(tokenizer) -> list[int]:
    """Held-out text: pydoc topics past the first 100,000 characters, which pydoc_tokenizer trained on."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))[100_000:140_000]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def lengths(tokenizer) -> list[int]:
    """The shortest length every task accepts, and a longer one."""
    shortest = max(minimum_length(task, tokenizer) for task in TASKS)
    return [shortest, shortest + 300]


def text_of(tokenizer, item) -> str:
    return tokenizer.decode(item.prompt_ids, skip_special_tokens=True)


def follow_chain(text: str) -> tuple[str, int, dict[str, str]]:
    """(the asked variable's number, the hops followed to reach it, every variable's number) from the prompt alone."""
    asked = re.search(r"which number does VAR ([A-Z]+) hold\?", text).group(1)
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name, source, number in ASSIGNMENT.findall(text):
        assert name not in values, f"VAR {name} is assigned twice"
        assert not source or source in values, f"VAR {name} reads VAR {source} before it is set"
        values[name] = number or values[source]
        if source:
            sources[name] = source
    hops, name = 0, asked
    while name in sources:
        hops, name = hops + 1, sources[name]
    return values[asked], hops, values


def solve(text: str) -> str:
    """The correct answer, read from the prompt text alone."""
    if text.endswith(OPENINGS["variable_tracking"]):
        return follow_chain(text)[0]
    if text.endswith(OPENINGS["frequent_words"]):
        counts = Counter(word for words in re.findall(r"\nWord list:([a-z ]+)\.\n", text) for word in words.split())
        return ", ".join(word for word, _ in counts.most_common(3))
    key = re.search(r"special magic number for ([a-z]+-[a-z]+)\?", text).group(1)
    (value,) = re.findall(rf"\nThe special magic number for {key} is (\d+)\.\n", text)
    return value


class Oracle:
    """Answers every prompt correctly by reading it, within the item's token budget."""

    backend, kv_cache_dtype = "oracle", "auto"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        answer = solve(self.tokenizer.decode(prompt_ids, skip_special_tokens=True))
        return self.tokenizer(f" {answer}.", add_special_tokens=False)["input_ids"][:max_new_tokens]

    def generate_batch(self, prompts, max_new_tokens):
        return [self.generate(prompt, tokens) for prompt, tokens in zip(prompts, max_new_tokens, strict=True)]


class FixedReply(Oracle):
    """Always the same reply."""

    def __init__(self, tokenizer, reply: str):
        super().__init__(tokenizer)
        self.reply = reply

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        return self.tokenizer(self.reply, add_special_tokens=False)["input_ids"][:max_new_tokens]


@pytest.mark.parametrize("task", TASKS)
def test_prompts_have_exact_length_end_with_the_answer_opening_and_repeat_per_seed(task, tokenizer, filler):
    shortest = minimum_length(task, tokenizer)
    for length in (shortest, shortest + 37, 1200):
        item = build_item(task, tokenizer, filler, length, seed=5)
        assert (item.task, item.length, len(item.prompt_ids)) == (task, length, length)
        assert item.max_new_tokens <= 16
        assert item.prompt_ids[0] == tokenizer.bos_token_id
        assert item.prompt_ids == build_item(task, tokenizer, filler, length, seed=5).prompt_ids
        assert item.prompt_ids != build_item(task, tokenizer, filler, length, seed=6).prompt_ids
        text = text_of(tokenizer, item)
        key = re.search(r"for ([a-z]+-[a-z]+)\?", text)
        assert text.endswith(OPENINGS[task].format(key=key.group(1) if key else ""))


@pytest.mark.parametrize("hops", [1, 2, 4])
def test_variable_chain_leads_from_the_question_to_the_answer(hops, tokenizer, filler):
    for seed in range(8):
        length = minimum_length("variable_tracking", tokenizer, hops=hops) + 50 * seed
        item = build_item("variable_tracking", tokenizer, filler, length, seed=seed, hops=hops)
        text = text_of(tokenizer, item)
        value, followed, values = follow_chain(text)
        assert value == item.answer and followed == hops
        assert len(ASSIGNMENT.findall(text)) == 2 * (hops + 1)
        # The distractor chain holds a different number, and both numbers are set exactly once in the text.
        (distractor,) = item.distractors
        assert distractor != item.answer and sorted(set(values.values())) == sorted([item.answer, distractor])
        assert text.count(f" = {item.answer}.") == text.count(f" = {distractor}.") == 1


def test_multi_key_hides_one_asked_needle_among_distractors(tokenizer, filler):
    for seed in range(8):
        item = build_item("multi_key", tokenizer, filler, 700, seed=seed)
        text = text_of(tokenizer, item)
        needles = dict(re.findall(r"\nThe special magic number for ([a-z]+-[a-z]+) is (\d+)\.\n", text))
        assert len(needles) == long_context.MULTI_KEY_NEEDLES
        assert solve(text) == item.answer and len(item.answer) == long_context.KEY_DIGITS
        assert sorted(item.distractors) == sorted(value for value in needles.values() if value != item.answer)
        assert len(set(needles.values())) == len(needles)


def test_frequent_words_are_far_more_frequent_and_spread_through_the_context(tokenizer, filler):
    word_counts = []
    for seed, length in enumerate([minimum_length("frequent_words", tokenizer), 900, 3000]):
        item = build_item("frequent_words", tokenizer, filler, length, seed=seed)
        text = text_of(tokenizer, item)
        lists = list(re.finditer(r"\nWord list:([a-z ]+)\.\n", text))
        counts = Counter(word for match in lists for word in match.group(1).split())
        ranked = counts.most_common()
        assert sorted(word for word, _ in ranked[:3]) == item.answer
        assert ranked[2][1] >= long_context.FREQUENCY_FACTOR * ranked[3][1]
        assert set(counts) <= set(WORDS) and set(counts) - set(item.answer) == set(item.distractors)
        assert len(lists) >= 2 and lists[0].start() < len(text) / 2 < lists[-1].start()
        word_counts.append(sum(counts.values()))
    assert word_counts[0] < word_counts[1] < word_counts[2]  # the lists grow with the context


def test_score_accepts_the_answer_and_rejects_wrong_ones(tokenizer, filler):
    item = build_item("variable_tracking", tokenizer, filler, 600, seed=1)
    assert score(item, f" {item.answer}. Remember") and score(item, f"{item.answer}")
    for wrong in ("", " none", f" {item.distractors[0]}.", f" {item.answer[:-1]}", f" {item.answer}0", " 1 or 2"):
        assert not score(item, wrong), wrong
    item = build_item("multi_key", tokenizer, filler, 700, seed=1)
    assert score(item, f" {item.answer}.")
    assert not any(score(item, f" {distractor}.") for distractor in item.distractors)
    item = build_item("frequent_words", tokenizer, filler, 600, seed=1)
    first, second, third = item.answer
    assert score(item, f" {third}, {first} and {second}.") and score(item, f" {first.upper()} {second} {third}")
    assert not score(item, f" {first}, {second}.")
    assert not score(item, f" {first}, {second}, {item.distractors[0]}.")
    assert not score(item, f" {item.distractors[0]}, {first}, {second}, {third}")  # only the first three count
    assert not score(item, f" {first}, {first}, {second}")


def test_oracle_scores_everything_and_a_wrong_reply_nothing_in_one_fixed_order(tokenizer, filler, lengths):
    arguments = dict(tokenizer=tokenizer, filler_ids=filler, lengths=lengths, tasks=list(TASKS), trials=2, seed=11)
    right = evaluate_long_context(Oracle(tokenizer), **arguments)
    wrong = evaluate_long_context(FixedReply(tokenizer, " 12345, river, lamp, tree."), **arguments)
    json.dumps(right)
    order = [(length, task, trial) for length in lengths for task in TASKS for trial in range(2)]
    for result, expected in ((right, 1), (wrong, 0)):
        assert [(item["length"], item["task"], item["trial"]) for item in result["items"]] == order
        assert result["outcomes"] == [item["correct"] for item in result["items"]] == [expected] * len(order)
        assert result["long_context_accuracy"] == expected and result["per_task_chance"]["multi_key"] == 1 / 4
        assert result["per_task"] == dict.fromkeys(TASKS, expected)
        assert result["per_length"] == {str(length): expected for length in lengths}
        assert (result["lengths"], result["tasks"], result["trials"]) == (lengths, list(TASKS), 2)
    assert evaluate_long_context(Oracle(tokenizer), **arguments) == right


def test_tiny_random_model_runs_end_to_end(tokenizer, filler, lengths):
    model = tiny_model_for(tokenizer)
    generator = TransformersGenerator(model, tokenizer)
    seen = []
    generate = generator.generate
    generator.generate = lambda prompt, budget, constraint=None: (
        seen.append((len(prompt), budget)) or generate(prompt, budget, constraint)
    )
    result = evaluate_long_context(generator, tokenizer, filler, lengths[:1], list(TASKS), trials=1, seed=0)
    json.dumps(result)
    assert seen == [(lengths[0], long_context.MAX_NEW_TOKENS[task]) for task in TASKS]
    assert len(result["outcomes"]) == len(result["items"]) == len(TASKS)
    assert result["outcomes"] == [item["correct"] for item in result["items"]]
    assert set(result["outcomes"]) <= {0, 1} and [item["task"] for item in result["items"]] == list(TASKS)
    assert result["long_context_accuracy"] == sum(result["outcomes"]) / len(TASKS)


class Unused(Oracle):
    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        raise AssertionError("bad arguments must be refused before any generation")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(tasks=["variable_tracking", "needle"]), "unknown long-context task 'needle'"),
        (dict(lengths="short"), "too short for"),
        (dict(filler_ids="short"), "the evaluation text has"),
        (dict(trials=0), "trials=0"),
        (dict(lengths="repeat"), "lengths repeat"),
        (dict(tasks=[]), "at least one length and one task"),
    ],
)
def test_bad_arguments_raise_one_clear_line_before_generating(change, message, tokenizer, filler, lengths):
    arguments = dict(tokenizer=tokenizer, filler_ids=filler, lengths=lengths, tasks=list(TASKS), trials=1, seed=0)
    if change.get("lengths") == "short":
        change["lengths"] = [lengths[1], minimum_length("multi_key", tokenizer) - 1]
    if change.get("lengths") == "repeat":
        change["lengths"] = [lengths[0], lengths[0]]
    if change.get("filler_ids") == "short":
        change["filler_ids"] = filler[: lengths[1] - 1]
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        evaluate_long_context(Unused(tokenizer), **{**arguments, **change})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("task", TASKS)
def test_a_length_that_fits_the_needle_but_not_the_task_is_an_error(task, tokenizer, filler):
    shortest = minimum_length(task, tokenizer)
    assert len(haystack(tokenizer, filler, shortest - 1, 0.5, 48213, seed=0)) == shortest - 1
    with pytest.raises(
        ValueError, match=f"context length {shortest - 1} is too short for {task}: .* at least {shortest}"
    ):
        build_item(task, tokenizer, filler, shortest - 1, seed=0)
    with pytest.raises(ValueError, match="unknown long-context task 'count'"):
        build_item("count", tokenizer, filler, 4000, seed=0)


class Copier(Oracle):
    """Answers with one of the answers the prompt offers, picked uniformly: a hidden number for the number tasks,
    three of the listed words for frequent_words. It follows no chain and matches no key: its accuracy is the
    chance level of the task's scoring rule."""

    def __init__(self, tokenizer, seed: int):
        super().__init__(tokenizer)
        self.rng = random.Random(seed)

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        numbers = re.findall(r"\nVAR [A-Z]+ = (\d+)\.\n", text) + re.findall(r" is (\d+)\.\n", text)
        if numbers:
            reply = self.rng.choice(numbers)
        else:
            lists = re.findall(r"\nWord list:([a-z ]+)\.\n", text)
            listed = sorted({word for words in lists for word in words.split()})
            reply = ", ".join(self.rng.sample(listed, 3))
        return self.tokenizer(f" {reply}.", add_special_tokens=False)["input_ids"][:max_new_tokens]


def test_each_task_has_the_chance_level_of_its_own_scoring_rule(tokenizer, filler):
    """Copying a hidden number scores 1/2 on variable_tracking and 1/4 on multi_key, not 0."""
    for seed in range(3):
        tracking = build_item("variable_tracking", tokenizer, filler, 600, seed=seed)
        keys = build_item("multi_key", tokenizer, filler, 700, seed=seed)
        words = build_item("frequent_words", tokenizer, filler, 600, seed=seed)
        assert long_context.chance(tracking) == 1 / 2
        assert long_context.chance(keys) == 1 / long_context.MULTI_KEY_NEEDLES
        assert long_context.chance(words) == 1 / math.comb(3 + len(words.distractors), 3) < 1e-3


def test_a_model_that_copies_a_hidden_answer_scores_each_tasks_chance(tokenizer, filler, lengths):
    trials = 60
    result = evaluate_long_context(
        Copier(tokenizer, seed=0), tokenizer, filler, lengths[:1], list(TASKS), trials=trials, seed=3
    )
    assert set(result["per_task_chance"]) == set(TASKS)
    assert result["per_task_chance"]["variable_tracking"] == 1 / 2
    assert result["per_task_chance"]["multi_key"] == 1 / long_context.MULTI_KEY_NEEDLES
    for task in TASKS:
        chance, share = result["per_task_chance"][task], result["per_task"][task]
        # 60 draws at the chance rate: within four standard deviations of it (seeded, so always the same draw)
        assert abs(share - chance) <= 4 * math.sqrt(chance * (1 - chance) / trials) + 1e-9, (task, share, chance)
    assert result["chance"] == pytest.approx(sum(result["per_task_chance"].values()) / len(TASKS))


class SolvesOnly(Copier):
    """Solves the tasks named, copies a hidden answer on the others."""

    def __init__(self, tokenizer, tasks: set[str]):
        super().__init__(tokenizer, seed=1)
        self.tasks = tasks

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        task = next((task for task in TASKS if text.endswith(OPENINGS[task])), "multi_key")
        if task in self.tasks:
            return Oracle.generate(self, prompt_ids, max_new_tokens)
        return super().generate(prompt_ids, max_new_tokens)


def _judge(candidate: dict, baseline: dict, tmp_path):
    from compress.evals.gate.context import GateContext
    from compress.evals.gate.layers import judge_long_context
    from compress.evals.gate.policy import resolve_policy

    context = GateContext(resolve_policy(None), [], torch.zeros(0, dtype=torch.long), 4096, tmp_path)
    return judge_long_context(context, {"candidate": candidate, "baseline": baseline})


def test_the_gate_judges_each_task_at_its_own_chance_and_skips_the_ones_at_chance(tokenizer, filler, lengths, tmp_path):
    """A baseline that solves multi_key but only copies numbers on variable_tracking (about 50%: its chance) and
    never finds the frequent words: only multi_key is judged, the others are named as not judged."""
    from compress.evals.gate.layers import CannotJudge

    arguments = dict(tokenizer=tokenizer, filler_ids=filler, lengths=lengths[:1], tasks=list(TASKS), trials=6, seed=2)
    baseline = evaluate_long_context(SolvesOnly(tokenizer, {"multi_key"}), **arguments)
    assert baseline["per_task"]["multi_key"] == 1 and baseline["per_task"]["frequent_words"] == 0
    assert 0.2 <= baseline["per_task"]["variable_tracking"] <= 0.8  # pooled, 8 of 18 right would look far above 0
    candidate = evaluate_long_context(Oracle(tokenizer), **arguments)
    metrics, checks = _judge(candidate, baseline, tmp_path)
    assert [check.metric for check in checks] == ["long_context/multi_key"]
    assert checks[0].items == 6 and checks[0].verdict in ("pass", "inconclusive")
    notes = " ".join(metrics["notes"])
    for task in ("variable_tracking", "frequent_words"):
        assert f"long_context/{task}: cannot judge at this model size" in notes
    assert "chance (50%)" in notes
    wrong = evaluate_long_context(FixedReply(tokenizer, " 12345, river, lamp, tree."), **arguments)
    with pytest.raises(CannotJudge, match="long_context/multi_key: cannot judge"):
        _judge(candidate, wrong, tmp_path)
