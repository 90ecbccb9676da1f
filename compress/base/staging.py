"""Outputs are staged in a hidden sibling folder, labelled with the process that writes it, flushed to disk and renamed
into place last: a finished name is always whole, and what a kill leaves behind is found and swept by the next writer
to the same place. Used by the run folder and by every checkpoint (runs, ``oneshot``, search trials)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from compress.base.signals import raise_if_signalled, signals_deferred

log = logging.getLogger(__name__)

STAGING_OWNER = "owner.json"  # {"pid", "host"} of the process a staging folder belongs to


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def make_staging(parent: Path, name: str) -> Path:
    """An empty hidden folder ``parent/.<name>-XXXX`` labelled with this process; stale ones are swept first."""
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_staging(parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=parent))
    (staging / STAGING_OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    return staging


def sweep_stale_staging(parent: Path) -> list[Path]:
    """Remove staging folders whose owner process (on this host) is gone: what SIGKILL, an OOM kill or a power loss
    left behind. Folders of live processes, of other hosts, and without an owner label are left alone."""
    removed = []
    for label in parent.glob(f".*/{STAGING_OWNER}"):
        try:
            owner = json.loads(label.read_text())
        except (OSError, ValueError):
            continue
        if owner.get("host") == socket.gethostname() and not process_alive(int(owner.get("pid", 0))):
            shutil.rmtree(label.parent, ignore_errors=True)
            log.warning("removed %s: staging folder of process %s, which is gone", label.parent, owner["pid"])
            removed.append(label.parent)
    return removed


def publish(staging: Path, target: Path) -> None:
    """Drop the owner label, flush every file and the folder to disk, then rename ``staging`` to ``target``: after a
    crash or a power cut ``target`` is either absent or whole, never a name with empty files behind it. A recorded
    signal (``compress.base.signals``) stops it before the rename."""
    (staging / STAGING_OWNER).unlink(missing_ok=True)
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())
    _fsync_folder(staging)
    with signals_deferred():  # the last check, then a rename that no signal cuts short
        raise_if_signalled()  # a Ctrl-C or SIGTERM that a finalizer swallowed: nothing is published
        os.replace(staging, target)
    _fsync_folder(target.parent)  # the rename itself


def write_file_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """One file's ``publish``: ``write(temporary)`` beside ``path``, flushed to disk, then renamed over it. A kill, a
    full disk or a failed write leaves the old file whole (or none), never a torn one, and no temporary behind."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        with temporary.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
