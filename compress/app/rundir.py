"""The run folder's crash-safe lifecycle: a run writes into a hidden staging folder that becomes
``<runs>/<run-id>`` only when the run succeeds, so a failed or interrupted run never leaves something that looks
like a result.

Ctrl-C and SIGTERM unwind through it (staging removed, MLflow run KILLED by the caller's cleanup;
``compress.base.signals`` makes sure neither is lost); what SIGKILL leaves behind, a staging folder labelled with its
owner's process id, is removed by the next run once that process is gone.
A full disk or a refused write inside the runs folder becomes one line naming the folder and the fix.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compress.base.errors import EnvironmentFailure
from compress.base.staging import make_staging, publish

log = logging.getLogger(__name__)

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


@contextmanager
def staged_run_folder(runs_dir: Path, run_id: str) -> Iterator[Path]:
    """Yield an empty staging folder; rename it to ``runs_dir/run_id`` if the block succeeds, remove it if not."""
    staging = _make_staging(runs_dir, run_id)
    try:
        yield staging
        publish(staging, runs_dir / run_id)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        problem = storage_problem(error, runs_dir)
        if problem is not None:
            where = getattr(error, "filename", None) or runs_dir
            raise EnvironmentFailure(
                f"cannot write {where} ({problem}); free space there or set output.dir=<a writable folder>"
            ) from error
        raise


def _make_staging(runs_dir: Path, run_id: str) -> Path:
    """A hidden folder for this run's outputs, labelled with its owner; stale ones of dead runs are removed first."""
    try:
        return make_staging(runs_dir, run_id)
    except OSError as error:
        raise EnvironmentFailure(
            f"output folder {runs_dir}: cannot write ({error.strerror or error}); set output.dir=<a writable folder>"
        ) from error


def storage_problem(error: BaseException, runs_dir: Path) -> str | None:
    """ "No space left on device" (from an OSError, or in safetensors' Rust I/O error text), or a write refused inside
    the output folder; None for anything else, which keeps its own message."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return os.strerror(error.errno)
    if isinstance(error, OSError) and error.errno in NOT_WRITABLE and error.filename:
        if Path(error.filename).resolve().is_relative_to(runs_dir.resolve()):
            return os.strerror(error.errno)
    return next((os.strerror(code) for code in DISK_FULL if os.strerror(code) in str(error)), None)
