"""``compress run``: load → baseline → compress → save → reload → gate → record, one way only.

The run folder's lifecycle (staging, SIGTERM, crash recovery) is ``compress.app.rundir``, the report's rendering
``compress.app.run_report``, compression itself ``compress.compression.in_memory.compress_model`` (as in ``oneshot``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from compress.app.preflight import preflight
from compress.app.run_config import RunConfig, check_evaluation_length
from compress.app.run_passes import EvaluationText, RunEvaluation, release_gate
from compress.app.run_report import Timer, peak_rss_mb, run_metrics, run_report, write_report
from compress.app.rundir import staged_run_folder
from compress.app.tracking import RunLog, check_writable, flatten, tracking_uri
from compress.base import distributed
from compress.base.data import load_corpus, tokenize
from compress.base.errors import CompressError
from compress.base.memory import release_freed_memory
from compress.base.paths import artifacts_dir
from compress.base.signals import signals_recorded
from compress.compression.in_memory import compress_model
from compress.compression.model_free import goes_model_free, quantize_model_free
from compress.compression.saving import checkpoint_writer, named_summaries, write_checkpoint
from compress.formats.moe_experts import unfuse_experts
from compress.model.calibration_set import calibration_set, generated_windows, spec_for_chain
from compress.model.resume import WalkProgress, open_for_run, run_progress_folder
from compress.model.sources import check_model_source, load, resolve_model_path
from compress.stages import Stage, build_chain, prepare_stages
from compress.stages.rtn import rtn_reference

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    report: dict
    mlflow_run_id: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


def run(config: RunConfig) -> RunResult | None:
    """Execute one recipe end to end; returns the report (also written to the run folder and MLflow). Under torchrun
    only rank 0 does all of it; the other ranks calibrate their shard of the samples and return None."""
    stages = build_chain(config.stages)  # bad stage keys or orders fail here, before anything is loaded
    config.data = spec_for_chain(config.data, stages, config.recipe)
    if config.eval.reference not in (None, "rtn"):
        raise CompressError(f"eval.reference={config.eval.reference!r} is unknown; use rtn or null")
    if config.eval.reference == "rtn":
        rtn_reference(stages)  # fail now, not after the compression, when the recipe has no integer scheme
    device = distributed.select_device(config.device)
    check_model_source(config.model)  # a missing model fails here, before a run folder or MLflow run exists
    distributed.main_first(lambda: resolve_model_path(config.model))  # convert the default model once
    runs_dir = Path(config.output.dir) if config.output.dir else artifacts_dir() / "runs"
    if not distributed.is_main():  # calibrate this rank's shard, nothing else
        torch.manual_seed(config.seed)
        model, _, samples, _, _ = _load(config, stages, Timer(), device)
        progress = open_for_run(config, runs_dir, samples)
        compress_model(model, stages, samples, device, config.calibration_batch_size, progress=progress)
        return None
    uri = tracking_uri(config.tracking.uri) if config.tracking.enabled else None
    if uri is not None:
        check_writable(uri, "set tracking.uri=<a writable store> or tracking.enabled=false")
    preflight(config, stages, runs_dir)
    torch.manual_seed(config.seed)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.output.run_name or config.recipe}-{uuid.uuid4().hex[:6]}"
    final = runs_dir / run_id
    timer, wall_start, run_log = Timer(), time.perf_counter(), None
    tags = {"compress.kind": "run", "compress.recipe": config.recipe, "compress.model": config.model.path}
    with signals_recorded():  # Ctrl-C and SIGTERM, never lost: checked at every phase and before the publish
        try:
            with staged_run_folder(runs_dir, run_id) as staging:
                if uri is not None:  # inside the try: a signal from the run's creation on ends it KILLED
                    run_log = RunLog(uri, config.tracking.experiment, run_id, tags=tags)
                    _describe_run(run_log, config, stages)
                report, evaluation_texts = _execute(config, stages, device, staging, timer, runs_dir)
                report.update(run_id=run_id)
                report["checkpoint"]["path"] = str(final / "checkpoint")
                if config.gate.enabled:
                    with timer.phase("gate"):
                        release_freed_memory()  # what the evaluations freed, before the gate loads its models
                        report["gate"] = release_gate(config, staging, final, run_log, report, evaluation_texts)
                report.update(
                    wall_time_s=time.perf_counter() - wall_start, peak_rss_mb=peak_rss_mb(), timings_s=timer.seconds,
                    peak_rss_rise_mb=timer.peak_rise_mb, peak_gpu_mb=timer.peak_gpu_mb, phase_spans=timer.spans,
                )  # fmt: skip
                write_report(report, staging)
                if run_log is not None:
                    run_log.metrics(run_metrics(report))
                    run_log.tag("compress.run_dir", str(final))
                    for name in ("report.json", "report.md", "checkpoint/recipe.yaml"):
                        run_log.artifact(staging / name)
        except BaseException as error:  # the publish checks for a recorded signal last, before its rename
            if run_log is not None:
                run_log.fail(error)
            raise
        if config.resume:  # published: the walk's progress is no longer needed
            WalkProgress(run_progress_folder(config, runs_dir)).remove()
        if run_log is not None:
            run_log.finish()
    return RunResult(run_id, final, report, run_log.run_id if run_log else None, timer.seconds)


def _load(config: RunConfig, stages: list[Stage], timer: Timer, device: torch.device) -> tuple:
    """``(model, tokenizer, calibration samples, headline evaluation text, in-domain text or None)``, the stages
    prepared on the model; each corpus is read once; windows the model samples are drawn on ``device``."""
    with timer.phase("data"):  # before the model: a bad data source fails in seconds
        corpus = load_corpus(config.data)
        outside = load_corpus(config.eval.data).evaluation if config.eval.data is not None else None
    with timer.phase("load_model"):
        model, tokenizer = load(config.model)
        unfuse_experts(model)  # MoE: the stages check (and the baseline runs) the per-expert form they compress
        prepare_stages(model, stages)  # a model a stage cannot handle fails before the baseline evaluation
    with timer.phase("data"):
        in_domain = _evaluation_text(config, tokenizer, config.data.source, corpus.evaluation, "data")
        headline = in_domain
        if outside is not None:
            headline = _evaluation_text(config, tokenizer, config.eval.data.source, outside, "eval.data")
    with timer.phase("sample"):  # the calibration windows: cut from the text, or sampled by the model on `device`
        samples = calibration_set(model, tokenizer, corpus.calibration_text, config.data, config.seed, device)
    return model, tokenizer, samples, headline, None if headline is in_domain else in_domain


def _evaluation_text(config: RunConfig, tokenizer, source: str, texts: list[str], key: str) -> EvaluationText:
    ids = tokenize(tokenizer, "\n\n".join(texts))
    check_evaluation_length(int(ids.numel()), config, key)
    return EvaluationText(source, texts, ids, in_domain=key == "data")


def _execute_model_free(config: RunConfig, stages: list[Stage], staging: Path, timer: Timer) -> tuple:
    """A data-free chain and no perplexity pass: the checkpoint straight from the safetensors files, no model built
    (``compress.compression.model_free``); the same tensors as the layer walk's."""
    log.info("model-free: %s from the safetensors files, no model built", stages[0].algorithm())
    with timer.phase("data"):  # the texts the gate reads
        texts = load_corpus(config.eval.data or config.data).evaluation
    with timer.phase("compress"):
        result = quantize_model_free(
            Path(resolve_model_path(config.model)), stages, staging / "checkpoint", recipe=config.recipe,
            stage_args=config.stages, dtype=config.model.dtype, save_dtype=config.output.save_dtype,
            extra_files={"config.yaml": yaml.safe_dump(config.raw, sort_keys=False)},
        )  # fmt: skip
    source = (config.eval.data or config.data).source
    data = {"source": config.data.source, "calibration_tokens": 0, "evaluation_tokens": 0, "ranks": 1,
            "evaluation": {"source": source}, "in_domain": None, "model_free": True}  # fmt: skip
    return run_report(config, data, named_summaries(stages, result.stages), result.checkpoint.to_dict()), texts


