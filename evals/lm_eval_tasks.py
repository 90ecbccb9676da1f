"""lm-eval integration: our in-memory models scored by lm-eval's own loop, on a shipped public benchmark, a local
continuation task, or any task the user has.

The accuracy benchmark: public multiple-choice items that ship with the package (``evals/data/<name>/``: the items as
jsonl, lm-eval's task YAML for them, and a README with their source, version and licence), so the gate measures
accuracy on questions nobody cut from the text it scores for perplexity, on a machine with no hub. The default is
ARC-Easy's 570 validation questions (``arc_easy``); ``gate=full`` adds PIQA's 1,838 (``piqa``), judged pooled.
:func:`write_benchmark_task` writes a benchmark's task for ``include_path``.

The continuation task (``compress_continuation``, off by default; a smoke test, not an accuracy benchmark: its items
are cut from the same text the perplexity layer scores): given a passage of the held-out evaluation text, pick its
true continuation among four endings, three of them sentences of similar length taken from other passages. It needs
no download (the items come from the texts the gate is given) and lm-eval scores it with its ``multiple_choice`` loop
(``acc`` and ``acc_norm``). Every task's per-item outcomes come back so the gate can pair candidate and baseline item
by item for an interval on the difference rather than compare two noisy means.

The model is wrapped by lm-eval's ``HFLM`` as an already-instantiated model and tokenizer, so nothing is fetched from
the hub. Users add tasks by name (``gate.lm_eval.tasks=[...]``) and their own YAML folders
(``gate.lm_eval.include_path=``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import yaml

from compress.base.errors import CompressError

BENCHMARK_DIR = Path(__file__).parent / "data"
CHOICE_TASK = "compress_continuation"
NUM_CHOICES = 4
CONTEXT_CHARS = (150, 500)  # a few sentences of the passage
ENDING_CHARS = (40, 240)  # the next sentence, or two when the next one is short
NEAREST_BY_LENGTH = 12  # distractors are drawn among the pool entries closest in length to the true ending

CHOICE_YAML = """\
# Written by compress: pick the true continuation of a held-out passage among {num_choices} endings.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: endings
doc_to_target: label
should_decontaminate: false
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""

SENTENCE = re.compile(r".+?[.!?][\"')\]]*(?=\s+[\"'(]?[A-Z]|\s*$)")
NOT_PROSE_LINE = re.compile(r"^\s*(>>>|\.\.\.|[+|]-|\||[*=\-~^+]{3,}\s*$)")
SYMBOLS = set("()[]{}<>=_:;|\\@#$%^&*~/`")


def _looks_like_text(text: str, min_letters: float, max_symbols: float) -> bool:
    """Mostly letters and few code symbols among the non-space characters."""
    visible = text.replace(" ", "")
    letters = sum(char.isalpha() for char in visible)
    symbols = sum(char in SYMBOLS for char in visible)
    return bool(visible) and letters >= min_letters * len(visible) and symbols <= max_symbols * len(visible)


def _is_prose(paragraph: str) -> bool:
    """Running text, possibly quoting a little code: no prompts, grammar, tables or headings."""
    if "::=" in paragraph or any(NOT_PROSE_LINE.match(line) for line in paragraph.splitlines()):
        return False
    return _looks_like_text(" ".join(paragraph.split()), 0.7, 0.08)


def _prose_runs(text: str) -> list[list[str]]:
    """The sentences of each run of consecutive prose paragraphs, whitespace collapsed: joined by single spaces,
    a run is a substring of ``" ".join(text.split())``. A paragraph that ends without a full stop (``For
    example:``) gives its full sentences and ends the run."""
    runs, current = [], []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        flat = " ".join(paragraph.split())
        sentences = [match.group().strip() for match in SENTENCE.finditer(flat)] if _is_prose(paragraph) else []
        current.extend(sentences)
        if not sentences or " ".join(sentences) != flat:
            if current:
                runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _ending_at(sentences: list[str], start: int) -> tuple[str, int] | None:
    """The ending that begins at ``sentences[start]`` (one sentence, two when the first is short) and the index after
    it, or None when it is not of ending length or does not read as a sentence."""
    ending, end = "", start
    while end < len(sentences) and len(ending) < ENDING_CHARS[0]:
        ending = f"{ending} {sentences[end]}".strip()
        end += 1
    if not ENDING_CHARS[0] <= len(ending) <= ENDING_CHARS[1] or not re.match(r"[\"'(]?[A-Z]", ending):
        return None
    if not _looks_like_text(ending, 0.75, 0.04):
        return None
    return ending, end


