"""The release gate: a regressed checkpoint must not ship.

Layers run cheapest first (perplexity, lm-eval, JSON validity, needle-in-a-haystack, latency); each compares the
candidate with the baseline under limits from ``recipes/gate/*.yaml``, either hard (``needle.min_accuracy``) or
relative to the baseline (``perplexity.max_ratio``). The first blocking failure stops the gate, and the gate fails
closed: an evaluator that raises blocks the release, and so does a gate that ran no check at all. Outputs: ``gate.json``
and ``gate.md`` (the table a reviewer reads) and the needle heatmap. The gate only judges: recording the verdict in
MLflow and registering the checkpoint is the caller's job (``compress.tracking.record_verdict``), so this package never
imports the CLI, pipeline or tracking layers.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.data import tokenize
from compress.errors import CompressError
from compress.memory import release_freed_memory
from evals import generation, latency, loading, needle
from evals.json_validity import evaluate_json
from evals.perplexity import resident_perplexity

log = logging.getLogger(__name__)

LAYER_ORDER = ["perplexity", "lm_eval", "json", "needle", "latency"]


@dataclass
class PerplexityPolicy:
    enabled: bool = True
    blocking: bool = True
    seq_len: int = 512
    max_windows: int | None = 32
    batch_size: int = 4
    max_ratio: float | None = 1.05  # candidate ppl ≤ max_ratio × baseline ppl
    max_value: float | None = None  # hard ceiling on candidate ppl


@dataclass
class LmEvalPolicy:
    enabled: bool = True
    blocking: bool = True
    local_task: bool = True  # rolling loglikelihood over our evaluation split
    tasks: list[str] = field(default_factory=list)  # any lm-eval task names the machine has data for
    include_path: str | None = None  # a folder of the user's own task YAMLs
    limit: int | None = 16
    batch_size: int = 1
    max_length: int = 512
    max_perplexity_ratio: float | None = 1.05  # for lower-is-better *perplexity metrics
    max_drop_points: float | None = 2.0  # for higher-is-better metrics (accuracy, exact match, ...)


@dataclass
class JsonPolicy:
    enabled: bool = True
    blocking: bool = True
    constrained: bool = False
    max_new_tokens: int = 96
    num_prompts: int | None = None
    max_validity_drop_points: float | None = 2.0
    max_compliance_drop_points: float | None = 2.0
    min_validity: float | None = None


@dataclass
class NeedlePolicy:
    enabled: bool = True
    blocking: bool = True
    context_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 4
    max_drop_points: float | None = 2.0
    min_accuracy: float | None = None


@dataclass
class LatencyPolicy:
    enabled: bool = True
    blocking: bool = True
    prompt_tokens: int = 256
    new_tokens: int = 32
    repeats: int = 7
    warmup: int = 1
    max_ttft_ratio: float | None = None
    max_tpot_ratio: float | None = 1.05


@dataclass
class RegistryPolicy:
    """Read by the caller that records the verdict (``compress.tracking.record_verdict``), validated here."""

    register: bool = True
    name: str | None = None  # default: compress-<baseline name>
    promote: bool = False  # also move the ``champion`` alias to the new version


@dataclass
class GatePolicy:
    enabled: bool = True
    enforce: bool = False  # `compress run` exits 1 on a block only when true (the gate command always does)
    layers: list[str] = field(default_factory=lambda: list(LAYER_ORDER))
    backend: str = "auto"  # auto | engine | transformers
    engine: dict[str, Any] = field(default_factory=dict)  # compress.engine.EngineConfig options
    kv_cache_dtype: str | None = None  # null: the candidate's kv_cache_scheme, else the model dtype
    seed: int = 0
    models_in_memory: int = 1  # 1: baseline measured and freed before the candidate loads; 2: both, latency interleaved
    experiment: str = "compress"  # MLflow experiment of gate-only runs (read by compress.commands.gate)
    perplexity: PerplexityPolicy = field(default_factory=PerplexityPolicy)
    lm_eval: LmEvalPolicy = field(default_factory=LmEvalPolicy)
    json: JsonPolicy = field(default_factory=JsonPolicy)
    needle: NeedlePolicy = field(default_factory=NeedlePolicy)
    latency: LatencyPolicy = field(default_factory=LatencyPolicy)
    registry: RegistryPolicy = field(default_factory=RegistryPolicy)


def resolve_policy(policy: dict | None) -> GatePolicy:
    """``policy`` (e.g. ``cfg.gate``) over the defaults; unknown keys and wrong types are user errors."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(GatePolicy), policy or {})
        resolved = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise CompressError(f"bad gate policy: {error}".splitlines()[0] + " (see recipes/gate/default.yaml)") from error
    if resolved.models_in_memory not in (1, 2):
        raise CompressError(f"gate.models_in_memory={resolved.models_in_memory}; use 1 (one model at a time) or 2")
    unknown = [layer for layer in resolved.layers if layer not in LAYER_ORDER]
    if unknown:
        raise CompressError(f"gate.layers has unknown layers {unknown}; choose from {LAYER_ORDER}")
    return resolved


