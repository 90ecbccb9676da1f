"""Step 3: the closed loop. Build a frontier point, gate it, move along the frontier from the gate's measured
failure, bisect after a pass; see the package docstring."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from compress.base.data import load_corpus
from compress.base.distributed import select_device
from compress.base.errors import CompressError
from compress.base.paths import artifacts_dir
from compress.base.staging import sweep_stale_staging
from compress.compression.in_memory import compress_model
from compress.compression.saving import checkpoint_writer, write_checkpoint
from compress.model.calibration_set import calibration_set
from compress.model.sources import load, resolve_model_path
from compress.search.frontier import Allocation, Frontier, budget_error
from compress.search.record import SearchResult, Tracker, Trial, outcome_line, write_summary
from compress.search.sensitivity import measure_sensitivity
from compress.search.spec import SEARCHABLE, SearchSpec
from compress.stages import build_chain

if TYPE_CHECKING:
    from compress.evals.gate.runner import BaselineMeasures

log = logging.getLogger(__name__)


def next_point(frontier: Frontier, trials: list[Trial], spec: SearchSpec, max_ratio: float | None) -> int | str:
    """The frontier index of the next trial, or why the search ends: ``passed``, ``budget``.

    A trial the gate left INCONCLUSIVE (still undecided after ``gate.decide``'s extra windows) is not a pass, so the
    search climbs past it, and not a block: it bounds no bisection, so the points below it stay open."""
    last = len(frontier) - 1
    if not trials:
        return 0 if spec.start_bits is None else frontier.at_most(spec.start_bits)
    passed = [t for t in trials if t.passed]
    failed = [t for t in trials if not t.passed]  # blocked or undecided: not a checkpoint the search may return
    if passed:
        best = min(passed, key=lambda t: t.point)
        below = [t.point for t in failed if t.point < best.point and not t.undecided]
        low = max(below) if below else -1  # no block below: the frontier's smallest point is still untried
        tried = {t.point for t in trials}
        untried = [point for point in range(low + 1, best.point) if point not in tried]
        gap = frontier.bits_per_weight(best.point) - frontier.bits_per_weight(max(low, 0))
        if not untried or gap <= spec.tolerance_bits:
            return "passed"
        middle = (frontier.bits[max(low, 0)] + frontier.bits[best.point]) / 2
        point = int(min(max(np.searchsorted(frontier.bits, middle), low + 1), best.point - 1))
        return point if point in untried else min(untried, key=lambda p: abs(float(frontier.bits[p]) - middle))
    worst = max(failed, key=lambda t: t.point)
    if worst.point >= last:
        return "budget"
    ratio = worst.ppl_ratio
    if max_ratio is not None and ratio is not None and worst.predicted_cost > 0:
        if ratio > max_ratio:  # log(ppl ratio) ∝ predicted error, calibrated on the last block
            target = spec.margin * math.log(max_ratio) * worst.predicted_cost / math.log(ratio)
        elif worst.undecided and any(reason.startswith("perplexity") for reason in worst.reasons):
            target = spec.margin * worst.predicted_cost  # undecided at the limit: a little less error
        else:
            target = None
        if target is not None:
            meets = np.nonzero(frontier.cost[worst.point + 1 :] <= target)[0]
            return worst.point + 1 + int(meets[0]) if len(meets) else last
    middle = (frontier.bits[worst.point] + frontier.bits[last]) / 2  # the failure says nothing about perplexity
    return int(max(np.searchsorted(frontier.bits, middle), worst.point + 1))


def run_search(config, spec: SearchSpec, folder: Path | None = None) -> SearchResult:
    """Sensitivity → frontier → trials for the composed base recipe ``config`` (a ``RunConfig``)."""
    from compress.evals.gate import resolve_policy
    from compress.evals.gate.runner import BaselineMeasures

    candidates = spec.check()
    position, quantizer = _weight_quantizer(config.stages)
    policy = resolve_policy(config.gate)
    if not policy.enabled:
        raise CompressError(
            "search needs a gate to close the loop; gate=none judges nothing: choose gate=quick|default"
        )
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.recipe}-{spec.budget_bits:g}bits"
    folder = Path(folder or (Path(config.output.dir) if config.output.dir else artifacts_dir() / "searches") / stamp)
    if folder.exists():
        raise CompressError(f"search folder {folder} already exists; choose another output.dir")
    for trial in folder.parent.glob("*/trial-*"):  # checkpoints a killed search was writing
        sweep_stale_staging(trial)
    device = select_device(config.device)
    corpus = load_corpus(config.data)
    # trials are judged on the run's headline text: another source than the calibration data unless eval.data=null
    judged = load_corpus(config.eval.data).evaluation if config.eval.data is not None else corpus.evaluation
    model, tokenizer = load(config.model)
    samples = calibration_set(model, tokenizer, corpus.calibration_text, config.data, config.seed)
    units = measure_sensitivity(
        model, samples, [c.name for c in candidates], list(quantizer.get("ignore", [])), spec.weighting, device,
        config.calibration_batch_size,
    )  # fmt: skip
    del model
    frontier = Frontier(units, spec.budget_bits * sum(unit.params for unit in units))
    if not len(frontier):
        raise CompressError(budget_error(units, spec.budget_bits))
    folder.mkdir(parents=True)
    tracker = Tracker(config, spec, folder)
    baseline = BaselineMeasures()  # measured once per layer for the whole search, lazily (cheapest first)
    trials: list[Trial] = []
    outcome = "max_trials"
    try:
        while len(trials) < spec.max_trials:
            point = next_point(frontier, trials, spec, policy.perplexity.max_ratio)
            if isinstance(point, str):
                outcome = point
                break
            allocation = frontier.allocation(point)
            trial_dir = folder / f"trial-{len(trials) + 1}"
            stage_args = [dict(stage) for stage in config.stages]
            stage_args[position] = _mixed_stage(quantizer, allocation.per_module(units))
            trials.append(
                _trial(config, len(trials) + 1, point, allocation, stage_args, samples, device, judged,
                       trial_dir, tracker, baseline)
            )  # fmt: skip
        else:
            outcome = next_point(frontier, trials, spec, policy.perplexity.max_ratio)
            outcome = outcome if outcome in ("passed", "budget") else "max_trials"
        passing = [t for t in trials if t.passed]
        best = min(passing, key=lambda t: t.bits_per_weight) if passing else None
        line = outcome_line(outcome, trials, best, spec)
        result = SearchResult(outcome, line, trials, best, folder, tracker.run_id)
        write_summary(result, spec, frontier)
        tracker.finish(result, policy)
    except BaseException as error:
        tracker.fail(error)
        raise
    return result


def _weight_quantizer(stages: list[dict]) -> tuple[int, dict]:
    for position, stage in enumerate(stages):
        if stage.get("type") in SEARCHABLE:
            return position, stage
    kinds = [stage.get("type") for stage in stages]
    raise CompressError(
        f"search needs a base recipe whose weight quantizer is {' or '.join(SEARCHABLE)} (its stages: {kinds}); "
        "e.g. recipe=gptq_int4 or recipe=rtn_int4"
    )


def _mixed_stage(quantizer: dict, schemes: dict[str, str]) -> dict:
    """The base recipe's quantizer as a ``mixed`` stage with one scheme per linear (its knobs kept)."""
    knobs = {k: v for k, v in quantizer.items() if k not in ("type", "bits", "group_size", "symmetric")}
    return {"type": "mixed", "method": quantizer["type"], **knobs, "schemes": schemes}


def _trial(config, number: int, point: int, allocation: Allocation, stage_args: list[dict], samples, device,
           texts: list[str], folder: Path, tracker: Tracker, baseline: BaselineMeasures) -> Trial:  # fmt: skip
    """Compress a fresh copy of the model with this allocation, save it, gate it against the baseline's kept
    measurements (measured by the first trial that needs each layer), record it."""
    from compress.evals.gate import run_gate

    model, tokenizer = load(config.model)
    stages = build_chain(stage_args)
    checkpoint = folder / "checkpoint"
    with checkpoint_writer(checkpoint, config.output.save_dtype) as writer:
        summaries = compress_model(
            model, stages, samples, device, config.calibration_batch_size, writer.layer_sink(model)
        )
        summary = write_checkpoint(
            writer, model, tokenizer, stages, summaries, f"{config.recipe}-search", stage_args, calibration=samples
        )
    del model
    # the best is registered later; an INCONCLUSIVE verdict gets more windows (gate.decide) before it counts, and one
    # still undecided at the cap is recorded as such: neither a pass nor a block (next_point)
    policy = replace(config.gate, decide=True, registry=replace(config.gate.registry, register=False))
    verdict = run_gate(
        checkpoint, resolve_model_path(config.model), policy, folder / "gate", evaluation_texts=texts,
        candidate_label=str(checkpoint), baseline_measures=baseline,
    )  # fmt: skip
    candidate_ppl = verdict.metric("perplexity", "perplexity")
    baseline_ppl = verdict.metric("perplexity", "perplexity", "baseline")
    layer = verdict.layer("perplexity")
    interval = (layer.low, layer.high) if layer is not None and layer.low is not None else None
    trial = Trial(
        number=number,
        point=point,
        bits_per_weight=summary.linear_bits_per_weight,
        predicted_cost=allocation.cost,
        passed=verdict.passed,
        ppl_ratio=candidate_ppl / baseline_ppl if candidate_ppl and baseline_ppl else None,
        reasons=list(verdict.reasons),
        checkpoint=str(checkpoint),
        size_mb=summary.size_mb,
        schemes=allocation.counts(),
        verdict=verdict.verdict,
        ppl_interval=interval,
    )
    log.info("search trial %d: %.3f bits/weight, %s", number, trial.bits_per_weight, trial.verdict)
    tracker.trial(trial, verdict, checkpoint, allocation)
    trial.passed = verdict.passed  # recording the verdict fails closed: a verdict MLflow lost is a block
    trial.reasons, trial.verdict = list(verdict.reasons), verdict.verdict
    return trial
