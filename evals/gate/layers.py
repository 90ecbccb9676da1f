"""The gate's layers: each measures the loaded models it is given, then judges both sides' per-item scores.

A layer whose baseline cannot be told apart from chance (its accuracy interval reaches down to the chance level)
is not judged: "cannot judge at this model size" is reported instead of a pass that means nothing.
"""

from __future__ import annotations

from pathlib import Path

from compress.base.errors import CompressError
from compress.evals import generation, latency, long_context, needle
from compress.evals.gate import checks as gate_checks
from compress.evals.gate import item_plan
from compress.evals.gate.checks import Check
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.policy import GatePolicy, resolve_blocking
from compress.evals.gate.windows import judge_kl, judge_perplexity, measure_windows
from compress.evals.json_validity import evaluate_json


class CannotJudge(Exception):
    """Every check of a layer was dropped because the baseline scores at chance."""


def _accuracy_checks(
    context: GateContext,
    layer: str,
    metric: str,
    candidate: list[float],
    baseline: list[float],
    max_drop_points: float | None,
    chance: float,
    notes: list[str],
    block_confidence: float | None = None,
) -> list[Check]:
    """The paired drop check of one accuracy, or a note when the baseline is at chance; with ``block_confidence``,
    the non-inferiority rule whose BLOCK is an exact McNemar test at that level (``checks.noninferiority_check``)."""
    if max_drop_points is None:
        return []
    if gate_checks.at_chance(baseline, chance, context.policy.confidence):
        share = sum(baseline) / len(baseline)
        notes.append(
            f"{metric}: cannot judge at this model size: the baseline scores {share:.0%} on {len(baseline)} items, "
            f"not distinguishable from chance ({chance:.0%})"
        )
        return []
    confidence = context.policy.confidence
    if block_confidence is not None:
        return [
            gate_checks.noninferiority_check(
                layer, metric, candidate, baseline, max_drop_points, confidence, block_confidence
            )
        ]
    return [gate_checks.drop_check(layer, metric, candidate, baseline, max_drop_points, confidence)]


def _judged(metrics: dict, checks: list[Check], notes: list[str]) -> tuple[dict, list[Check]]:
    if notes:
        metrics["notes"] = notes
    if not checks and notes:
        raise CannotJudge("; ".join(notes))
    return metrics, checks


def measure_lm_eval(context: GateContext, subjects: list[Subject]) -> dict:
    """The shipped benchmarks by the item plan (:mod:`item_plan`: the baseline's outcomes cached, the candidate's
    count planned from a pilot), the other tasks on ``limit`` items each."""
    from compress.evals.lm_eval_tasks import CHOICE_TASK, run_lm_eval, write_choice_task

    policy = context.policy.lm_eval
    tasks, include_paths = list(policy.tasks), []
    if policy.local_task:
        folder = context.out_dir / "lm_eval_tasks"
        include_paths.append(write_choice_task(context.evaluation_texts, folder, policy.limit, context.policy.seed))
        tasks.insert(0, CHOICE_TASK)
    if policy.include_path:
        include_paths.append(Path(policy.include_path).expanduser())
    if not tasks and not policy.benchmarks:
        raise CompressError(
            "the lm_eval layer has no tasks: set gate.lm_eval.benchmark (e.g. arc_easy), gate.lm_eval.tasks or "
            "gate.lm_eval.local_task=true"
        )
    measured: dict = {}
    earlier = context.measured.get("lm_eval", {})
    for subject in sorted(subjects, key=lambda subject: subject.label != "baseline"):  # the pilot reads the baseline
        results: dict = {}
        if policy.benchmarks:
            baseline = measured.get("baseline", earlier.get("baseline"))
            results, plan = item_plan.measure_benchmarks(context, subject, baseline)
            if subject.label == "candidate":
                measured["plan"] = plan
        if tasks:
            results.update(
                run_lm_eval(
                    subject.model, subject.tokenizer, tasks, include_paths, policy.limit, policy.batch_size,
                    policy.max_length,
                )
            )  # fmt: skip
        measured[subject.label] = results
    return measured


def pooled_outcomes(results: dict, tasks: list[str]) -> dict[str, tuple[list[float], float]]:
    """Per metric every task reports per item (``acc``): the tasks' outcomes concatenated in ``tasks`` order, and
    the chance level weighted by each task's item count."""
    pooled = {}
    for name in set.intersection(*(set(results[task].get("outcomes", {})) for task in tasks)):
        lists = [results[task]["outcomes"][name] for task in tasks]
        items = sum(len(outcomes) for outcomes in lists)
        chance = sum((results[task].get("chance") or 0.0) * len(o) for task, o in zip(tasks, lists, strict=True))
        pooled[name] = ([value for outcomes in lists for value in outcomes], chance / items)
    return pooled