@dataclass
class Check:
    """One limit applied to one metric; ``summary`` is the line a reviewer reads ("perplexity +23.5% > 5% limit")."""

    layer: str
    metric: str
    candidate: float
    baseline: float | None
    limit: str
    passed: bool
    summary: str

    def describe(self) -> str:
        return self.summary


def ratio_check(layer, metric, candidate, baseline, max_ratio) -> Check:
    """Relative to the baseline, stated as a percentage change: a ratio of 1.235 against 1.05 is +23.5% > 5%."""
    passed = candidate <= max_ratio * baseline
    change = (candidate / baseline - 1) * 100 if baseline else float("inf")
    summary = f"{metric} {change:+.1f}% {'≤' if passed else '>'} {round((max_ratio - 1) * 100, 2):g}% limit"
    return Check(layer, metric, candidate, baseline, f"≤ {max_ratio:g} × baseline", passed, summary)


def drop_check(layer, metric, candidate, baseline, max_drop_points) -> Check:
    """Fractions compared in percentage points: 0.90 vs 0.93 is a 3-point drop."""
    passed = candidate * 100 >= baseline * 100 - max_drop_points
    drop = (baseline - candidate) * 100
    summary = (
        f"{metric} {-drop:+.1f} points ({candidate:.0%} vs baseline {baseline:.0%}) "
        f"{'within' if passed else 'beyond'} the {max_drop_points:g}-point limit"
    )
    return Check(layer, metric, candidate, baseline, f"≥ baseline − {max_drop_points:g} points", passed, summary)


def hard_check(layer, metric, candidate, bound, at_most: bool) -> Check:
    passed = candidate <= bound if at_most else candidate >= bound
    op = ("≤" if passed else ">") if at_most else ("≥" if passed else "<")
    summary = f"{metric} {candidate:.4g} {op} {bound:g} {'limit' if at_most else 'minimum'}"
    return Check(layer, metric, candidate, None, f"{'≤' if at_most else '≥'} {bound:g}", passed, summary)


@dataclass
class LayerResult:
    name: str
    status: str  # pass | fail | warn | error | skipped
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    error: str | None = None


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]
    layers: list[LayerResult]
    candidate: str
    baseline: str
    backend: str
    kv_cache_dtype: str | None
    policy: dict
    registry: dict | None = None  # filled in by whoever records the verdict (compress.tracking.record_verdict)
    mlflow_run_id: str | None = None
    files: list[Path] = field(default_factory=list)  # what this gate wrote: gate.json, gate.md, plots

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "files"}

    def metric(self, layer: str, name: str, model: str = "candidate") -> float | None:
        for result in self.layers:
            if result.name == layer and model in result.metrics:
                return result.metrics[model].get(name)
        return None


@dataclass
class Subject:
    """One side of the comparison: where it comes from (a path, a model name or a model in memory), its tokenizer,
    and, while it is loaded, the model and how it generates."""

    label: str
    source: Any
    tokenizer: Any
    kv_cache_dtype: str | None
    model: Any = None
    generator: generation.Generator | None = None

    def load(self, backend: str, engine_options: dict) -> Subject:
        in_memory = not isinstance(self.source, str | Path)
        self.model = self.source.eval() if in_memory else loading.load_for_eval(self.source)[0]
        self.generator = generation.make_generator(
            backend, self.model, self.tokenizer, self.kv_cache_dtype, engine_options
        )
        return self

    def unload(self) -> None:
        """Drop this side's model, generator and KV pool, and hand the freed heap back before the other side loads."""
        self.model = self.generator = None
        release_freed_memory()