def _execute(config: RunConfig, stages: list[Stage], device, staging: Path, timer: Timer, runs_dir: Path) -> tuple:
    """``(report, evaluation texts)``."""
    if goes_model_free(config, stages):
        return _execute_model_free(config, stages, staging, timer)
    model, tokenizer, samples, headline, in_domain = _load(config, stages, timer, device)
    passes = RunEvaluation(config, headline, in_domain, device)
    if config.eval.perplexity:
        with timer.phase("eval_baseline"):
            passes.baseline(model)
    with checkpoint_writer(staging / "checkpoint", config.output.save_dtype) as writer:
        with timer.phase("compress"):  # finished layers are written to the checkpoint as the walk goes
            sink, progress = writer.layer_sink(model), open_for_run(config, runs_dir, samples)
            summaries = compress_model(model, stages, samples, device, config.calibration_batch_size, sink, progress)
        with timer.phase("save"):
            extra = {"config.yaml": yaml.safe_dump(config.raw, sort_keys=False)}
            summary = write_checkpoint(
                writer, model, tokenizer, stages, summaries, config.recipe, config.stages, extra, calibration=samples
            )
    del model
    if config.eval.perplexity:
        with timer.phase("eval_candidate"):
            passes.candidate(staging / "checkpoint")
        if config.eval.reference == "rtn":
            with timer.phase("eval_reference"):
                passes.rtn_reference(stages, samples)
    data = {
        "source": config.data.source,
        "calibration_tokens": int(samples.numel()),
        "generated_tokens": generated_windows(config.data) * int(samples.shape[1]),  # sampled from the model itself
        "evaluation_tokens": int(headline.ids.numel()),
        "evaluation": headline.describe(),  # the headline text
        "in_domain": in_domain.describe() if in_domain is not None else None,
        "ranks": distributed.world(),  # data-parallel calibration processes (torchrun)
    }
    report = run_report(config, data, named_summaries(stages, summaries), summary.to_dict(), passes)
    return report, headline.texts


def _describe_run(run_log: RunLog, config: RunConfig, stages: list[Stage]) -> None:
    """The run's parameters, and each stage's metrics sent to it."""
    run_log.params(flatten({k: v for k, v in config.raw.items() if k != "gate"}))
    for stage in stages:
        stage.metrics_sink = run_log.metrics
