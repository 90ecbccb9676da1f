"""A SIGTERM whose handler runs inside a finalizer is not lost (seen in CI: raised inside SQLAlchemy's weakref
callback during garbage collection, the ``Terminated`` was printed and dropped, and the run finished with exit 0)."""

import os
import signal
import sys
import time
import weakref

import pytest

from compress.report import Timer
from compress.rundir import Terminated, sigterm_as_interrupt


class _Collected:
    pass


def test_a_sigterm_raised_inside_a_finalizer_stops_the_run_at_the_next_phase(monkeypatch):
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # not SIG_DFL: the context would kill this process
    timer, phases, reported = Timer(), [], []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)  # what Python would print as "Exception ignored"
    try:
        with pytest.raises(Terminated), sigterm_as_interrupt():
            with timer.phase("compress"):
                holder = _Collected()
                weakref.finalize(holder, lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.05)))
                del holder  # the handler runs inside the finalizer, which drops its exception
                phases.append("compress finished")
            with timer.phase("save"):
                phases.append("save")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert phases == ["compress finished"]  # stopped at the boundary, not published
    assert reported == []  # the user sees no traceback for a SIGTERM they sent
    with timer.phase("later"):  # handled: a later run in this process is not stopped by it
        pass