@dataclass
class GateContext:
    """What every layer reads, the same for both sides."""

    policy: GatePolicy
    evaluation_texts: list[str]
    evaluation_ids: torch.Tensor
    max_context: int  # the shorter of the two models' contexts: the needle lengths must fit both
    out_dir: Path
    files: list[Path] = field(default_factory=list)


# --- layers: each measures the loaded models it is given, then judges both sides' metrics ---


def measure_perplexity(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.perplexity
    return {
        subject.label: resident_perplexity(
            subject.model,
            context.evaluation_ids,
            policy.seq_len,
            policy.batch_size,
            policy.max_windows,
            label=f"perplexity ({subject.label})",
            progress=False,
        ).to_dict()
        for subject in subjects
    }


def judge_perplexity(context: GateContext, metrics: dict):
    policy = context.policy.perplexity
    candidate, baseline = metrics["candidate"]["perplexity"], metrics["baseline"]["perplexity"]
    metrics["ppl_ratio"] = candidate / baseline
    checks = []
    if policy.max_ratio is not None:
        checks.append(ratio_check("perplexity", "perplexity", candidate, baseline, policy.max_ratio))
    if policy.max_value is not None:
        checks.append(hard_check("perplexity", "perplexity", candidate, policy.max_value, at_most=True))
    return metrics, checks


def measure_lm_eval(context: GateContext, subjects: list[Subject]) -> dict:
    from evals.lm_eval_tasks import LOCAL_TASK, run_lm_eval, write_local_task

    policy = context.policy.lm_eval
    tasks, include_paths = list(policy.tasks), []
    if policy.local_task:
        include_paths.append(write_local_task(context.evaluation_texts, context.out_dir / "lm_eval_tasks"))
        tasks.insert(0, LOCAL_TASK)
    if policy.include_path:
        include_paths.append(Path(policy.include_path).expanduser())
    if not tasks:
        raise CompressError("the lm_eval layer has no tasks: set gate.lm_eval.local_task=true or gate.lm_eval.tasks")
    return {
        subject.label: run_lm_eval(
            subject.model, subject.tokenizer, tasks, include_paths, policy.limit, policy.batch_size, policy.max_length
        )
        for subject in subjects
    }


def judge_lm_eval(context: GateContext, metrics: dict):
    policy = context.policy.lm_eval
    checks = []
    for task, result in metrics["candidate"].items():
        for name, value in result["metrics"].items():
            baseline_value = metrics["baseline"][task]["metrics"][name]
            higher_is_better = result["higher_is_better"].get(name)
            metric = f"{task}/{name}"
            if higher_is_better and policy.max_drop_points is not None:
                checks.append(drop_check("lm_eval", metric, value, baseline_value, policy.max_drop_points))
            elif higher_is_better is False and "perplexity" in name and policy.max_perplexity_ratio is not None:
                checks.append(ratio_check("lm_eval", metric, value, baseline_value, policy.max_perplexity_ratio))
    return metrics, checks


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


def judge_json(context: GateContext, metrics: dict):
    policy = context.policy.json
    checks = []
    for name, max_drop in (
        ("json_validity", policy.max_validity_drop_points),
        ("json_schema_compliance", policy.max_compliance_drop_points),
    ):
        if max_drop is not None:
            checks.append(drop_check("json", name, metrics["candidate"][name], metrics["baseline"][name], max_drop))
    if policy.min_validity is not None:
        checks.append(
            hard_check("json", "json_validity", metrics["candidate"]["json_validity"], policy.min_validity, False)
        )
    return metrics, checks


def measure_needle(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.needle
    lengths = needle.context_lengths(list(policy.context_lengths), context.max_context)
    if not lengths:
        raise CompressError(f"no gate.needle.context_lengths fit the model's context of {context.max_context} tokens")
    filler = context.evaluation_ids.tolist()
    return {
        subject.label: needle.evaluate_needle(
            subject.generator,
            subject.tokenizer,
            filler,
            lengths,
            list(policy.depths),
            policy.trials,
            context.policy.seed,
        )
        for subject in subjects
    }


def judge_needle(context: GateContext, metrics: dict):
    policy = context.policy.needle
    heatmap = needle.plot_heatmaps(metrics, context.out_dir / "needle_heatmap.png")
    context.files.append(heatmap)
    candidate, baseline = metrics["candidate"]["needle_accuracy"], metrics["baseline"]["needle_accuracy"]
    checks = []
    if policy.max_drop_points is not None:
        checks.append(drop_check("needle", "needle_accuracy", candidate, baseline, policy.max_drop_points))
    if policy.min_accuracy is not None:
        checks.append(hard_check("needle", "needle_accuracy", candidate, policy.min_accuracy, at_most=False))
    return metrics, checks


def _latency_prompt(context: GateContext) -> list[int]:
    return context.evaluation_ids[: context.policy.latency.prompt_tokens].tolist()


def measure_latency(context: GateContext, subjects: list[Subject]) -> dict:
    policy = context.policy.latency
    generators = {subject.label: subject.generator for subject in subjects}
    prompt = _latency_prompt(context)
    return latency.measure_latency(generators, prompt, policy.new_tokens, policy.repeats, policy.warmup)


def judge_latency(context: GateContext, metrics: dict):
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
            candidate = metrics["candidate"][f"{name}_p50_ms"]
            baseline = metrics["baseline"][f"{name}_p50_ms"]
            checks.append(ratio_check("latency", f"{name}_p50_ms", candidate, baseline, max_ratio))
    return metrics, checks


LAYERS = {  # name → (measure the loaded models, judge candidate against baseline)
    "perplexity": (measure_perplexity, judge_perplexity),
    "lm_eval": (measure_lm_eval, judge_lm_eval),
    "json": (measure_json, judge_json),
    "needle": (measure_needle, judge_needle),
    "latency": (measure_latency, judge_latency),
}


@dataclass
class LayerRun:
    """One layer's measurements as they come in, one side or both at a time; an exception is kept, never skipped."""

    name: str
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    def measure(self, context: GateContext, subjects: list[Subject]) -> None:
        self._timed(lambda: self.metrics.update(LAYERS[self.name][0](context, subjects)))

    def judge(self, context: GateContext) -> LayerResult:
        verdict: list = []
        self._timed(lambda: verdict.extend(LAYERS[self.name][1](context, self.metrics)))
        if self.error is not None:
            return LayerResult(self.name, "error", self.seconds, error=self.error)
        metrics, checks = verdict
        failed = not all(check.passed for check in checks)
        status = ("fail" if getattr(context.policy, self.name).blocking else "warn") if failed else "pass"
        return LayerResult(self.name, status, self.seconds, metrics, checks)

    def _timed(self, work) -> None:
        if self.error is not None:
            return
        start = time.perf_counter()
        try:
            work()
        except Exception as error:  # fail closed: whatever went wrong, the checkpoint does not ship
            log.error("gate layer %s raised:\n%s", self.name, traceback.format_exc())
            self.error = f"{type(error).__name__}: {error}"
        self.seconds += time.perf_counter() - start


# --- the gate ---


def run_gate(
    candidate,
    baseline,
    policy: dict | None,
    out_dir: Path,
    *,
    evaluation_texts: list[str],
    candidate_tokenizer=None,
    baseline_tokenizer=None,
    candidate_path: Path | None = None,
    candidate_label: str | None = None,
) -> GateResult:
    """Judge ``candidate`` against ``baseline`` (paths, model names or loaded models) on ``evaluation_texts`` (text
    held out from calibration) and write ``gate.json``/``gate.md`` to ``out_dir``. ``candidate_path`` names the
    checkpoint of an in-memory candidate; ``candidate_label`` is how reports name the candidate (default: its path).

    With ``models_in_memory: 1`` (the default) the baseline is loaded, measured on every layer and freed before the
    candidate loads, so the gate never holds both models, their KV pools and the candidate's dense CPU weights at
    once; the candidate then stops at the first blocking failure."""
    resolved = resolve_policy(policy)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if candidate_label is None:
        path_like = isinstance(candidate, str | Path)
        candidate_label = str(candidate) if path_like else str(candidate_path or "<in memory>")
    baseline_label = str(baseline) if isinstance(baseline, str | Path) else "<in memory>"
    result = GateResult(
        passed=False,
        reasons=[],
        layers=[],
        candidate=candidate_label,
        baseline=baseline_label,
        backend="none",
        kv_cache_dtype=None,
        policy=_policy_dict(resolved),
    )
    if not resolved.enabled:
        result.passed, result.reasons = True, ["gate disabled by policy (gate.enabled=false): nothing was checked"]
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
        evaluation_texts, out_dir,
    )  # fmt: skip
    if prepared is not None:
        context, subjects = prepared
        _run_layers(result, context, subjects, selected)
        if not result.reasons and not any(layer.checks for layer in result.layers):
            result.reasons.append(f"no check ran: layers {selected} ran with every limit set to null; set a limit")
        result.passed = not result.reasons
    result.files = [*write_report(result, out_dir), *(prepared[0].files if prepared else [])]
    return result


def _run_layers(result: GateResult, context: GateContext, subjects: dict[str, Subject], selected: list[str]) -> None:
    """Measure and judge each selected layer in order; the first blocking failure skips the layers after it."""
    runs = [LayerRun(name) for name in selected]
    backend, engine_options = result.backend, dict(context.policy.engine)
    candidate, baseline = subjects["candidate"], subjects["baseline"]
    if context.policy.models_in_memory == 1:
        if _loading(result, baseline, backend, engine_options):
            for run in runs:
                log.info("gate: %s (baseline)", run.name)
                run.measure(context, [baseline])
            baseline.unload()
        together = [candidate]
    else:
        together = [candidate, baseline]
    for side in together:
        if not result.reasons:
            _loading(result, side, backend, engine_options)
    for run in runs:
        if result.reasons:  # a blocking failure already decided the verdict: skip the costlier layers
            result.layers.append(LayerResult(run.name, "skipped"))
            continue
        log.info("gate: %s", run.name)
        run.measure(context, together)
        layer = run.judge(context)
        result.layers.append(layer)
        if layer.status == "error":
            result.reasons.append(f"{run.name}: evaluator error (fail closed): {layer.error}")
        elif layer.status == "fail":
            result.reasons += [check.describe() for check in layer.checks if not check.passed]
    for subject in together:
        subject.unload()


def _policy_dict(policy: GatePolicy) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(policy))


