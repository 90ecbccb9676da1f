"""How many shipped benchmark items the lm_eval layer scores, and the baseline's outcomes kept between gates.

The shipped benchmarks (``gate.lm_eval.benchmark``) are read as one pool in an interleaved order, so that any first
``n`` items of it hold each benchmark in proportion to its size. The baseline is scored on the whole pool it may
need (``gate.lm_eval.max_items``, else every item) and its per-item outcomes are cached on disk, keyed by its model
files, the benchmark, the items and lm-eval's settings: the next gate of the same baseline scores only the candidate.
With one model in memory the baseline is measured before the candidate loads, so it cannot wait for the pilot.

With ``gate.lm_eval.pilot_items`` the candidate is scored on that many first; the share of pilot items the two sides
answer differently (the discordance, which sets the spread of a paired difference) plans the count the BLOCK test
needs to catch a drop of ``max_drop_points`` with probability ``power`` (:func:`stats.planned_items`), at the gate's
familywise BLOCK level; the candidate is then scored on the rest of that count, at most the pool.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from compress.base.locks import file_lock, lock_beside
from compress.base.staging import write_file_atomically
from compress.evals.divergence import model_fingerprint
from compress.evals.gate import stats
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.policy import blocking_checks

log = logging.getLogger(__name__)

FORMAT = "compress-lm-eval-outcomes-v1"


def pooled_order(sizes: list[int]) -> list[int]:
    """The benchmark (an index into ``sizes``) each position of the pool draws its next item from: benchmark ``b``'s
    ``i``-th item sits at its share (i + ½)/size, so every first ``n`` positions are a proportional mix."""
    placed = sorted(((index + 0.5) / size, bench) for bench, size in enumerate(sizes) for index in range(size))
    return [bench for _, bench in placed]


def counts_at(order: list[int], benchmarks: int, items: int) -> list[int]:
    """How many of each benchmark's items the first ``items`` positions of the pool hold."""
    counts = [0] * benchmarks
    for bench in order[:items]:
        counts[bench] += 1
    return counts


def block_confidence(context: GateContext) -> float:
    """The two-sided level the lm_eval layer's BLOCK is read at: the gate's familywise level when the layer blocks
    (Bonferroni over the blocking checks), else the gate's confidence."""
    policy = context.policy
    if not (policy.lm_eval.blocking and policy.familywise):
        return policy.confidence
    return stats.familywise_confidence(policy.confidence, blocking_checks(policy, context.selected or policy.layers))


def benchmark_sizes(policy) -> list[int]:
    """Items each shipped benchmark of ``policy`` (an ``LmEvalPolicy``) offers: all of them, or its ``limit``."""
    from compress.evals.lm_eval_tasks import benchmark_items

    return [len(benchmark_items(name)) if policy.limit is None else min(policy.limit, len(benchmark_items(name)))
            for name in policy.benchmarks]  # fmt: skip


def measure_benchmarks(context: GateContext, subject: Subject, baseline: dict | None) -> tuple[dict, dict]:
    """``(results, plan)``: one side's lm-eval results on the shipped benchmarks (``{task: result}`` as
    :func:`run_lm_eval` gives them) and the item plan; ``baseline``: the baseline's results, for the candidate's
    pilot (None: the candidate is scored on the whole pool)."""
    from compress.evals.lm_eval_tasks import benchmark_task_name

    policy = context.policy.lm_eval
    names = policy.benchmarks
    tasks = [benchmark_task_name(name) for name in names]
    sizes = benchmark_sizes(policy)
    available = sum(sizes)
    pool = available if policy.max_items is None else min(policy.max_items, available)
    order = pooled_order(sizes)
    plan = {"available": available, "pool": pool, "pilot": None, "discordance": None, "planned": None}
    if subject.label == "baseline" or baseline is None or policy.pilot_items is None:
        counts = counts_at(order, len(names), pool)
        if subject.label == "baseline":
            results = {task: _cached_or_scored(context, subject, name, task, count)
                       for name, task, count in zip(names, tasks, counts, strict=True)}  # fmt: skip
        else:
            results = _score(context, subject, names, [0] * len(names), counts)
        return results, {**plan, "scored": pool}
    pilot = min(policy.pilot_items, pool)
    first = counts_at(order, len(names), pilot)
    results = _score(context, subject, names, [0] * len(names), first)
    discordance = max(_discordance(results, baseline, tasks), default=0.0)
    margin = policy.max_drop_points / 100
    planned = stats.planned_items(discordance, margin, policy.power, block_confidence(context))
    items = min(max(planned, pilot), pool)
    log.info("lm_eval: pilot of %d items, discordance %.3f, planned %d of %d", pilot, discordance, planned, pool)
    if items > pilot:
        rest = _score(context, subject, names, first, counts_at(order, len(names), items))
        results = {task: merged(results[task], rest[task]) for task in tasks}
    return results, {**plan, "pilot": pilot, "discordance": discordance, "planned": planned, "scored": items}


def _discordance(candidate: dict, baseline: dict, tasks: list[str]) -> list[float]:
    """Per metric both sides report on every task: the share of the candidate's items the two answer differently."""
    names = set.intersection(*(set(candidate[task]["outcomes"]) for task in tasks))
    shares = []
    for name in names:
        flips = items = 0
        for task in tasks:
            ours = candidate[task]["outcomes"][name]
            flips += sum(1 for c, b in zip(ours, baseline[task]["outcomes"][name], strict=False) if c != b)
            items += len(ours)
        shares.append(flips / items)
    return shares


