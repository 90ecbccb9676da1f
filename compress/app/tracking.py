"""MLflow for runs and release-gate verdicts: where the store is, whether it can be written, one run's logging, orphaned
runs, and registering a checkpoint that passed. MLflow is imported lazily: the engine, kernels and evals never need it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sqlite3
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from compress.base.errors import CompressError, EnvironmentFailure, interruption
from compress.base.paths import artifacts_dir
from compress.base.signals import raise_if_signalled, signals_deferred
from compress.base.staging import process_alive

log = logging.getLogger(__name__)

CANDIDATE_ALIAS, CHAMPION_ALIAS = "candidate", "champion"
PID_TAG, HOST_TAG = "compress.pid", "compress.host"
PARENT_TAG = "mlflow.parentRunId"  # how the MLflow UI nests child runs


def tracking_uri(configured: str | None = None) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a local sqlite store under ``artifacts/``."""
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    try:
        artifacts_dir().mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # check_writable names the problem; this only saves MLflow from failing on a missing folder
    return f"sqlite:///{artifacts_dir() / 'mlflow.db'}"


def _folder_problem(folder: Path) -> str | None:
    """Why nothing can be created in ``folder`` (made if missing), or None; tried for real (root ignores modes)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


def _sqlite_problem(database: Path) -> str | None:
    """Why ``database`` cannot be written (sqlite's own words, e.g. "attempt to write a readonly database")."""
    if database.exists():
        connection = sqlite3.connect(database, timeout=10, isolation_level=None)
        try:  # a write (the header's user_version, rewritten unchanged) inside a transaction that is rolled back
            version = connection.execute("PRAGMA user_version").fetchone()[0]
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(f"PRAGMA user_version = {int(version)}")
            connection.execute("ROLLBACK")
        except sqlite3.DatabaseError as error:
            return str(error)
        finally:
            connection.close()
    return _folder_problem(database.parent)  # sqlite writes its journal beside the database


def local_path(uri: str) -> Path | None:
    """The file or folder behind a ``sqlite:///``, ``file:`` or plain-path URI; None for servers and in-memory."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = unquote(uri.split("://", 1)[1].removeprefix("/"))
        return None if path in ("", ":memory:") else Path(path)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
        return Path(uri)
    return None


def check_writable(uri: str, fix: str) -> None:
    """Fail in milliseconds, in one line, on a local store MLflow cannot write (MLflow itself retries for minutes)."""
    path = local_path(uri)
    if path is None:
        return
    problem = _sqlite_problem(path) if uri.startswith("sqlite:") else _folder_problem(path)
    if problem:
        raise EnvironmentFailure(f"MLflow store {uri}: cannot write ({problem}); {fix}")


def flatten(values, prefix: str = "") -> dict[str, str]:
    """``{"stages.0.bits": "4", ...}``: nested config → MLflow params."""
    items = values.items() if isinstance(values, dict) else enumerate(values)
    flat: dict[str, str] = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, dict | list) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:500]
    return flat


def experiment_id(client, name: str) -> str:
    """Create the experiment with its artifacts under ``artifacts/`` (MLflow would default to ./mlruns)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    from mlflow.exceptions import MlflowException

    location = (artifacts_dir() / "mlflow-artifacts").resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # a run started beside this one created it after our lookup: use theirs
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def mark_orphaned_runs(client, experiment: str) -> list[str]:
    """Runs still RUNNING whose process (recorded in their tags, on this host) is dead were killed: say so.

    SIGKILL, OOM kills and power loss leave no chance to close a run; the next run on the machine closes it instead.
    """
    host = socket.gethostname()
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    runs = client.search_runs(
        [found.experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'"
    )
    orphans = [run for run in runs if not process_alive(int(run.data.tags.get(PID_TAG, "0") or 0))]
    for run in orphans:
        client.set_tag(
            run.info.run_id,
            "compress.error",
            f"process {run.data.tags.get(PID_TAG)} ended without "
            "closing this run (killed); marked KILLED by a later run",
        )
        client.set_terminated(run.info.run_id, status="KILLED")
        log.warning(
            "MLflow run %s was left RUNNING by dead process %s: marked KILLED",
            run.info.run_id,
            run.data.tags.get(PID_TAG),
        )
    return [run.info.run_id for run in orphans]


class RunLog:
    """One MLflow run, opened at the start of the work so that failures are recorded too.

    The run carries its process id and host, so a later run can close it as KILLED if this process dies unannounced.
    """

    def __init__(
        self, uri: str, experiment: str, run_name: str | None, tags: dict[str, str], parent_run_id: str | None = None
    ):
        """``parent_run_id``: nest this run under another (MLflow's ``mlflow.parentRunId`` tag), e.g. a search trial."""
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        mark_orphaned_runs(self.client, experiment)
        tags = {**tags, PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}
        if parent_run_id is not None:
            tags[PARENT_TAG] = parent_run_id
        experiment_key = experiment_id(self.client, experiment)
        with signals_deferred():  # a signal while the run is created is raised below, once the run can be marked
            run = self.client.create_run(experiment_key, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
        try:
            raise_if_signalled()
        except KeyboardInterrupt as stop:
            self.fail(stop)  # KILLED: the caller never gets this object, so it cannot mark the run itself
            raise
        location = local_path(run.info.artifact_uri)
        if location is not None and (problem := _folder_problem(location)):
            self.finish("FAILED")
            raise CompressError(
                f"MLflow artifact store {run.info.artifact_uri}: cannot write ({problem}); "
                "set COMPRESS_ARTIFACTS=<writable folder> or tracking.enabled=false"
            )

    def params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        entries = [Param(key, value[:500]) for key, value in values.items()]
        for start in range(0, len(entries), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=entries[start : start + 100])

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in values.items() if value is not None]
        self.client.log_batch(self.run_id, metrics=entries)

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=folder)

    def finish(self, status: str = "FINISHED") -> None:
        """``FINISHED``, ``FAILED`` or ``KILLED`` (interrupted)."""
        self.client.set_terminated(self.run_id, status=status)

    def fail(self, error: BaseException) -> None:
        """Record why the run ended (KILLED for Ctrl-C and SIGTERM); never hide ``error`` behind a tracking failure."""
        try:
            self.tag("compress.error", (str(error) or type(error).__name__)[:4000])
            self.finish("KILLED" if interruption(error) else "FAILED")
        except Exception as tracking_error:
            log.warning("could not mark MLflow run %s as failed: %s", self.run_id, tracking_error)


def registered_name(baseline_label: str) -> str:
    """Default registry name: compressed variants of one base model are versions of one registered model."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(baseline_label.rstrip("/")).name).strip("-")
    return f"compress-{slug or 'model'}"


def register_checkpoint(run: RunLog, checkpoint: Path, name: str, tags: dict[str, str], promote: bool) -> dict:
    """Log the checkpoint folder into the run and make ``runs:/<run>/checkpoint`` a new model version aliased
    ``candidate`` (and ``champion``): the registry then holds the files, not a path on one machine."""
    from mlflow.exceptions import MlflowException

    run.client.log_artifacts(run.run_id, str(checkpoint), artifact_path="checkpoint")
    try:
        run.client.get_registered_model(name)
    except MlflowException:
        run.client.create_registered_model(name, description="Checkpoints that passed the compress release gate")
    source = f"runs:/{run.run_id}/checkpoint"
    version = run.client.create_model_version(name, source=source, run_id=run.run_id, tags=tags)
    aliases = [CANDIDATE_ALIAS] + ([CHAMPION_ALIAS] if promote else [])
    for alias in aliases:
        run.client.set_registered_model_alias(name, alias, version.version)
    return {"name": name, "version": int(version.version), "aliases": aliases, "source": source}


def record_verdict(run: RunLog, verdict, files: list[Path], checkpoint: Path | None, own_run: bool) -> None:
    """Log a release-gate verdict (``compress.evals.gate.GateResult``) into ``run`` and register the checkpoint on pass.

    Fails closed: a verdict MLflow could not record is not a release, so the verdict turns into a block and the gate's
    report files are rewritten to say why. ``own_run``: the run exists for this verdict alone (``compress gate``),
    so it also takes the policy as params and the checkpoint size.
    """
    from compress.evals.gate import summary_metrics, write_report

    metrics = summary_metrics(verdict)
    if own_run and checkpoint is not None and checkpoint.is_dir():
        metrics["size_mb"] = sum(file.stat().st_size for file in checkpoint.glob("*.safetensors")) / 2**20
    try:
        run.metrics(metrics)
        for key, value in {
            "compress.gate": verdict.verdict,
            "compress.gate.backend": verdict.backend,
        }.items():
            run.tag(key, value)
        if own_run:
            params = {
                "candidate": verdict.candidate,
                "baseline": verdict.baseline,
                "gate.backend": verdict.backend,
                "gate.kv_cache_dtype": str(verdict.kv_cache_dtype),
            }
            run.params({**params, **flatten(verdict.policy, "gate.")})
        for path in files:
            run.artifact(path, "gate")
        registry = verdict.policy["registry"]
        if verdict.passed and registry["register"] and verdict.policy["enabled"]:  # a disabled gate vouches for nothing
            if checkpoint is None:
                verdict.registry = {"skipped": "the candidate was passed in memory without candidate_path"}
            else:
                name = registry["name"] or registered_name(verdict.baseline)
                tags = {key: f"{value:.6g}" for key, value in metrics.items()}
                verdict.registry = register_checkpoint(run, checkpoint, name, tags, registry["promote"])
        verdict.mlflow_run_id = run.run_id
    except Exception as error:  # fail closed
        log.exception("the release gate's verdict could not be recorded in MLflow")
        verdict.fail_closed(f"mlflow: could not record the verdict (fail closed): {type(error).__name__}: {error}")
    write_report(verdict, files[0].parent)