def _loading(result: GateResult, subject: Subject, backend: str, engine_options: dict) -> bool:
    """Load one side and its generator; a failure blocks like any evaluator error."""
    try:
        subject.load(backend, engine_options)
    except Exception as error:  # fail closed
        _setup_failed(result, f"load the {subject.label}", error)
        return False
    return True


def _setup_failed(result: GateResult, what: str, error: Exception) -> None:
    """A gate that could not get ready blocks, with the reason, like any evaluator error."""
    log.error("gate could not %s:\n%s", what, traceback.format_exc())
    result.reasons.append(f"setup: evaluator error (fail closed): {type(error).__name__}: {error}")


def _prepare(
    result,
    policy,
    candidate,
    baseline,
    candidate_tokenizer,
    baseline_tokenizer,
    candidate_path,
    evaluation_texts,
    out_dir,
) -> tuple[GateContext, dict[str, Subject]] | None:
    """Both sides described (tokenizer, config, KV dtype) without loading either model, and the evaluation ids; a
    failure here blocks like any evaluator error."""
    try:
        candidate_tokenizer, candidate_config, candidate_dir = loading.describe(
            "candidate", candidate, candidate_tokenizer
        )
        baseline_tokenizer, baseline_config, baseline_dir = loading.describe(
            "baseline", baseline, baseline_tokenizer or candidate_tokenizer
        )
        candidate_dir = candidate_dir or (Path(candidate_path) if candidate_path else None)
        kv_cache_dtype = policy.kv_cache_dtype or loading.kv_cache_dtype_of(candidate_dir)
        result.backend = generation.choose_backend(policy.backend)
        result.kv_cache_dtype = kv_cache_dtype
        subjects = {
            "candidate": Subject("candidate", candidate, candidate_tokenizer, kv_cache_dtype),
            # The baseline keeps its own cache dtype: it is the reference the candidate's KV quantization is judged by.
            "baseline": Subject("baseline", baseline, baseline_tokenizer, loading.kv_cache_dtype_of(baseline_dir)),
        }
        ids = tokenize(candidate_tokenizer, "\n\n".join(evaluation_texts))
        max_context = min(
            getattr(config, "max_position_embeddings", 2048) for config in (candidate_config, baseline_config)
        )
    except Exception as error:  # fail closed
        _setup_failed(result, "prepare its inputs", error)
        return None
    return GateContext(policy, list(evaluation_texts), ids, max_context, out_dir), subjects