def _candidates(texts: list[str]) -> tuple[list[dict], dict[str, set[int]]]:
    """Every non-overlapping (context, true ending) pair the texts hold, and the pool of possible distractors (each
    ending-shaped span of the texts with the runs it occurs in)."""
    candidates, pool = [], defaultdict(set)
    run_id = 0
    for source, text in enumerate(texts):
        for sentences in _prose_runs(text):
            run_id += 1
            for index in range(len(sentences)):
                if found := _ending_at(sentences, index):
                    pool[found[0]].add(run_id)
            start = 0
            while start < len(sentences):
                end, length = start, -1
                while end < len(sentences) and length < CONTEXT_CHARS[0]:
                    length += len(sentences[end]) + 1
                    end += 1
                found = _ending_at(sentences, end) if CONTEXT_CHARS[0] <= length <= CONTEXT_CHARS[1] else None
                if found is None:
                    start += 1
                    continue
                context = " ".join(sentences[start:end])
                candidates.append({"context": context, "ending": found[0], "source": source, "run": run_id})
                start = found[1]
    return candidates, pool


def _nearest_others(item: dict, pool: dict[str, set[int]]) -> list[str]:
    """The pool entries from other passages (never the true ending) nearest the true ending in length."""
    others = [text for text, runs in pool.items() if text != item["ending"] and item["run"] not in runs]
    return sorted(others, key=lambda text: (abs(len(text) - len(item["ending"])), text))[:NEAREST_BY_LENGTH]


def choice_items(texts: Iterable[str], num_items: int | None, seed: int) -> list[dict]:
    """``num_items`` items (None: every one the texts hold) ``{"context", "endings", "label", "source"}`` from
    ``texts``, the same for the same arguments: ``endings[label]`` is what follows ``context`` in ``texts[source]``
    (whitespace collapsed)."""
    candidates, pool = _candidates(list(texts))
    possible = [(item, others) for item in candidates if len(others := _nearest_others(item, pool)) >= NUM_CHOICES - 1]
    num_items = len(possible) if num_items is None else num_items
    if num_items < 1 or len(possible) < num_items:
        raise CompressError(
            f"the evaluation texts hold {len(possible)} continuation items and {num_items} were asked for: "
            f"ask for at most {len(possible)} (gate.lm_eval.limit) or give more prose text (gate.data)"
        )
    rng = random.Random(seed)
    items = []
    for index in sorted(rng.sample(range(len(possible)), num_items)):
        item, others = possible[index]
        endings = rng.sample(others, NUM_CHOICES - 1)
        label = rng.randrange(NUM_CHOICES)
        endings.insert(label, item["ending"])
        items.append({"context": item["context"], "endings": endings, "label": label, "source": item["source"]})
    return items


def write_choice_task(texts: list[str], folder: Path, num_items: int | None, seed: int) -> Path:
    """The task folder (for lm-eval's ``include_path``) holding :func:`choice_items` as jsonl and the task YAML."""
    lines = "".join(json.dumps(item) + "\n" for item in choice_items(texts, num_items, seed))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{CHOICE_TASK}-*.jsonl"):
        stale.unlink()
    # The content hash in the name keeps the datasets cache from serving an earlier item set written to this folder.
    data_file = folder / f"{CHOICE_TASK}-{hashlib.sha256(lines.encode()).hexdigest()[:12]}.jsonl"
    data_file.write_text(lines, encoding="utf-8")
    yaml = CHOICE_YAML.format(task=CHOICE_TASK, num_choices=NUM_CHOICES, data_file=json.dumps(str(data_file)))
    (folder / f"{CHOICE_TASK}.yaml").write_text(yaml, encoding="utf-8")
    return folder


def shipped_benchmarks() -> list[str]:
    """The names of the benchmarks whose items ship with the package (folders of ``evals/data`` with a task)."""
    return sorted(path.parent.name for path in BENCHMARK_DIR.glob("*/task.yaml"))


def benchmark_task_name(name: str) -> str:
    """The lm-eval task name of shipped benchmark ``name`` (``compress_<name>``: lm-eval's own ``arc_easy`` reads
    the hub)."""
    return f"compress_{name}"


def benchmark_items(name: str) -> list[str]:
    """The shipped items of benchmark ``name``, one jsonl line each, in their shipped (shuffled once) order."""
    source = BENCHMARK_DIR / name
    config = yaml.safe_load((source / "task.yaml").read_text(encoding="utf-8"))
    return (source / config["dataset_kwargs"]["data_files"]["test"]).read_text(encoding="utf-8").splitlines()


