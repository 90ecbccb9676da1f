"""Where the project keeps recipes and artifacts (overridable for tests and shared machines)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # compress/base/paths.py


def artifacts_dir() -> Path:
    """``$COMPRESS_ARTIFACTS`` or ``<repo>/artifacts``: run outputs, converted models, the MLflow store."""
    return Path(os.environ.get("COMPRESS_ARTIFACTS", REPO_ROOT / "artifacts")).resolve()


def data_cache() -> Path:
    """``$COMPRESS_DATA_CACHE`` or ``~/.cache/compress``: public text corpora fetched once per machine, shared by every
    artifacts folder (tests give each test its own artifacts, not its own copy of a corpus)."""
    return Path(os.environ.get("COMPRESS_DATA_CACHE", Path.home() / ".cache" / "compress")).expanduser().resolve()


def recipes_dir() -> Path:
    return Path(os.environ.get("COMPRESS_RECIPES", REPO_ROOT / "recipes")).resolve()
