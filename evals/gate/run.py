"""The gate's order of work: describe both sides, measure each layer on the baseline and the candidate, judge.

With ``models_in_memory: 1`` (the default) the baseline is loaded, measured on every selected layer and freed before
the candidate loads; the candidate then goes layer by layer and stops at the first BLOCK. An INCONCLUSIVE layer does
not stop it: a later layer may still block. A side no selected layer needs (its perplexity pass given by the caller
or cached) is never loaded.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from compress.data import tokenize
from compress.evals import generation, loading
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.layers import LAYERS, CannotJudge, layer_blocking
from compress.evals.gate.policy import GatePolicy, policy_dict, resolve_policy
from compress.evals.gate.report import clear_verdict, write_report
from compress.evals.gate.result import GateResult, LayerResult
from compress.evals.gate.stats import BLOCK, INCONCLUSIVE, PASS
from compress.evals.gate.windows import cached_baseline

log = logging.getLogger(__name__)

WINDOW_LAYERS = ("perplexity", "kl")


@dataclass
class LayerRun:
    """One layer's measurements as they come in, one side or both at a time; an exception is kept, never skipped."""

    name: str
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    cannot_judge: str | None = None  # why this layer cannot judge this model (CannotJudge), measuring or judging

    def measure(self, context: GateContext, subjects: list[Subject]) -> None:
        self._timed(lambda: self.metrics.update(LAYERS[self.name][0](context, subjects)))

    def judge(self, context: GateContext) -> LayerResult:
        judged: list = []
        self._timed(lambda: judged.extend(LAYERS[self.name][1](context, self.metrics)))
        blocking = layer_blocking(context.policy, self.name, self.metrics)  # `auto`: from the candidate's device
        role = "blocking" if blocking else "advisory"
        if self.error is not None:  # fail closed: an error blocks whatever the layer's role
            return LayerResult(self.name, "error", seconds=self.seconds, error=self.error, role="blocking")
        if self.cannot_judge is not None:
            note = self.cannot_judge
            return LayerResult(self.name, "cannot_judge", seconds=self.seconds, metrics=self.metrics, note=note)
        metrics, checks = judged
        verdicts = {check.verdict for check in checks}
        verdict = BLOCK if BLOCK in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
        status = {PASS: "pass", BLOCK: "fail", INCONCLUSIVE: "inconclusive"}[verdict] if blocking else "warn"
        status = "pass" if verdict == PASS else status
        worst = next((check for check in checks if check.verdict == verdict), None)
        return LayerResult(
            self.name, status, verdict, self.seconds,
            *((worst.estimate, worst.low, worst.high, worst.limit) if worst else (None,) * 4),
            metrics=metrics, checks=checks, role=role,
        )  # fmt: skip

    def _timed(self, work) -> None:
        if self.error is not None or self.cannot_judge is not None:
            return
        start = time.perf_counter()
        try:
            work()
        except CannotJudge as reason:
            self.cannot_judge = str(reason)
        except Exception as error:  # fail closed: whatever went wrong, the checkpoint does not ship
            log.error("gate layer %s raised:\n%s", self.name, traceback.format_exc())
            self.error = f"{type(error).__name__}: {error}"
        self.seconds += time.perf_counter() - start


