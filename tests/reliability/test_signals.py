"""Ctrl-C and SIGTERM are never lost (``compress.base.signals``). The signal is delivered at each phase boundary of a
real run, inside a finalizer, where Python prints the handler's exception and carries on: the run still ends with 130 /
143, its MLflow run KILLED and nothing published. Seen before the fix: a Ctrl-C during the candidate's evaluation ended
the run with exit 0 and a published run folder, stderr closing in ``KeyboardInterrupt:``."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_support import REPO, cli_env, run_statuses

from compress.app.run_report import Timer
from compress.base.signals import Interrupted, Terminated, pending, signals_recorded
from compress.base.staging import STAGING_OWNER, make_staging, publish
from compress.commands.run import main as run_main
from tests.reliability.faults import injected

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=2", "stages.0.group_size=32"]
RUN_PHASES = ["data", "load_model", "eval_baseline", "compress", "save", "eval_candidate", "publish"]
PLACES = {"publish": "before the run folder's rename"}  # where a phase's name alone does not say
KILLED_130 = "exit 130, nothing published, no staging left, MLflow `KILLED`"
KILLED_143 = "exit 143, nothing published, MLflow `KILLED`"
dropped: list[int] = []  # signals whose exception was raised inside a finalizer (and dropped there by Python)


class SignalsWhenCollected:
    """An object whose finalizer sends ``signum`` to this process; the handler runs inside ``__del__``."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self) -> None:
        try:
            signal.raise_signal(self.signum)  # the handler runs before raise_signal returns
        except KeyboardInterrupt:
            dropped.append(self.signum)
            raise  # into the finalizer's caller: Python prints it (unraisable hook) and carries on


def signal_inside_a_finalizer(signum: int) -> None:
    SignalsWhenCollected(signum)  # collected at once


