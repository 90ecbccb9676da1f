"""MLflow logging for runs. MLflow is imported lazily: the engine and kernels never need it."""

from __future__ import annotations

import os
from pathlib import Path

from compress.paths import artifacts_dir


def tracking_uri(configured: str | None = None) -> str:
    """``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a local sqlite store under ``artifacts/``."""
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    artifacts_dir().mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{artifacts_dir() / 'mlflow.db'}"


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
    location = (artifacts_dir() / "mlflow-artifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=location)


class RunLog:
    """One MLflow run, opened at the start of the work so that failures are recorded too."""

    def __init__(self, uri: str, experiment: str, run_name: str, tags: dict[str, str]):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        run = self.client.create_run(experiment_id(self.client, experiment), run_name=run_name, tags=tags)
        self.run_id = run.info.run_id

    def params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        entries = [Param(key, value) for key, value in values.items()]
        for start in range(0, len(entries), 100):
            self.client.log_batch(self.run_id, params=entries[start : start + 100])

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in values.items() if value is not None]
        self.client.log_batch(self.run_id, metrics=entries)

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