def run_gate(
    candidate,
    baseline,
    policy: dict | GatePolicy | None,
    out_dir: Path,
    *,
    evaluation_texts: list[str],
    candidate_tokenizer=None,
    baseline_tokenizer=None,
    candidate_path: Path | None = None,
    candidate_label: str | None = None,
    measured: dict[str, dict] | None = None,
    measured_by: str = "run",
) -> GateResult:
    """Judge ``candidate`` against ``baseline`` (paths, model names or loaded models) on ``evaluation_texts`` (text
    held out from calibration) and write ``gate.json``/``gate.md`` to ``out_dir``. ``candidate_path`` names the
    checkpoint of an in-memory candidate; ``candidate_label`` is how reports name the candidate (default: its path).
    ``measured``: both sides' perplexity passes (``PerplexityResult.to_dict()``, the candidate's with its KL
    ``divergence``) when the caller already scored them on these texts: the perplexity and KL layers then judge
    those numbers instead of measuring again, so a run prints one perplexity, not two; ``measured_by`` names who
    measured them in gate.md."""
    resolved = resolve_policy(policy)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_verdict(out_dir)
    if candidate_label is None:
        path_like = isinstance(candidate, str | Path)
        candidate_label = str(candidate) if path_like else str(candidate_path or "<in memory>")
    baseline_label = str(baseline) if isinstance(baseline, str | Path) else "<in memory>"
    result = GateResult(BLOCK, [], [], candidate_label, baseline_label, "none", None, policy_dict(resolved))
    if not resolved.enabled:
        result.verdict, result.reasons = PASS, ["gate disabled by policy (gate.enabled=false): nothing was checked"]
        result.files = write_report(result, out_dir)
        return result
    selected = [name for name in resolved.layers if getattr(resolved, name).enabled]
    if not selected:
        result.reasons.append(
            f"no check ran: gate.layers={resolved.layers} with every listed layer disabled or none listed; "
            "enable a layer, or set gate=none to skip the gate on purpose"
        )
        result.files = write_report(result, out_dir)
        return result
    prepared = _prepare(
        result, resolved, candidate, baseline, candidate_tokenizer, baseline_tokenizer, candidate_path,
        evaluation_texts, out_dir, selected,
    )  # fmt: skip
    if prepared is not None:
        context, subjects = prepared
        if measured is not None:
            context.scores, context.scores_source = dict(measured), measured_by
        _run_layers(result, context, subjects, selected)
        if not result.reasons and not any(layer.checks for layer in result.layers):
            result.reasons.append(f"no check ran: layers {selected} ran with every limit set to null; set a limit")
            result.verdict = BLOCK
    result.files = [*write_report(result, out_dir), *(prepared[0].files if prepared else [])]
    return result


def _needs(name: str, context: GateContext, subject: Subject) -> bool:
    """Whether layer ``name`` must load ``subject``: the window layers not when its pass is already known (given by
    the caller, or the baseline's in the reference cache)."""
    if name not in WINDOW_LAYERS:
        return True
    try:
        return not cached_baseline(context, subject)
    except Exception:  # noqa: BLE001 - measured (and failed closed) by the layer itself
        return True


def _run_layers(result: GateResult, context: GateContext, subjects: dict[str, Subject], selected: list[str]) -> None:
    """Measure and judge each selected layer in order; the first BLOCK skips the layers after it.

    The leading layers whose numbers are already known (the run's own perplexity passes) are judged before any
    model loads, so a run whose perplexity blocks never loads the baseline for the layers it will skip."""
    candidate, baseline = subjects["candidate"], subjects["baseline"]
    runs = [LayerRun(name) for name in selected]
    known = 0
    while known < len(runs) and not any(_needs(runs[known].name, context, side) for side in (candidate, baseline)):
        known += 1
    verdicts = _Verdicts()
    for run in runs[:known]:
        verdicts.add(run, context, result, [])
    pending = runs[known:]
    backend, engine_options = result.backend, dict(context.policy.engine)
    one_at_a_time = context.policy.models_in_memory == 1
    together = [candidate] if one_at_a_time else [candidate, baseline]
    if pending and one_at_a_time and not verdicts.blocked:
        baseline_runs = [run for run in pending if _needs(run.name, context, baseline)]
        if baseline_runs and _loading(verdicts.blocked, baseline, backend, engine_options):
            for run in baseline_runs:
                log.info("gate: %s (baseline)", run.name)
                run.measure(context, [baseline])
            baseline.unload()
    for side in together:
        if pending and not verdicts.blocked and any(_needs(run.name, context, side) for run in pending):
            _loading(verdicts.blocked, side, backend, engine_options)
    for run in pending:
        verdicts.add(run, context, result, [side for side in together if side.model is not None])
    for subject in together:
        subject.unload()
    result.reasons = verdicts.blocked + verdicts.undecided
    result.verdict = BLOCK if verdicts.blocked else INCONCLUSIVE if verdicts.undecided else PASS


