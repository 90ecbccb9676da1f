"""The gate's order of work: describe both sides, measure each layer on the baseline and the candidate, judge.

With ``models_in_memory: 1`` (the default) the baseline is loaded, measured on every selected layer and freed before
the candidate loads; the candidate then goes layer by layer and stops at the first BLOCK. An INCONCLUSIVE layer does
not stop it: a later layer may still block. A side no selected layer needs (its perplexity pass given by the caller
or cached) is never loaded. A caller judging several candidates against one baseline (``compress search``) passes one
:class:`BaselineMeasures` to every gate: the baseline is then measured once per layer, and lazily (see there).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from compress.base.data import token_digest, tokenize
from compress.evals import generation, sides
from compress.evals.gate import item_plan
from compress.evals.gate.checks import familywise
from compress.evals.gate.context import GateContext, Subject
from compress.evals.gate.layers import LAYERS, CannotJudge, layer_blocking
from compress.evals.gate.policy import WINDOW_LAYERS, GatePolicy, blocking_checks, policy_dict, resolve_policy
from compress.evals.gate.report import clear_verdict, write_report
from compress.evals.gate.result import GateResult, LayerResult
from compress.evals.gate.stats import BLOCK, INCONCLUSIVE, PASS, familywise_confidence
from compress.evals.gate.windows import WindowSplit, domain_contexts, known

log = logging.getLogger(__name__)


@dataclass
class LayerRun:
    """One layer's measurements as they come in, one side or both at a time; an exception is kept, never skipped."""

    name: str
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    cannot_judge: str | None = None  # why this layer cannot judge this model (CannotJudge), measuring or judging

    def measure(self, context: GateContext, subjects: list[Subject]) -> None:
        context.measured[self.name] = self.metrics
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
        if blocking and context.policy.familywise:
            family = blocking_checks(context.policy, context.selected)
            checks = [familywise(check, familywise_confidence(check.confidence, family)) for check in checks]
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
    baseline_measures: BaselineMeasures | None = None,
    window_split: WindowSplit | None = None,
) -> GateResult:
    """Judge ``candidate`` against ``baseline`` (paths, model names or loaded models) on ``evaluation_texts`` (text
    held out from calibration) and write ``gate.json``/``gate.md`` to ``out_dir``. ``candidate_path`` names the
    checkpoint of an in-memory candidate; ``candidate_label`` is how reports name the candidate (default: its path).
    ``measured``: both sides' perplexity passes (``PerplexityResult.to_dict()``, the candidate's with its KL
    ``divergence``) when the caller already scored them on these texts: the perplexity and KL layers then judge
    those numbers instead of measuring again, so a run prints one perplexity, not two; ``measured_by`` names who
    measured them in gate.md. ``baseline_measures``: the baseline's measurements kept from earlier gates of the same
    baseline, text and policy (read, then added to). ``window_split``: the part of each text's windows the
    perplexity and KL layers may score (``compress search``: its trials' part, or the sealed one)."""
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
        context.window_split = window_split
        if measured is not None:
            context.scores, context.scores_source = dict(measured), measured_by
        if baseline_measures is not None:
            baseline_measures.check_key(_baseline_key(context, subjects["baseline"]))
        _run_layers(result, context, subjects, selected, baseline_measures)
        if not result.reasons and not any(layer.checks for layer in result.layers):
            result.reasons.append(f"no check ran: layers {selected} ran with every limit set to null; set a limit")
            result.verdict = BLOCK
    result.files = [*write_report(result, out_dir), *(prepared[0].files if prepared else [])]
    return result


