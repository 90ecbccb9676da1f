"""MLflow for the gate: where the store is, logging a verdict, and registering a checkpoint that passed."""

from __future__ import annotations

import re
import time
from pathlib import Path

from compress.tracking import experiment_id, tracking_uri

EXPERIMENT = "compress"
CANDIDATE_ALIAS, CHAMPION_ALIAS = "candidate", "champion"


def client():
    """A client on the project's store (``compress.tracking.tracking_uri``) for tracking and the registry."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def log_gate(
    metrics: dict[str, float], params: dict[str, str], tags: dict[str, str], files: list[Path],
    run_id: str | None, experiment: str = EXPERIMENT,
) -> str:
    """Log into ``run_id`` (the pipeline's run) or a new ``compress.kind=gate`` run; returns the run id."""
    from mlflow.entities import Metric, Param, RunTag

    tracking = client()
    owns_run = run_id is None
    if owns_run:
        run_id = tracking.create_run(experiment_id(tracking, experiment), tags={"compress.kind": "gate"}).info.run_id
    now = int(time.time() * 1000)
    tracking.log_batch(
        run_id,
        metrics=[Metric(key, float(value), now, 0) for key, value in metrics.items()],
        tags=[RunTag(key, value) for key, value in tags.items()],
    )
    if owns_run:  # a pipeline run already holds its config; MLflow takes at most 100 params per batch
        entries = [Param(key, value[:500]) for key, value in params.items()]
        for start in range(0, len(entries), 100):
            tracking.log_batch(run_id, params=entries[start : start + 100])
    for path in files:
        tracking.log_artifact(run_id, str(path), artifact_path="gate")
    if owns_run:
        tracking.set_terminated(run_id)
    return run_id


def registered_name(baseline_label: str) -> str:
    """Default registry name: compressed variants of one base model are versions of one registered model."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(baseline_label.rstrip("/")).name).strip("-")
    return f"compress-{slug or 'model'}"


def register_checkpoint(
    checkpoint: Path, name: str, run_id: str, tags: dict[str, str], promote: bool
) -> dict:
    """A new model version whose source is the checkpoint folder, aliased ``candidate`` (and ``champion``)."""
    from mlflow.exceptions import MlflowException

    tracking = client()
    try:
        tracking.get_registered_model(name)
    except MlflowException:
        tracking.create_registered_model(name, description="Checkpoints that passed the compress release gate")
    version = tracking.create_model_version(name, source=str(checkpoint.resolve()), run_id=run_id, tags=tags)
    aliases = [CANDIDATE_ALIAS] + ([CHAMPION_ALIAS] if promote else [])
    for alias in aliases:
        tracking.set_registered_model_alias(name, alias, version.version)
    return {"name": name, "version": int(version.version), "aliases": aliases}