GATE_METRICS = {
    ("perplexity", "perplexity"): "ppl",
    ("needle", "needle_accuracy"): "needle_accuracy",
    ("json", "json_validity"): "json_validity",
    ("json", "json_schema_compliance"): "json_schema_compliance",
    ("latency", "ttft_p50_ms"): "ttft_p50_ms",
    ("latency", "tpot_p50_ms"): "tpot_p50_ms",
}


def summary_metrics(result: GateResult) -> dict[str, float]:
    """The metric names the gate logs and ``compress compare`` reads back: all under ``gate.``, so that a run which
    also measured its own perplexity (``ppl_ratio``) keeps both numbers apart."""
    metrics = {"passed": float(result.passed)}
    for (layer, name), key in GATE_METRICS.items():
        candidate, baseline = result.metric(layer, name), result.metric(layer, name, "baseline")
        if key == "ppl":
            if candidate is not None:
                metrics["ppl_candidate"], metrics["ppl_baseline"] = candidate, baseline
                metrics["ppl_ratio"] = candidate / baseline
        elif candidate is not None:
            metrics[key] = candidate
            metrics[f"{key}_baseline"] = baseline
    for layer in result.layers:
        if layer.name == "latency" and layer.status != "error" and layer.metrics:
            metrics["ttft_ratio"], metrics["tpot_ratio"] = layer.metrics["ttft_ratio"], layer.metrics["tpot_ratio"]
    return {f"gate.{key}": value for key, value in metrics.items()}