@dataclass
class BaselineMeasures:
    """The baseline's measurements, kept across gates that judge several candidates against one baseline on one text
    under one policy (``compress search``'s trials, like the KL reference cache but for every layer and in memory):
    each gate reads the layers measured already and adds the ones it measured, so the baseline is measured once per
    layer. It also makes the baseline's passes lazy, cheapest first: the window layers (perplexity, KL) alone, the
    others only once a candidate's windows did not block, so a trial that blocks on perplexity measures nothing more.
    Interleaved latency (``models_in_memory: 2``) is timed with both sides every time. A gate whose baseline, text or
    policy differ (``key``) starts afresh."""

    key: str | None = None
    layers: dict[str, dict] = field(default_factory=dict)  # layer name → its metrics["baseline"]
    windows: dict | None = None  # the baseline's perplexity pass (context.scores["baseline"])
    reference: dict | None = None  # its top-k distributions, the candidate's KL reference
    reference_cached: str | None = None  # the cache file those were read from, if they were
    unjudged: dict[str, str] = field(default_factory=dict)  # layer → why it cannot judge, found before measuring
    domains: dict[str, tuple] = field(default_factory=dict)  # panel domain → (its pass, reference, cache file)

    def check_key(self, key: str) -> None:
        if key != self.key:
            self.key, self.layers, self.unjudged, self.domains = key, {}, {}, {}
            self.windows, self.reference, self.reference_cached = None, None, None

    def reuse(self, context: GateContext, runs: list[LayerRun]) -> None:
        for run in runs:
            if run.name in self.layers and self._kept(run.name, context):
                run.metrics["baseline"] = copy.deepcopy(self.layers[run.name])
            run.cannot_judge = self.unjudged.get(run.name)
        if self.windows is not None and "baseline" not in context.scores:
            context.scores["baseline"], context.reference = self.windows, self.reference
            context.reference_cached = self.reference_cached
        for name, each in domain_contexts(context).items():
            if name in self.domains and "baseline" not in each.scores:
                each.scores["baseline"], each.reference, each.reference_cached = self.domains[name]

    def keep(self, context: GateContext, runs: list[LayerRun]) -> None:
        for run in runs:
            if run.error is None and "baseline" in run.metrics and self._kept(run.name, context):
                self.layers.setdefault(run.name, copy.deepcopy(run.metrics["baseline"]))
            elif run.cannot_judge is not None and not run.metrics:  # the model's context, not this candidate
                self.unjudged[run.name] = run.cannot_judge
        if self.windows is None and context.scores_source == "gate" and "baseline" in context.scores:
            self.windows, self.reference = context.scores["baseline"], context.reference
            self.reference_cached = context.reference_cached
        for name, each in domain_contexts(context).items():
            if name not in self.domains and "baseline" in each.scores:
                self.domains[name] = (each.scores["baseline"], each.reference, each.reference_cached)

    @staticmethod
    def _kept(name: str, context: GateContext) -> bool:
        interleaved = name == "latency" and context.policy.models_in_memory == 2
        return name not in WINDOW_LAYERS and not interleaved


def _baseline_key(context: GateContext, baseline: Subject) -> str:
    """What the baseline's measurements depend on: the model, its KV dtype, the evaluation tokens, the shorter context
    of the two sides, the policy, and the part of the windows it scored (a search's, or the sealed one)."""
    source = str(baseline.source) if isinstance(baseline.source, str | Path) else f"in-memory:{id(baseline.source)}"
    tokens = token_digest(context.evaluation_ids)
    policy = json.dumps(policy_dict(context.policy), sort_keys=True, default=str)
    return "|".join(
        [source, str(baseline.folder), str(baseline.kv_cache_dtype), tokens, str(context.max_context), policy]
        + [str(context.window_split)]
    )


def _needs(run: LayerRun, context: GateContext, subject: Subject) -> bool:
    """Whether ``run`` must still measure ``subject``: not once it failed or cannot judge, not when that side's
    measurement is known (the window layers' pass given by the caller or cached; a kept baseline layer)."""
    if run.error is not None or run.cannot_judge is not None:
        return False
    if run.name not in WINDOW_LAYERS:
        return subject.label not in run.metrics
    try:
        return not known(context, subject)
    except Exception:  # noqa: BLE001 - measured (and failed closed) by the layer itself
        return True


