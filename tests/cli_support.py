"""What the tests that drive the real CLI in a subprocess share: its environment and the MLflow store's run statuses
read straight from sqlite (the process under test owns the store)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cli_env(artifacts: Path) -> dict[str, str]:
    env = {**os.environ, "COMPRESS_ARTIFACTS": str(artifacts), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_statuses(database: Path) -> list[str]:
    try:
        connection = sqlite3.connect(database, timeout=1)
        try:
            return [status for (status,) in connection.execute("SELECT status FROM runs")]
        finally:
            connection.close()
    except sqlite3.Error:
        return []
