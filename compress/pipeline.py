"""``compress run``: model → calibration → stages → checkpoint → evaluation → report and MLflow, one way only.

Everything a run writes goes to a hidden staging folder that is renamed to ``artifacts/runs/<run-id>`` only when the
run succeeds (release gate included), so a failed or interrupted run never leaves something that looks like a result.
SIGTERM is handled like Ctrl-C (staging removed, MLflow run KILLED); what SIGKILL leaves behind, a staging folder and a
RUNNING MLflow run, carries the owner's process id and is cleaned up by the next run once that process is gone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from compress.calibration import restore_dtypes, upcast
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression import apply_stages
from compress.config import RunConfig, check_evaluation_length
from compress.data import calibration_samples, load_corpus, tokenize
from compress.errors import CompressError
from compress.models import check_model_source, load_model, materialize_all, resolve_model_path
from compress.paths import artifacts_dir
from compress.stages import Stage, build_chain
from compress.stages.rtn import RTNConfig, RTNStage
from compress.tracking import RunLog, check_writable, flatten, process_alive, record_verdict, tracking_uri
from evals.perplexity import PerplexityResult, perplexity

log = logging.getLogger(__name__)

STAGING_OWNER = "owner.json"  # {"pid", "host"} of the process a staging folder belongs to
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    report: dict
    mlflow_run_id: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CompressError(f"device={name} asked for, but no CUDA GPU is visible; use device=cpu")
    return torch.device(name)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def _evaluate(model, eval_ids: torch.Tensor, config: RunConfig, label: str, device: torch.device) -> PerplexityResult:
    """Perplexity with every layer loaded. On CPU a 16-bit model computes in fp32, as every run did before models
    loaded in their source dtype, so CPU numbers stay comparable. Measured on the default model (16 windows of 512,
    2-core EPYC with avx512_bf16): bf16 compute moved perplexity +0.10% (17.332 vs 17.315 fp32) while bf16 storage
    with fp32 compute moved it -0.03% (17.311); bf16 compute was faster there (134 s vs 194 s), not worth the drift.
    On a GPU the model runs in its own dtype."""
    materialize_all(model)
    model.to(device)
    stored_dtypes = upcast(model) if device.type == "cpu" else {}
    try:
        return perplexity(
            model, eval_ids, config.eval.seq_len, config.eval.batch_size, config.eval.max_windows, label=label
        )
    except FloatingPointError as error:
        raise CompressError(str(error)) from error
    finally:
        restore_dtypes(model, stored_dtypes)
        model.to("cpu")


def _rtn_reference(stages: list[Stage]) -> RTNStage:
    quantizer = next((s for s in stages if s.quantizes_weights), None)
    if quantizer is None or not all(hasattr(quantizer.config, k) for k in ("bits", "group_size", "symmetric")):
        raise CompressError(
            "eval.reference=rtn needs an integer weight quantizer in the recipe (awq, gptq, rtn) to copy its scheme; "
            "set eval.reference=null"
        )
    c = quantizer.config
    return RTNStage(RTNConfig(bits=c.bits, group_size=c.group_size, symmetric=c.symmetric, ignore=list(c.ignore)))


def _run_id(config: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{config.output.run_name or config.recipe}-{uuid.uuid4().hex[:6]}"


def run(config: RunConfig) -> RunResult:
    """Execute one recipe end to end; returns the report (also written to the run folder and MLflow)."""
    stages = build_chain(config.stages)  # bad stage keys or orders fail here, before anything is loaded
    if config.eval.reference not in (None, "rtn"):
        raise CompressError(f"eval.reference={config.eval.reference!r} is unknown; use rtn or null")
    if config.eval.reference == "rtn":
        _rtn_reference(stages)  # fail now, not after the compression, when the recipe has no integer scheme
    save_dtype = getattr(torch, config.output.save_dtype) if config.output.save_dtype else None
    device = select_device(config.device)
    check_model_source(config.model)  # a missing model fails here, before a run folder or MLflow run exists
    uri = tracking_uri(config.tracking.uri) if config.tracking.enabled else None
    if uri is not None:
        check_writable(uri, "set tracking.uri=<a writable store> or tracking.enabled=false")
    torch.manual_seed(config.seed)
    run_id = _run_id(config)
    runs_dir = Path(config.output.dir) if config.output.dir else artifacts_dir() / "runs"
    final = runs_dir / run_id
    with _sigterm_as_interrupt():
        staging = _make_staging(runs_dir, run_id)
        run_log = None
        timer = Timer()
        wall_start = time.perf_counter()
        try:
            if uri is not None:
                run_log = _open_run_log(config, uri, run_id, stages)
            report = _execute(config, stages, device, staging, save_dtype, timer)
            report.update(run_id=run_id, wall_time_s=time.perf_counter() - wall_start, peak_rss_mb=peak_rss_mb())
            report["checkpoint"]["path"] = str(final / "checkpoint")
            if config.gate.get("enabled", True):
                with timer.phase("gate"):
                    report["gate"] = _gate(config, staging, final, run_log)
            report["timings_s"] = timer.seconds
            _write_report(report, staging)
            if run_log is not None:
                run_log.metrics(_metrics(report))
                run_log.tag("compress.run_dir", str(final))
                for name in ("report.json", "report.md", "checkpoint/recipe.yaml"):
                    run_log.artifact(staging / name)
            (staging / STAGING_OWNER).unlink()
            os.replace(staging, final)
            if run_log is not None:
                run_log.finish()
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            _close_failed_run(run_log, error)
            problem = _storage_problem(error, runs_dir)
            if problem is not None:
                where = getattr(error, "filename", None) or runs_dir
                raise CompressError(
                    f"cannot write {where} ({problem}); free space there or set output.dir=<a writable folder>"
                ) from error
            raise
    return RunResult(run_id, final, report, run_log.run_id if run_log else None, timer.seconds)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it gets Ctrl-C's cleanup: staging removed, MLflow run KILLED."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into ``Terminated`` for the block; afterwards the process still dies of SIGTERM as asked."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
        raise Terminated(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, previous)
        if previous == signal.SIG_DFL:  # nobody else wants it: exit as killed by SIGTERM, without a traceback
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _make_staging(runs_dir: Path, run_id: str) -> Path:
    """A hidden folder for this run's outputs, labelled with its owner; stale ones of dead runs are removed first."""
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        sweep_stale_staging(runs_dir)
        staging = Path(tempfile.mkdtemp(prefix=f".{run_id}-", dir=runs_dir))
        owner = {"pid": os.getpid(), "host": socket.gethostname()}
        (staging / STAGING_OWNER).write_text(json.dumps(owner))
    except OSError as error:
        raise CompressError(
            f"output folder {runs_dir}: cannot write ({error.strerror or error}); set output.dir=<a writable folder>"
        ) from error
    return staging