def _score(context: GateContext, subject: Subject, names: list[str], starts: list[int], stops: list[int]) -> dict:
    """One lm-eval run of each benchmark's items ``starts[b]`` to ``stops[b]`` (every benchmark reported, an empty
    range as no items)."""
    from compress.evals.lm_eval_tasks import benchmark_task_name, run_lm_eval, write_benchmark_task

    policy = context.policy.lm_eval
    wanted = [(name, start, stop) for name, start, stop in zip(names, starts, stops, strict=True) if stop > start]
    folders = [
        write_benchmark_task(name, context.out_dir / "lm_eval_benchmark" / f"{name}-{start}-{stop}", start, stop)
        for name, start, stop in wanted
    ]
    scored = {}
    if wanted:
        tasks = [benchmark_task_name(name) for name, _, _ in wanted]
        scored = run_lm_eval(
            subject.model, subject.tokenizer, tasks, folders, None, policy.batch_size, policy.max_length
        )
    return {benchmark_task_name(name): scored.get(benchmark_task_name(name), _empty()) for name in names}


def _empty() -> dict:
    return {"metrics": {}, "higher_is_better": {}, "outcomes": {}, "chance": None}


def merged(first: dict, more: dict) -> dict:
    """Two consecutive runs of one task's items as one: outcomes concatenated, each metric their mean."""
    if not first["outcomes"]:
        return more
    if not more["outcomes"]:
        return first
    outcomes = {name: first["outcomes"][name] + more["outcomes"][name] for name in first["outcomes"]}
    counts = len(next(iter(first["outcomes"].values()))), len(next(iter(more["outcomes"].values())))
    chance = None
    if first["chance"] is not None and more["chance"] is not None:
        chance = (first["chance"] * counts[0] + more["chance"] * counts[1]) / sum(counts)
    metrics = {**first["metrics"], **{name: sum(values) / len(values) for name, values in outcomes.items()}}
    return {**first, "metrics": metrics, "outcomes": outcomes, "chance": chance}


def prefix(result: dict, items: int) -> dict:
    """A task's result on its first ``items`` items (the baseline's pool cut to the items the candidate scored)."""
    outcomes = {name: values[:items] for name, values in result["outcomes"].items()}
    metrics = {**result["metrics"], **{name: sum(values) / len(values) for name, values in outcomes.items() if values}}
    return {**result, "metrics": metrics, "outcomes": outcomes}


def cache_path(context: GateContext, subject: Subject, name: str, items: int) -> Path | None:
    """Where the baseline's outcomes on benchmark ``name``'s first ``items`` items are cached; None when the
    baseline has no folder to fingerprint. The key holds the model's files (:func:`model_fingerprint`, as the KL
    reference cache), the items' text and lm-eval's settings."""
    import lm_eval

    from compress.evals.gate.windows import cache_dir
    from compress.evals.lm_eval_tasks import benchmark_items

    fingerprint = model_fingerprint(subject.folder) if subject.folder is not None else None
    if fingerprint is None:
        return None
    policy = context.policy.lm_eval
    item_digest = hashlib.sha256("\n".join(benchmark_items(name)[:items]).encode()).hexdigest()
    key = [FORMAT, fingerprint, name, item_digest, policy.batch_size, policy.max_length, lm_eval.__version__]
    key = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    return cache_dir(context.policy) / "lm-eval" / f"{key}.json"


def _cached_or_scored(context: GateContext, subject: Subject, name: str, task: str, items: int) -> dict:
    path = cache_path(context, subject, name, items)
    if path is None:
        return _score(context, subject, [name], [0], [items])[task]
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two gates of one baseline at once: the second waits here, then reads what the first cached.
    with file_lock(lock_beside(path), f"the baseline's lm-eval outcomes {path}"):
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except ValueError:  # a foreign file is a miss, scored again and replaced
                pass
        result = _score(context, subject, [name], [0], [items])[task]
        write_file_atomically(path, lambda staged: staged.write_text(json.dumps(result), encoding="utf-8"))
    return result


def cached_baseline(context: GateContext, subject: Subject) -> dict | None:
    """The baseline's results on every shipped benchmark of the pool, when all are cached and the layer runs no
    other task (then the baseline need not load for this layer); else None."""
    from compress.evals.lm_eval_tasks import benchmark_task_name

    policy = context.policy.lm_eval
    if not policy.benchmarks or policy.tasks or policy.local_task:
        return None
    names = policy.benchmarks
    sizes = benchmark_sizes(policy)
    pool = sum(sizes) if policy.max_items is None else min(policy.max_items, sum(sizes))
    results = {}
    for name, count in zip(names, counts_at(pooled_order(sizes), len(names), pool), strict=True):
        path = cache_path(context, subject, name, count)
        if path is None or not path.is_file():
            return None
        results[benchmark_task_name(name)] = json.loads(path.read_text(encoding="utf-8"))
    return results


def plan_text(plan: dict | None, check, names: list[str]) -> str:
    """What a check over the shipped benchmarks adds to its line: the items planned and scored against those
    available, and when it is INCONCLUSIVE how many more would decide it."""
    from compress.evals.lm_eval_tasks import benchmark_task_name

    over = check.metric.split("/", 1)[0]
    if plan is None or over not in {"+".join(names), *map(benchmark_task_name, names)}:
        return ""
    text = f"; {plan['scored']} of {plan['available']} items scored"
    if plan["pilot"] is not None:
        text += (
            f" (planned {plan['planned']} from a {plan['pilot']}-item pilot with {plan['discordance']:.1%} of items "
            f"discordant; cap {plan['pool']})"
        )
    if check.verdict == stats.INCONCLUSIVE and check.items_to_decide is not None:
        more = check.items_to_decide - check.items
        held = "" if check.items_to_decide <= plan["available"] else ", more than the benchmarks hold"
        text += f"; about {more} more would decide it{held}"
    return text
