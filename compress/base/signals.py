"""Ctrl-C and SIGTERM are never lost: inside :func:`signals_recorded` a handler records each SIGINT / SIGTERM before it
raises, and the run checks the record (:func:`raise_if_signalled`) at every phase boundary and immediately before
the rename that publishes a run folder or a checkpoint. A signal whose exception Python dropped (its handler ran
inside a finalizer, ``__del__`` or a weakref callback, where Python prints the exception and carries on) therefore
still ends the command: 130 for SIGINT, death by SIGTERM (the shell's 143) for SIGTERM, nothing published, the MLflow
run KILLED.

The MLflow run's creation and a publish's rename run with signals deferred (:func:`signals_deferred`): a signal
then is recorded, not raised, so it can neither leave a created run unmarked nor cut a rename in half. A signal
that arrives after the rename finds the run published and whole; the command still ends 130 / 143.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from compress.base.errors import interruption

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C), raised by the recording handler or again at the next check."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it gets Ctrl-C's cleanup: staging removed, MLflow run KILLED."""


_pending: list[int] = []  # signals recorded by the handler since the outermost guard began
_state = {"guards": 0, "deferring": 0}


def stop_for(signum: int) -> KeyboardInterrupt:
    """The exception that a recorded ``signum`` ends a command with."""
    if signum == signal.SIGTERM:
        return Terminated(f"terminated by signal {signum} (SIGTERM)")
    return Interrupted(f"interrupted by signal {signum} (SIGINT, Ctrl-C)")


def raise_if_signalled() -> None:
    """Raise the first signal recorded inside the guard, if any: called at every phase boundary and before a publish,
    it catches a signal whose exception a finalizer dropped."""
    if _pending:
        raise stop_for(_pending[0])


def pending() -> list[int]:
    """The signals recorded so far (a copy)."""
    return list(_pending)


def _handler(signum, frame) -> None:
    if signum == signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    _pending.append(signum)
    if not _state["deferring"]:
        raise stop_for(signum)


def _quiet_about_signals(previous_hook):
    """An unraisable-exception hook that says nothing about a dropped ``Interrupted`` / ``Terminated`` (the user sent
    that signal; :func:`raise_if_signalled` raises it again) and passes anything else on to ``previous_hook``."""

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, (Interrupted, Terminated)):
            previous_hook(unraisable)

    return hook


@contextmanager
def signals_recorded() -> Iterator[None]:
    """Record SIGINT and SIGTERM for the block and raise them as ``Interrupted`` / ``Terminated``; a recorded signal
    not raised by the end of the block is raised there. Afterwards a SIGTERM still kills the process, as asked, when
    nobody else handles SIGTERM. Nested guards are one guard (a search's runs inside the search's)."""
    if threading.current_thread() is not threading.main_thread() or _state["guards"]:
        yield  # only the main thread may set handlers; an outer guard already records
        return
    previous = {signum: signal.signal(signum, _handler) for signum in HANDLED}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_about_signals(previous_hook)
    _state["guards"] += 1
    try:
        yield
        raise_if_signalled()  # lost after the last check, or deferred past a publish: the command still ends by it
    except BaseException as error:
        if not isinstance(interruption(error), Terminated):
            raise
        signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
        if previous[signal.SIGTERM] == signal.SIG_DFL:  # nobody else wants it: die of SIGTERM, without a traceback
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = previous_hook
        _state["guards"] -= 1
        _pending.clear()


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Record, do not raise, signals that arrive during the block; the next :func:`raise_if_signalled` raises them."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
