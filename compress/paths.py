"""Where the project keeps recipes and artifacts (overridable for tests and shared machines)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def artifacts_dir() -> Path:
    """``$COMPRESS_ARTIFACTS`` or ``<repo>/artifacts``: run outputs, converted models, the MLflow store."""
    return Path(os.environ.get("COMPRESS_ARTIFACTS", REPO_ROOT / "artifacts")).resolve()


def recipes_dir() -> Path:
    return Path(os.environ.get("COMPRESS_RECIPES", REPO_ROOT / "recipes")).resolve()