def _run_layers(
    result: GateResult,
    context: GateContext,
    subjects: dict[str, Subject],
    selected: list[str],
    kept: BaselineMeasures | None = None,
) -> None:
    """Measure and judge each selected layer in order; the first BLOCK skips the layers after it.

    A side loads only when a layer still needs it, so layers whose numbers are known (the run's own perplexity
    passes) are judged before any model loads. With one model in memory the baseline is measured on every layer
    that needs it and freed before the candidate loads; with ``kept`` (a search) its window layers come first and
    its other layers only after the candidate's windows did not block, so a trial that blocks there loads nothing
    more."""
    candidate, baseline = subjects["candidate"], subjects["baseline"]
    runs = [LayerRun(name) for name in selected]
    if kept is not None:
        kept.reuse(context, runs)
    for run in runs:  # the baseline's lm-eval outcomes cached by an earlier gate: it is not scored again
        if run.name == "lm_eval" and "baseline" not in run.metrics:
            if (cached := item_plan.cached_baseline(context, baseline)) is not None:
                run.metrics["baseline"] = cached
    verdicts = _Verdicts()
    backend, engine_options = result.backend, dataclasses.asdict(context.policy.engine)
    one_at_a_time = context.policy.models_in_memory == 1
    for index, run in enumerate(runs):
        first_load = kept is None and candidate.model is None and _needs(run, context, candidate)
        if one_at_a_time and not verdicts.blocked and (first_load or _needs(run, context, baseline)):
            _baseline_pass(runs[index:], context, subjects, verdicts, backend, engine_options, staged=kept is not None)
        sides = [side for side in (candidate, baseline) if not verdicts.blocked and _needs(run, context, side)]
        for side in sides:
            if side.model is None and not verdicts.blocked:
                _loading(verdicts.blocked, side, backend, engine_options)
        verdicts.add(run, context, result, [side for side in sides if side.model is not None])
    for subject in (candidate, baseline):
        subject.unload()
    if kept is not None:
        kept.keep(context, runs)
    result.reasons = verdicts.blocked + verdicts.undecided
    result.verdict = BLOCK if verdicts.blocked else INCONCLUSIVE if verdicts.undecided else PASS


def _baseline_pass(
    runs: list[LayerRun], context: GateContext, subjects: dict[str, Subject], verdicts: _Verdicts, backend: str,
    engine_options: dict, staged: bool,
) -> None:  # fmt: skip
    """The baseline alone in memory, measured on ``runs[0]`` and the later layers that need it: all of them, or when
    ``staged`` only those of the same kind (window layers, or the others)."""
    baseline = subjects["baseline"]
    windows = runs[0].name in WINDOW_LAYERS
    measured = []
    for run in runs:
        if staged and (run.name in WINDOW_LAYERS) != windows:
            break
        if _needs(run, context, baseline):
            measured.append(run)
    if not measured:
        return
    subjects["candidate"].unload()
    if _loading(verdicts.blocked, baseline, backend, engine_options):
        for run in measured:
            log.info("gate: %s (baseline)", run.name)
            _timed_measure(run, context, [baseline], f"{run.name} (baseline)")
    baseline.unload()


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
        _timed_measure(run, context, loaded, run.name)
        layer = run.judge(context)
        result.layers.append(layer)
        if layer.status == "error":
            self.blocked.append(f"{run.name}: evaluator error (fail closed): {layer.error}")
        elif layer.status == "fail":
            self.blocked += [check.describe() for check in layer.checks if check.verdict == BLOCK]
        elif layer.status == "inconclusive":
            self.undecided += [check.describe() for check in layer.checks if check.verdict == INCONCLUSIVE]