def sweep_stale_staging(runs_dir: Path) -> list[Path]:
    """Remove staging folders whose owner process (on this host) is gone: what SIGKILL, an OOM kill or a power loss
    left behind. Folders of live runs, of other hosts, and without an owner label are left alone."""
    removed = []
    for label in runs_dir.glob(f".*/{STAGING_OWNER}"):
        try:
            owner = json.loads(label.read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") == socket.gethostname() and not process_alive(int(owner.get("pid", 0))):
            shutil.rmtree(label.parent, ignore_errors=True)
            log.warning("removed %s: staging folder of run process %s, which is gone", label.parent, owner["pid"])
            removed.append(label.parent)
    return removed


def _open_run_log(config: RunConfig, uri: str, run_id: str, stages: list[Stage]) -> RunLog:
    run_log = RunLog(
        uri,
        config.tracking.experiment,
        run_id,
        tags={"compress.kind": "run", "compress.recipe": config.recipe, "compress.model": config.model.path},
    )
    run_log.params(flatten({k: v for k, v in config.raw.items() if k != "gate"}))
    for stage in stages:
        stage.metrics_sink = run_log.metrics
    return run_log


def _close_failed_run(run_log: RunLog | None, error: BaseException) -> None:
    """Record why the run ended (KILLED for Ctrl-C and SIGTERM); never hide ``error`` behind a tracking failure."""
    if run_log is None:
        return
    try:
        run_log.tag("compress.error", (str(error) or type(error).__name__)[:4000])
        run_log.finish("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
    except Exception as tracking_error:
        log.warning("could not mark MLflow run %s as failed: %s", run_log.run_id, tracking_error)


def _storage_problem(error: BaseException, runs_dir: Path) -> str | None:
    """ "No space left on device" (from an OSError, or in safetensors' Rust I/O error text), or a write refused inside
    the output folder; None for anything else, which keeps its own message."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return os.strerror(error.errno)
    if isinstance(error, OSError) and error.errno in NOT_WRITABLE and error.filename:
        if Path(error.filename).resolve().is_relative_to(runs_dir.resolve()):
            return os.strerror(error.errno)
    return next((os.strerror(code) for code in DISK_FULL if os.strerror(code) in str(error)), None)


def _execute(config, stages, device, staging: Path, save_dtype, timer: Timer) -> dict:
    with timer.phase("data"):
        corpus = load_corpus(config.data)  # before the model: a bad data source fails in seconds
    with timer.phase("load_model"):
        model, tokenizer = load_model(config.model, layerwise=True)
        for stage in stages:
            stage.prepare(model)
    with timer.phase("data"):
        calibration_ids = tokenize(tokenizer, corpus.calibration_text)
        eval_ids = tokenize(tokenizer, corpus.evaluation_text)
        check_evaluation_length(int(eval_ids.numel()), config)
        samples = calibration_samples(calibration_ids, config.data.num_samples, config.data.seq_len, config.seed)
    results: dict[str, PerplexityResult] = {}
    if config.eval.perplexity:
        with timer.phase("eval_baseline"):
            results["baseline"] = _evaluate(model, eval_ids, config, "perplexity [baseline]", device)
    with timer.phase("compress"):
        apply_stages(model, stages, samples, device, config.calibration_batch_size)
        summaries = {
            f"{i}:{stage.name}": {**stage.finalize(model), "seconds": stage.seconds} for i, stage in enumerate(stages)
        }
    with timer.phase("save"):
        recipe_yaml = yaml.safe_dump({"recipe": config.recipe, "stages": config.stages}, sort_keys=False)
        kv_cache_scheme = next((s.kv_cache_scheme for s in stages if s.quantizes_kv_cache), None)
        summary = save_checkpoint(
            model,
            tokenizer,
            staging / "checkpoint",
            dtype=save_dtype,
            kv_cache_scheme=kv_cache_scheme,
            extra_files={
                "recipe.yaml": recipe_yaml,
                "config.yaml": yaml.safe_dump(config.raw, sort_keys=False),
            },
        )
        (staging / "checkpoint" / "size.json").write_text(json.dumps(summary.to_dict(), indent=2))
    del model
    if config.eval.perplexity:
        with timer.phase("eval_candidate"):
            candidate, _ = load_checkpoint(staging / "checkpoint")
            results["candidate"] = _evaluate(candidate, eval_ids, config, f"perplexity [{config.recipe}]", device)
            del candidate
        if config.eval.reference == "rtn":
            with timer.phase("eval_reference"):
                reference_model, _ = load_model(config.model, layerwise=True)
                rtn = _rtn_reference(stages)
                rtn.prepare(reference_model)
                apply_stages(reference_model, [rtn], samples, device, config.calibration_batch_size)
                results["rtn_reference"] = _evaluate(reference_model, eval_ids, config, "perplexity [rtn]", device)
    return {
        "recipe": config.recipe,
        "model": config.model.path,
        "data": {
            "source": config.data.source,
            "calibration_tokens": int(samples.numel()),
            "evaluation_tokens": int(eval_ids.numel()),
        },
        "stages": summaries,
        "perplexity": {name: result.to_dict() for name, result in results.items()},
        "checkpoint": summary.to_dict(),
    }


def _gate(config: RunConfig, staging: Path, final: Path, run_log: RunLog | None) -> dict:
    """The release gate on the saved checkpoint against the original model; its verdict is recorded in this run's
    MLflow store (the same ``tracking.uri``) and a pass registers ``runs:/<run>/checkpoint``."""
    from evals.gate import run_gate

    verdict = run_gate(
        staging / "checkpoint",
        resolve_model_path(config.model),
        config.gate,
        staging / "gate",
        evaluation_texts=load_corpus(config.data).evaluation,
        candidate_label=str(final / "checkpoint"),
    )
    if run_log is not None:
        record_verdict(run_log, verdict, verdict.files, staging / "checkpoint", own_run=False)
    return {
        "passed": verdict.passed,
        "reasons": verdict.reasons,
        "report": str(final / "gate" / "gate.md"),
        "registry": verdict.registry,
    }


def _metrics(report: dict) -> dict[str, float]:
    ppl = report["perplexity"]
    metrics = {
        "size_mb": report["checkpoint"]["size_mb"],
        "bits_per_weight": report["checkpoint"]["bits_per_weight"],
        "wall_time_s": report["wall_time_s"],
        "peak_rss_mb": report["peak_rss_mb"],
    }
    if "baseline" in ppl and "candidate" in ppl:
        metrics.update(
            ppl_baseline=ppl["baseline"]["perplexity"],
            ppl_candidate=ppl["candidate"]["perplexity"],
            ppl_ratio=ppl["candidate"]["perplexity"] / ppl["baseline"]["perplexity"],
        )
    if "rtn_reference" in ppl:
        metrics["ppl_rtn_reference"] = ppl["rtn_reference"]["perplexity"]
    return metrics


def summary_lines(report: dict) -> list[str]:
    """The one-screen summary printed at the end of a run and written as report.md."""
    ckpt = report["checkpoint"]
    lines = [
        f"# compress run {report['run_id']}",
        "",
        f"recipe `{report['recipe']}` on model `{report['model']}`; "
        f"{report['data']['calibration_tokens']} calibration tokens, {report['data']['evaluation_tokens']} "
        f"evaluation tokens ({report['data']['source']})",
        "",
        "| model | perplexity | vs baseline |",
        "|---|---|---|",
    ]
    ppl = report["perplexity"]
    base = ppl.get("baseline", {}).get("perplexity")
    for name, result in ppl.items():
        ratio = f"{result['perplexity'] / base:.4f}×" if base else "n/a"
        lines.append(f"| {name} | {result['perplexity']:.4f} | {ratio} |")
    lines += [
        "",
        f"checkpoint: {ckpt['size_mb']:.1f} MB, {ckpt['quantized_linears']} quantized linears at "
        f"{ckpt['bits_per_weight']:.2f} stored bits/weight",
        *(gate_lines(report["gate"]) if "gate" in report else []),
        f"wall time {report['wall_time_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MB; phases: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in report["timings_s"].items()),
    ]
    return lines


def gate_lines(gate: dict) -> list[str]:
    """``release gate: BLOCKED — perplexity +23.5% > 5% limit``, then any further reasons, then the report's path."""
    if gate["passed"]:
        return [f"release gate: PASSED (details: {gate['report']})"]
    first, *others = gate["reasons"]
    return [f"release gate: BLOCKED — {first}", *(f"  - {reason}" for reason in others), f"  details: {gate['report']}"]


def _write_report(report: dict, folder: Path) -> None:
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    (folder / "report.md").write_text("\n".join(summary_lines(report)) + "\n")
