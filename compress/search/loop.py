"""Step 3: the closed loop. Build a frontier point, gate it, move along the frontier from the gate's measured
failure, bisect after a pass, confirm the choice on sealed windows; see the package docstring."""

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
from compress.search.record import Confirmation, SearchResult, Tracker, Trial, outcome_line, write_summary
from compress.search.sensitivity import measure_sensitivity
from compress.search.spec import SEARCHABLE, SearchSpec
from compress.stages import build_chain

if TYPE_CHECKING:
    from compress.evals.gate.runner import BaselineMeasures
    from compress.evals.gate.windows import WindowSplit

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
    from compress.evals.gate.windows import SEALED, SEARCH, WindowSplit

    candidates = spec.check()
    position, quantizer = _weight_quantizer(config.stages)
    policy = resolve_policy(config.gate)
    if not policy.enabled:
        raise CompressError(
            "search needs a gate to close the loop; gate=none judges nothing: choose gate=quick|default"
        )
    if spec.confirm and not _window_layers(policy):
        raise CompressError(
            f"search.confirm=true confirms the choice on sealed perplexity/KL windows, but gate.layers={policy.layers} "
            "judges none: add perplexity or kl to gate.layers, or set search.confirm=false"
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
    searched = sealed = None  # search.confirm=false: every trial may score every window
    if spec.confirm:
        _check_split(tokenizer, judged, policy.perplexity.seq_len, spec.confirm_share)
        searched, sealed = WindowSplit(SEARCH, spec.confirm_share), WindowSplit(SEALED, spec.confirm_share)
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
                       trial_dir, tracker, baseline, searched)
            )  # fmt: skip
        else:
            outcome = next_point(frontier, trials, spec, policy.perplexity.max_ratio)
            outcome = outcome if outcome in ("passed", "budget") else "max_trials"
        passing = [t for t in trials if t.passed]
        best = min(passing, key=lambda t: t.bits_per_weight) if passing else None
        confirmation = _confirm(config, best, judged, folder / "confirmation", sealed) if best and sealed else None
        if confirmation is not None and not confirmation.passed:
            outcome = "unconfirmed"
        line = outcome_line(outcome, trials, best, spec, confirmation)
        result = SearchResult(outcome, line, trials, best, folder, tracker.run_id, confirmation)
        write_summary(result, spec, frontier)
        tracker.finish(result, policy)
    except BaseException as error:
        tracker.fail(error)
        raise
    return result


def _window_layers(policy) -> list[str]:
    """The gate's enabled perplexity and KL layers: the ones whose windows a split can seal."""
    return [name for name in policy.layers if name in ("perplexity", "kl") and getattr(policy, name).enabled]


def _check_split(tokenizer, texts: list[str], seq_len: int, share: float) -> None:
    """Both parts of the evaluation text's windows hold the two an interval needs, or one line names the fix."""
    from compress.base.data import tokenize
    from compress.evals.gate.windows import SEALED, SEARCH, WindowSplit
    from compress.evals.perplexity import available_windows

    available = available_windows(tokenize(tokenizer, "\n\n".join(texts)), seq_len)
    for part in (SEARCH, SEALED):
        count = len(WindowSplit(part, share).positions(available))
        if count < 2:
            raise CompressError(
                f"search.confirm_share={share:g} leaves the {part} part {count} of the evaluation text's {available} "
                f"windows of {seq_len} tokens; each part needs ≥ 2: give a longer eval.data, change "
                "search.confirm_share, or set search.confirm=false"
            )


def _confirm(config, best: Trial, texts: list[str], folder: Path, sealed: WindowSplit) -> Confirmation:
    """The chosen checkpoint gated once on the sealed windows, on the window layers alone (the others' items are
    the ones its trial already scored); ``gate.decide`` may add sealed windows, at its Bonferroni level per look."""
    from compress.evals.gate import run_gate

    policy = replace(
        config.gate, decide=True, layers=_window_layers(config.gate),
        registry=replace(config.gate.registry, register=False),
    )  # fmt: skip
    verdict = run_gate(
        Path(best.checkpoint), resolve_model_path(config.model), policy, folder, evaluation_texts=texts,
        candidate_label=best.checkpoint, window_split=sealed,
    )  # fmt: skip
    ratio, interval = _perplexity_ratio(verdict)
    layer = verdict.layer("perplexity") or verdict.layer("kl")
    protocol = layer.metrics.get("protocol", {}) if layer is not None else {}
    log.info("search confirmation of trial %d: %s", best.number, verdict.verdict)
    return Confirmation(
        trial=best.number,
        verdict=verdict.verdict,
        reasons=list(verdict.reasons),
        windows=protocol.get("windows", 0),
        window_positions=list(protocol.get("window_positions", [])),
        ppl_ratio=ratio,
        ppl_interval=interval,
        gate_dir=str(folder),
    )


def _perplexity_ratio(verdict) -> tuple[float | None, tuple[float, float] | None]:
    """The gate's perplexity ratio and its interval, when it judged perplexity."""
    candidate_ppl = verdict.metric("perplexity", "perplexity")
    baseline_ppl = verdict.metric("perplexity", "perplexity", "baseline")
    layer = verdict.layer("perplexity")
    interval = (layer.low, layer.high) if layer is not None and layer.low is not None else None
    return (candidate_ppl / baseline_ppl if candidate_ppl and baseline_ppl else None), interval


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
           texts: list[str], folder: Path, tracker: Tracker, baseline: BaselineMeasures,
           searched: WindowSplit | None) -> Trial:  # fmt: skip
    """Compress a fresh copy of the model with this allocation, save it, gate it against the baseline's kept
    measurements (measured by the first trial that needs each layer) on the search's part of the windows, record
    it."""
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
        candidate_label=str(checkpoint), baseline_measures=baseline, window_split=searched,
    )  # fmt: skip
    ratio, interval = _perplexity_ratio(verdict)
    trial = Trial(
        number=number,
        point=point,
        bits_per_weight=summary.linear_bits_per_weight,
        predicted_cost=allocation.cost,
        passed=verdict.passed,
        ppl_ratio=ratio,
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