def write_benchmark_task(name: str, folder: Path, start: int = 0, stop: int | None = None) -> Path:
    """The task folder (for lm-eval's ``include_path``) of shipped benchmark ``name``: its task YAML pointing at the
    shipped items by absolute path, or at a copy of items ``start`` to ``stop`` (the gate scores a pilot first, then
    the rest)."""
    if name not in shipped_benchmarks():
        raise CompressError(
            f"no shipped accuracy benchmark {name!r}; the package ships {shipped_benchmarks()} "
            "(or name any lm-eval task the machine has data for in gate.lm_eval.tasks)"
        )
    source = BENCHMARK_DIR / name
    config = yaml.safe_load((source / "task.yaml").read_text(encoding="utf-8"))
    config["dataset_kwargs"]["data_files"] = {"test": str(source / config["dataset_kwargs"]["data_files"]["test"])}
    folder.mkdir(parents=True, exist_ok=True)
    if start or stop is not None:
        lines = "".join(line + "\n" for line in benchmark_items(name)[start:stop])
        # The content hash in the name keeps the datasets cache from serving another slice written here.
        data_file = folder / f"{name}-{hashlib.sha256(lines.encode()).hexdigest()[:12]}.jsonl"
        data_file.write_text(lines, encoding="utf-8")
        config["dataset_kwargs"]["data_files"] = {"test": str(data_file)}
    (folder / f"{config['task']}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return folder


def _chance_level(output_type: str | None, samples: list[dict]) -> float | None:
    """The accuracy of guessing uniformly on a multiple-choice task (the mean of 1/choices over its items; 0.25 for
    :data:`CHOICE_TASK`), or None for other tasks."""
    if output_type != "multiple_choice" or not samples:
        return None
    # One loglikelihood request per choice; acc_mutual_info adds one unconditional request per choice.
    counts = [len(sample["arguments"]) // (2 if "acc_mutual_info" in sample["metrics"] else 1) for sample in samples]
    return sum(1 / count for count in counts) / len(counts)


def _task_result(values: dict, higher_is_better: dict, samples: list[dict], output_type: str | None) -> dict:
    """One task's metrics, their direction and the per-item outcomes whose mean is the metric, in doc order."""
    reported = {
        tuple(key.split(",", 1)): float(value)
        for key, value in values.items()
        if "," in key and "_stderr" not in key and isinstance(value, int | float)
    }
    # lm-eval keys are "metric,filter": the metric alone names it unless several filters report that metric.
    filters_of = Counter(metric for metric, _ in reported)
    names = {key: key[0] if filters_of[key[0]] == 1 else ",".join(key) for key in reported}
    by_filter = defaultdict(list)
    for sample in samples:
        by_filter[sample["filter"]].append(sample)
    outcomes = {}
    for (metric, filter_name), value in reported.items():
        logged = sorted(by_filter.get(filter_name, []), key=lambda sample: sample["doc_id"])
        per_item = [sample.get(metric) for sample in logged]
        if not per_item or not all(isinstance(item, int | float) for item in per_item):
            continue  # e.g. perplexities log (loglikelihood, length) pairs: not an item-level score
        per_item = [float(item) for item in per_item]
        if abs(sum(per_item) / len(per_item) - value) <= 1e-9 * max(1.0, abs(value)):
            outcomes[names[metric, filter_name]] = per_item
    return {
        "metrics": {names[key]: value for key, value in reported.items()},
        "higher_is_better": {names[key]: higher_is_better.get(key[0]) for key in reported},
        "outcomes": outcomes,
        "chance": _chance_level(output_type, samples),
    }


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str],
    include_paths: list[Path],
    limit: int | None,
    batch_size: int,
    max_length: int,
) -> dict:
    """``{task: {"metrics": {name: value}, "higher_is_better": {name: bool}, "outcomes": {name: [per item]},
    "chance": float | None}}`` for one model; outcomes are in doc order, so two models' lists pair item by item."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    device = str(next(model.parameters()).device)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size, max_length=max_length)
    # Indexing lm-eval's thousands of built-in task files takes seconds; do it only when a built-in task is asked for.
    local = {CHOICE_TASK, *map(benchmark_task_name, shipped_benchmarks())}
    builtin = any(task not in local for task in tasks)
    manager = TaskManager(include_path=[str(path) for path in include_paths] or None, include_defaults=builtin)
    output = lm_eval.simple_evaluate(
        model=wrapped,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
    )
    samples, configs = output.get("samples", {}), output.get("configs", {})
    return {
        task: _task_result(
            values,
            output["higher_is_better"].get(task, {}),
            samples.get(task, []),
            configs.get(task, {}).get("output_type"),
        )
        for task, values in output["results"].items()
    }