def _timed_measure(run: LayerRun, context: GateContext, subjects: list[Subject], what: str) -> None:
    """Measure, then log how long it took: a run cut short writes no gate.json, and its log still says where the
    gate's time went (an 8B's quick gate on an H200 outlasted its budget with no trace of which layer was slow)."""
    before = run.seconds  # the layer times its own work
    run.measure(context, subjects)
    log.info("gate: %s measured in %.1f s", what, run.seconds - before)


def _loading(blocked: list[str], subject: Subject, backend: str, engine_options: dict) -> bool:
    """Load one side and its generator, logging how long it took; a failure blocks like any evaluator error."""
    start = time.perf_counter()
    try:
        subject.load(backend, engine_options)
    except Exception as error:  # fail closed
        blocked.append(_setup_failed(f"load the {subject.label}", error))
        return False
    log.info("gate: loaded the %s (%s) in %.1f s", subject.label, backend, time.perf_counter() - start)
    return True


def _setup_failed(what: str, error: Exception) -> str:
    """A gate that could not get ready blocks, with the reason, like any evaluator error."""
    log.error("gate could not %s:\n%s", what, traceback.format_exc())
    return f"setup: evaluator error (fail closed): {type(error).__name__}: {error}"


def describe_sides(candidate, baseline, evaluation_texts: list[str], candidate_tokenizer=None, baseline_tokenizer=None):
    """``(tokenizer, config, folder)`` of each side, read without loading either model, after checking that both
    read the evaluation text alike (:class:`sides.MismatchedTokenizers` otherwise): the gate command calls it
    before it opens an MLflow run, so a wrong baseline writes nothing."""
    candidate_side = sides.describe("candidate", candidate, candidate_tokenizer)
    # A baseline folder brings its own tokenizer; a model in memory or a folder saved without one uses the candidate's.
    own = baseline_tokenizer if isinstance(baseline, str | Path) else baseline_tokenizer or candidate_side[0]
    tokenizer, config, folder = sides.describe("baseline", baseline, own)
    tokenizer = tokenizer or candidate_side[0]
    sides.check_same_tokenization(candidate_side[0], tokenizer, "\n\n".join(evaluation_texts))
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
        kv_cache_dtype = policy.kv_cache_dtype or sides.kv_cache_dtype_of(candidate_dir)
        result.backend = generation.choose_backend(policy.backend)
        result.kv_cache_dtype = kv_cache_dtype
        subjects = {
            "candidate": Subject("candidate", candidate, candidate_tokenizer, kv_cache_dtype, candidate_dir),
            # The baseline keeps its own cache dtype: it is the reference the candidate's KV quantization is judged by.
            "baseline": Subject(
                "baseline", baseline, baseline_tokenizer, sides.kv_cache_dtype_of(baseline_dir), baseline_dir
            ),
        }
        ids = tokenize(candidate_tokenizer, "\n\n".join(evaluation_texts))
        domain_ids = _domain_ids(policy, selected, candidate_tokenizer)
        max_context = min(
            getattr(config, "max_position_embeddings", 2048) for config in (candidate_config, baseline_config)
        )
    except sides.MismatchedTokenizers:
        raise  # a usage error: nothing can be judged against that baseline
    except Exception as error:  # fail closed
        result.reasons.append(_setup_failed("prepare its inputs", error))
        return None
    context = GateContext(policy, list(evaluation_texts), ids, max_context, out_dir, selected=selected)
    context.domain_ids = domain_ids
    return context, subjects


def _domain_ids(policy: GatePolicy, selected: list[str], tokenizer) -> dict:
    """The evaluation ids of each kind of text of the domain panel, when a window layer runs."""
    if not policy.domains or not set(selected) & set(WINDOW_LAYERS):
        return {}
    from compress.base.data import domain_panel, load_corpus

    panel = domain_panel()
    return {name: tokenize(tokenizer, "\n\n".join(load_corpus(panel[name]).evaluation)) for name in policy.domains}