@pytest.fixture
def sigterm_handled(monkeypatch):
    """A SIGTERM handler other than the default, so that a guard re-raising SIGTERM does not kill pytest."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(autouse=True)
def fresh_record():
    dropped.clear()
    yield
    assert pending() == []  # the guard forgets what it handled


@contextmanager
def signal_at(monkeypatch, phase: str, signum: int) -> Iterator[None]:
    """Deliver ``signum`` inside a finalizer in the middle of ``phase`` (a ``Timer`` phase of the run, or
    ``publish``: after the run folder's files are flushed, right before its rename)."""
    if phase == "publish":
        import compress.base.staging as staging

        flush = staging._fsync_folder

        def flush_then_signal(folder: Path) -> None:
            flush(folder)
            if folder.name.startswith(".") and (folder / "report.json").is_file():  # the run folder, not a checkpoint
                signal_inside_a_finalizer(signum)

        monkeypatch.setattr(staging, "_fsync_folder", flush_then_signal)
    else:
        original = Timer.phase

        @contextmanager
        def phase_with_signal(self, name: str):
            with original(self, name):
                if name == phase:
                    signal_inside_a_finalizer(signum)
                yield

        monkeypatch.setattr(Timer, "phase", phase_with_signal)
    yield


def published(runs: Path) -> list[Path]:
    return [folder for folder in runs.iterdir() if not folder.name.startswith(".")] if runs.exists() else []


@pytest.mark.parametrize("phase", RUN_PHASES)
def test_a_ctrl_c_swallowed_by_a_finalizer_at_each_phase_ends_the_run_killed(
    phase, tiny_model_dir, artifacts, default_mlflow_store, monkeypatch
):
    args = ["recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none"]
    with signal_at(monkeypatch, phase, signal.SIGINT):
        code = run_main(args)
    assert dropped == [signal.SIGINT]  # the handler's exception was raised inside the finalizer and dropped there
    assert code == 130
    runs = artifacts / "runs"
    assert published(runs) == [] and not any(runs.glob(f".*/{STAGING_OWNER}"))
    assert run_statuses(default_mlflow_store) == ["KILLED"]
    injected("SIGINT raised inside a finalizer", PLACES.get(phase, phase), "nothing lost", KILLED_130)


@pytest.mark.parametrize("phase", ["compress", "publish"])
def test_a_sigterm_swallowed_by_a_finalizer_ends_the_run_killed(
    phase, tiny_model_dir, artifacts, default_mlflow_store, monkeypatch, sigterm_handled
):
    args = ["recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none"]
    with signal_at(monkeypatch, phase, signal.SIGTERM):
        code = run_main(args)
    assert dropped == [signal.SIGTERM]
    assert code == 143
    assert published(artifacts / "runs") == []
    assert run_statuses(default_mlflow_store) == ["KILLED"]
    injected("SIGTERM raised inside a finalizer", PLACES.get(phase, phase), "nothing lost", KILLED_143)


def test_a_signal_while_the_mlflow_run_is_created_ends_it_killed(
    tiny_model_dir, artifacts, default_mlflow_store, monkeypatch
):
    """The run exists from ``create_run`` on; a signal then must still find it to mark (the window the issue saw)."""
    from mlflow.tracking import MlflowClient

    create = MlflowClient.create_run

    def create_during_a_signal(self, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # deferred: recorded, raised once the run can be marked
        return create(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", create_during_a_signal)
    assert run_main(["recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none"]) == 130
    assert run_statuses(default_mlflow_store) == ["KILLED"]
    assert published(artifacts / "runs") == []
    injected("SIGINT while the MLflow run is created", "`run`", "nothing lost", "exit 130, that run `KILLED`")


def test_the_gate_command_opens_its_mlflow_run_inside_its_guard(tiny_model_dir, artifacts, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    from compress.commands.gate import main as gate_main

    artifacts.mkdir(parents=True, exist_ok=True)
    create = MlflowClient.create_run

    def create_during_a_signal(self, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return create(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_run", create_during_a_signal)
    gate = ["gate=quick", "gate.backend=transformers", "gate.layers=[perplexity]", f"out={tmp_path / 'gate'}"]
    assert gate_main([f"checkpoint={tiny_model_dir}", f"baseline={tiny_model_dir}", *gate]) == 130
    assert run_statuses(artifacts / "mlflow.db") == ["KILLED"]
    assert not (tmp_path / "gate" / "gate.json").exists()
    detail = "exit 130, that run `KILLED`, no verdict"
    injected("SIGINT while the MLflow run is created", "`gate`", "nothing lost", detail)


@pytest.mark.parametrize("signum, stop", [(signal.SIGINT, Interrupted), (signal.SIGTERM, Terminated)])
def test_a_signal_dropped_by_a_finalizer_stops_at_the_next_phase_quietly(signum, stop, monkeypatch, sigterm_handled):
    timer, phases, reported = Timer(), [], []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)  # what Python would print as "Exception ignored"
    with pytest.raises(stop), signals_recorded():
        with timer.phase("compress"):
            signal_inside_a_finalizer(signum)
            phases.append("compress finished")
        with timer.phase("save"):
            phases.append("save")
    assert dropped == [signum] and phases == ["compress finished"]  # stopped at the boundary
    assert reported == []  # the user sees no traceback for a signal they sent
    with timer.phase("later"):  # handled: a later run in this process is not stopped by it
        pass
    detail = "stopped at the next phase boundary, no `Exception ignored` print"
    sigint = signum == signal.SIGINT
    injected("SIGINT dropped by a finalizer" if sigint else "SIGTERM dropped by a finalizer", "between two phases",
             "nothing lost", detail)  # fmt: skip


def test_a_signal_dropped_before_the_rename_publishes_nothing(tmp_path):
    staging = make_staging(tmp_path, "checkpoint")
    (staging / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(Interrupted), signals_recorded():
        signal_inside_a_finalizer(signal.SIGINT)
        publish(staging, tmp_path / "checkpoint")
    assert dropped == [signal.SIGINT]
    assert not (tmp_path / "checkpoint").exists()
    injected("SIGINT dropped by a finalizer", "`publish`, before its rename", "nothing lost", "nothing published")


def test_a_signal_after_the_rename_still_ends_the_command(tmp_path):
    """Too late to cancel: the folder is published whole, and the signal is not lost either."""
    staging = make_staging(tmp_path, "checkpoint")
    with pytest.raises(Interrupted), signals_recorded():
        publish(staging, tmp_path / "checkpoint")
        signal_inside_a_finalizer(signal.SIGINT)
    assert (tmp_path / "checkpoint").is_dir()
    detail = "published whole, the signal still raised"
    injected("SIGINT dropped by a finalizer", "`publish`, after its rename", "nothing lost", detail)


CTRL_C_IN_A_FINALIZER = """
import signal, sys
from contextlib import contextmanager
from compress.app.run_report import Timer

class SignalsWhenCollected:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)

original = Timer.phase

@contextmanager
def phase(self, name):
    with original(self, name):
        if name == "eval_candidate":
            SignalsWhenCollected()
        yield

Timer.phase = phase
from compress.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_process_whose_ctrl_c_lands_in_a_finalizer_exits_130(tiny_model_dir, tmp_path, empty_mlflow_db):
    """The issue's case in a real process: the Ctrl-C lands inside a finalizer during the candidate's evaluation."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copy(empty_mlflow_db, artifacts / "mlflow.db")
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none"]
    command = [sys.executable, "-c", CTRL_C_IN_A_FINALIZER, *args]
    env = cli_env(artifacts)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)  # no deadline: see wait_for
    assert done.returncode == 130, done.stderr[-3000:]
    assert "interrupted by signal" in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert published(artifacts / "runs") == []
    assert run_statuses(artifacts / "mlflow.db") == ["KILLED"]
    detail = "exit 130 (was 0 and a published run), one `interrupted:` line, no traceback, `KILLED`"
    injected("SIGINT inside a finalizer, real process", "eval_candidate", "nothing lost", detail)