# --- report ---


def _format(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_report(result: GateResult, out_dir: Path) -> list[Path]:
    """gate.json for machines, gate.md for the reviewer."""
    verdict = "PASSED" if result.passed else "BLOCKED"
    lines = [
        f"# Release gate: {verdict}",
        "",
        f"- candidate: `{result.candidate}`",
        f"- baseline: `{result.baseline}`",
        f"- generation backend: `{result.backend}`"
        + (" (transformers greedy loop; the compress engine was not used)" if result.backend == "transformers" else ""),
        f"- candidate KV cache: `{result.kv_cache_dtype or 'model dtype'}`",
    ]
    if result.registry and "version" in result.registry:
        registry = result.registry
        aliases = ", ".join(registry["aliases"])
        lines.append(f"- registered: `{registry['name']}` version {registry['version']} ({aliases})")
    if result.reasons:
        lines += ["", "## Why", ""] + [f"- {reason}" for reason in result.reasons]
    if result.layers:
        lines += ["", "## Layers", "", "| layer | status | seconds |", "|---|---|---|"]
        lines += [f"| {layer.name} | {layer.status} | {layer.seconds:.1f} |" for layer in result.layers]
    checks = [check for layer in result.layers for check in layer.checks]
    if checks:
        lines += ["", "## Checks", "", "| layer | metric | candidate | baseline | limit | result |"]
        lines.append("|---|---|---|---|---|---|")
        lines += [
            f"| {check.layer} | {check.metric} | {_format(check.candidate)} | {_format(check.baseline)} "
            f"| {check.limit} | {'pass' if check.passed else '**FAIL**'} |"
            for check in checks
        ]
    if (out_dir / "needle_heatmap.png").exists() and any(
        layer.name == "needle" and layer.metrics for layer in result.layers
    ):
        lines += ["", "## Needle in a haystack", "", "![needle accuracy](needle_heatmap.png)"]
    markdown = out_dir / "gate.md"
    markdown.write_text("\n".join(lines) + "\n")
    data = out_dir / "gate.json"
    data.write_text(json.dumps(result.to_dict(), indent=2, default=str))
    return [data, markdown]