@dataclass
class _Verdicts:
    """The reasons collected so far: once one blocks, the remaining layers are skipped."""

    blocked: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)

    def add(self, run: LayerRun, context: GateContext, result: GateResult, loaded: list[Subject]) -> None:
        if self.blocked:  # a BLOCK already decided the verdict: skip the costlier layers
            result.layers.append(LayerResult(run.name, "skipped"))
            return
        log.info("gate: %s", run.name)
        run.measure(context, loaded)
        layer = run.judge(context)
        result.layers.append(layer)
        if layer.status == "error":
            self.blocked.append(f"{run.name}: evaluator error (fail closed): {layer.error}")
        elif layer.status == "fail":
            self.blocked += [check.describe() for check in layer.checks if check.verdict == BLOCK]
        elif layer.status == "inconclusive":
            self.undecided += [check.describe() for check in layer.checks if check.verdict == INCONCLUSIVE]


def _loading(blocked: list[str], subject: Subject, backend: str, engine_options: dict) -> bool:
    """Load one side and its generator; a failure blocks like any evaluator error."""
    try:
        subject.load(backend, engine_options)
    except Exception as error:  # fail closed
        blocked.append(_setup_failed(f"load the {subject.label}", error))
        return False
    return True


def _setup_failed(what: str, error: Exception) -> str:
    """A gate that could not get ready blocks, with the reason, like any evaluator error."""
    log.error("gate could not %s:\n%s", what, traceback.format_exc())
    return f"setup: evaluator error (fail closed): {type(error).__name__}: {error}"


def describe_sides(candidate, baseline, evaluation_texts: list[str], candidate_tokenizer=None, baseline_tokenizer=None):
    """``(tokenizer, config, folder)`` of each side, read without loading either model, after checking that both
    read the evaluation text alike (:class:`loading.MismatchedTokenizers` otherwise): the gate command calls it
    before it opens an MLflow run, so a wrong baseline writes nothing."""
    candidate_side = loading.describe("candidate", candidate, candidate_tokenizer)
    # A baseline folder brings its own tokenizer; a model in memory or a folder saved without one uses the candidate's.
    own = baseline_tokenizer if isinstance(baseline, str | Path) else baseline_tokenizer or candidate_side[0]
    tokenizer, config, folder = loading.describe("baseline", baseline, own)
    tokenizer = tokenizer or candidate_side[0]
    loading.check_same_tokenization(candidate_side[0], tokenizer, "\n\n".join(evaluation_texts))
    return candidate_side, (tokenizer, config, folder)


def _prepare(
    result, policy, candidate, baseline, candidate_tokenizer, baseline_tokenizer, candidate_path, evaluation_texts,
    out_dir, selected,
) -> tuple[GateContext, dict[str, Subject]] | None:  # fmt: skip
    """Both sides described (tokenizer, config, KV dtype) without loading either model, and the evaluation ids; a
    failure here blocks like any evaluator error."""
    try:
        (candidate_tokenizer, candidate_config, candidate_dir), (baseline_tokenizer, baseline_config, baseline_dir) = (
            describe_sides(candidate, baseline, evaluation_texts, candidate_tokenizer, baseline_tokenizer)
        )
        candidate_dir = candidate_dir or (Path(candidate_path) if candidate_path else None)
        kv_cache_dtype = policy.kv_cache_dtype or loading.kv_cache_dtype_of(candidate_dir)
        result.backend = generation.choose_backend(policy.backend)
        result.kv_cache_dtype = kv_cache_dtype
        subjects = {
            "candidate": Subject("candidate", candidate, candidate_tokenizer, kv_cache_dtype, candidate_dir),
            # The baseline keeps its own cache dtype: it is the reference the candidate's KV quantization is judged by.
            "baseline": Subject(
                "baseline", baseline, baseline_tokenizer, loading.kv_cache_dtype_of(baseline_dir), baseline_dir
            ),
        }
        ids = tokenize(candidate_tokenizer, "\n\n".join(evaluation_texts))
        max_context = min(
            getattr(config, "max_position_embeddings", 2048) for config in (candidate_config, baseline_config)
        )
    except loading.MismatchedTokenizers:
        raise  # a usage error: nothing can be judged against that baseline
    except Exception as error:  # fail closed
        result.reasons.append(_setup_failed("prepare its inputs", error))
        return None
    context = GateContext(policy, list(evaluation_texts), ids, max_context, out_dir, selected=selected)
    return context, subjects