def judge_lm_eval(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    from compress.evals.lm_eval_tasks import benchmark_task_name

    policy = context.policy.lm_eval
    checks: list[Check] = []
    notes: list[str] = []
    block_confidence = item_plan.block_confidence(context)
    # The baseline is scored on the whole pool: judged on the items the candidate was scored on (a prefix of each).
    paired = {
        task: item_plan.prefix(metrics["baseline"][task], len(next(iter(result["outcomes"].values()), [])))
        for task, result in metrics["candidate"].items()
    }
    # Several shipped benchmarks are one check over all their items (docs/gate.md: the size the power analysis
    # assumes, one Bonferroni share); each one's own accuracy stays in the report.
    pooled = [benchmark_task_name(name) for name in policy.benchmarks] if len(policy.benchmarks) > 1 else []
    if pooled:
        candidate, baseline = (
            pooled_outcomes(metrics["candidate"], pooled),
            pooled_outcomes(paired, pooled),
        )
        for name, (outcomes, chance) in sorted(candidate.items()):
            if all(metrics["candidate"][task]["higher_is_better"].get(name) for task in pooled):
                checks += _accuracy_checks(
                    context, "lm_eval", f"{'+'.join(policy.benchmarks)}/{name}", outcomes, baseline[name][0],
                    policy.max_drop_points, chance, notes, block_confidence,
                )  # fmt: skip
    for task, result in metrics["candidate"].items():
        if task in pooled:
            continue
        baseline = paired[task]
        for name, outcomes in result.get("outcomes", {}).items():
            if not result["higher_is_better"].get(name):
                continue
            checks += _accuracy_checks(
                context, "lm_eval", f"{task}/{name}", outcomes, baseline["outcomes"][name], policy.max_drop_points,
                result.get("chance") or 0.0, notes, block_confidence,
            )  # fmt: skip
        unjudged = [name for name in result["metrics"] if name not in result.get("outcomes", {})]
        if unjudged:
            notes.append(f"{task}: {unjudged} reported, not judged (no per-item scores to give an interval)")
    for check in checks:
        check.summary += item_plan.plan_text(metrics.get("plan"), check, policy.benchmarks)
    return _judged(metrics, checks, notes)


def measure_json(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.json
    metrics = {}
    for subject in subjects:
        # Constrained decoding needs per-step logits: always the transformers loop, whatever the backend.
        generator = (
            generation.TransformersGenerator(subject.model, subject.tokenizer)
            if policy.constrained
            else subject.generator
        )
        metrics[subject.label] = evaluate_json(
            generator,
            subject.tokenizer,
            subject.model.config.vocab_size,
            policy.max_new_tokens,
            policy.num_prompts,
            policy.constrained,
        )
    return metrics


def judge_json(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    policy = context.policy.json
    checks: list[Check] = []
    notes: list[str] = []
    for name, field, max_drop in (
        ("json_validity", "valid", policy.max_validity_drop_points),
        ("json_schema_compliance", "compliant", policy.max_compliance_drop_points),
    ):
        candidate = [float(sample[field]) for sample in metrics["candidate"]["samples"]]
        baseline = [float(sample[field]) for sample in metrics["baseline"]["samples"]]
        checks += _accuracy_checks(context, "json", name, candidate, baseline, max_drop, 0.0, notes)
    if policy.min_validity is not None:
        candidate = [float(sample["valid"]) for sample in metrics["candidate"]["samples"]]
        checks.append(
            gate_checks.accuracy_floor_check(
                "json", "json_validity", candidate, policy.min_validity, context.policy.confidence
            )
        )
    return _judged(metrics, checks, notes)


def _lengths(requested: list[int], context: GateContext, key: str, shortest: int = 1) -> list[int]:
    """The requested lengths that fit the model's context and the layer's shortest prompt; none is a layer that
    cannot judge this model, not an error."""
    lengths = [length for length in needle.context_lengths(list(requested), context.max_context) if length >= shortest]
    if not lengths:
        raise CannotJudge(
            f"none of gate.{key}.context_lengths={list(requested)} fits both the model's context of "
            f"{context.max_context} tokens and the layer's shortest prompt of {shortest} tokens"
        )
    return lengths


def _generated(context: GateContext, subjects: list[Subject], evaluate, lengths, variants, trials: int) -> dict:
    """Each side's run of a generation layer over the same seeded prompts, the evaluation text as their filler."""
    filler = context.evaluation_ids.tolist()
    return {
        subject.label: evaluate(
            subject.generator, subject.tokenizer, filler, lengths, list(variants), trials, context.policy.seed
        )
        for subject in subjects
    }


def measure_needle(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.needle
    lengths = _lengths(policy.context_lengths, context, "needle")
    return _generated(context, subjects, needle.evaluate_needle, lengths, policy.depths, policy.trials)


def judge_needle(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    policy = context.policy.needle
    heatmap = needle.plot_heatmaps(
        {label: metrics[label] for label in ("candidate", "baseline")}, context.out_dir / "needle_heatmap.png"
    )
    context.files.append(heatmap)
    candidate, baseline = metrics["candidate"]["outcomes"], metrics["baseline"]["outcomes"]
    notes: list[str] = []
    checks = _accuracy_checks(
        context, "needle", "needle_accuracy", candidate, baseline, policy.max_drop_points, 0.0, notes
    )
    if policy.min_accuracy is not None:
        confidence = context.policy.confidence
        checks.append(
            gate_checks.accuracy_floor_check("needle", "needle_accuracy", candidate, policy.min_accuracy, confidence)
        )
    return _judged(metrics, checks, notes)


def measure_long_context(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.long_context
    shortest = max(long_context.minimum_length(task, subjects[0].tokenizer) for task in policy.tasks)
    lengths = _lengths(policy.context_lengths, context, "long_context", shortest)
    return _generated(context, subjects, long_context.evaluate_long_context, lengths, policy.tasks, policy.trials)


def judge_long_context(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    """One check per task, each against its own chance level (copying a hidden number scores 1/2 on
    variable_tracking, 1/4 on multi_key): pooled, a task the baseline only guesses would hide behind one it solves."""
    policy = context.policy.long_context
    candidate, baseline = metrics["candidate"], metrics["baseline"]
    tasks = [item["task"] for item in baseline["items"]]
    if tasks != [item["task"] for item in candidate["items"]]:
        raise CompressError("long_context: candidate and baseline were scored on different items")
    notes: list[str] = []
    checks: list[Check] = []
    for task in baseline["tasks"]:

        def of(outcomes: list[int], task: str = task) -> list[int]:
            return [outcome for outcome, item_task in zip(outcomes, tasks, strict=True) if item_task == task]

        checks += _accuracy_checks(
            context, "long_context", f"long_context/{task}", of(candidate["outcomes"]), of(baseline["outcomes"]),
            policy.max_drop_points, baseline["per_task_chance"][task], notes,
        )  # fmt: skip
    return _judged(metrics, checks, notes)


def _latency_prompt(context: GateContext) -> list[int]:
    return context.evaluation_ids[: context.policy.latency.prompt_tokens].tolist()


def measure_latency(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.latency
    generators = {subject.label: subject.generator for subject in subjects}
    prompt = _latency_prompt(context)
    measured = latency.measure_latency(generators, prompt, policy.new_tokens, policy.repeats, policy.warmup)
    for subject in subjects:
        if subject.label == "candidate":  # where it runs decides whether `blocking: auto` blocks
            measured["device"] = next(subject.model.parameters()).device.type
    return measured


def layer_blocking(policy: GatePolicy, name: str, metrics: dict) -> bool:
    """Whether layer ``name`` decides the verdict, ``auto`` resolved from the device its candidate ran on."""
    device = metrics.get("device") if isinstance(metrics, dict) else None
    return resolve_blocking(getattr(policy, name).blocking, device)


def judge_latency(context: GateContext, metrics: dict) -> tuple[dict, list[Check]]:
    policy = context.policy.latency
    for name in ("ttft", "tpot"):
        metrics[f"{name}_ratio"] = metrics["candidate"][f"{name}_p50_ms"] / metrics["baseline"][f"{name}_p50_ms"]
    metrics.update(
        prompt_tokens=len(_latency_prompt(context)),
        new_tokens=policy.new_tokens,
        repeats=policy.repeats,
        interleaved=context.policy.models_in_memory == 2,
    )
    checks = []
    for name, max_ratio in (("ttft", policy.max_ttft_ratio), ("tpot", policy.max_tpot_ratio)):
        if max_ratio is not None:
            candidate, baseline = metrics["candidate"][f"{name}_ms"], metrics["baseline"][f"{name}_ms"]
            confidence = context.policy.confidence
            checks.append(gate_checks.log_ratio_check("latency", name, candidate, baseline, max_ratio, confidence))
    return metrics, checks


LAYERS = {  # name → (measure the loaded models, judge candidate against baseline)
    "perplexity": (measure_windows, judge_perplexity),
    "kl": (measure_windows, judge_kl),
    "lm_eval": (measure_lm_eval, judge_lm_eval),
    "json": (measure_json, judge_json),
    "needle": (measure_needle, judge_needle),
    "long_context": (measure_long_context, judge_long_context),
    "latency": (measure_latency, judge_latency),
}
