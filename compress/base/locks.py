"""OS file locks between runs on one machine (``fcntl.flock``): a lock dies with the process that holds it, so a
killed run never leaves a lock behind, and a second run that needs the same folder or file waits, saying so in one
line, instead of racing the first (two identical runs share one progress folder and one calibration cache entry).

A lock is a file beside what it guards. Its holder removes it on release, so nothing is left behind; a waiter that
then gets the lock of the removed file sees that the path now names another file (or none) and locks again.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

_held: dict[Path, FileLock] = {}  # the locks this process holds, by path


class FileLock:
    """An exclusive lock on ``path``, held from :meth:`acquire` (or :meth:`try_acquire`) until :meth:`release`."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self.descriptor: int | None = None

    def acquire(self) -> FileLock:
        """Wait for the lock; the first wait says once which lock, and for what, this process waits on. A lock this
        process still holds through another object (left by work that failed in this process) is taken over: waiting
        for it would wait for ourselves."""
        earlier = _held.get(self.path)
        if earlier is not None and earlier is not self:
            earlier.release()
        told = False
        while self.descriptor is None:
            descriptor = self._open()
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    log.warning("waiting for %s: another run on this machine holds %s", self.what, self.path)
                    told = True
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX)  # a signal interrupts the wait (its handler raises)
                except BaseException:
                    os.close(descriptor)
                    raise
            self._keep_if_current(descriptor)
        return self

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; False (without waiting) if another process does."""
        while self.descriptor is None:
            descriptor = self._open()
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                return False
            self._keep_if_current(descriptor)
        return True

    def release(self) -> None:
        """Remove the lock file, then let go of it (in this order: see the module's docstring)."""
        if self.descriptor is None:
            return
        descriptor, self.descriptor = self.descriptor, None
        if _held.get(self.path) is self:
            del _held[self.path]
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(descriptor)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *_) -> None:
        self.release()

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)

    def _keep_if_current(self, descriptor: int) -> None:
        """Keep ``descriptor`` as the lock if ``path`` still names its file; a holder removed it otherwise."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        held = os.fstat(descriptor)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            self.descriptor = descriptor
            _held[self.path] = self
        else:
            os.close(descriptor)


@contextmanager
def file_lock(path: Path, what: str) -> Iterator[FileLock]:
    """Hold the lock ``path`` for the block (``what`` names what it guards in the one line a waiter prints)."""
    lock = FileLock(path, what).acquire()
    try:
        yield lock
    finally:
        lock.release()


def lock_beside(target: Path) -> Path:
    """The lock file of a folder or file: a hidden sibling, so that removing ``target`` keeps its lock."""
    return target.with_name(f".{target.name}.lock")
