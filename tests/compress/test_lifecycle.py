"""A run's lifecycle off the happy path, through the real CLI on the tiny model with a real MLflow sqlite store:
SIGTERM, what SIGKILL leaves behind, the gate's verdict in the run's own store, and storage that cannot be written
(real read-only and full file systems: tmpfs mounts in a user namespace, skipped where the kernel allows none)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import REPO, cli_env, run_statuses

from compress.__main__ import main
from compress.app.tracking import HOST_TAG, PID_TAG, RunLog, experiment_id
from compress.base.locks import FileLock, lock_beside
from compress.base.staging import STAGING_OWNER, sweep_stale_staging
from compress.model.resume import progress_folder
from tests.reliability.faults import injected

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "stages.0.group_size=32"]
PERPLEXITY_GATE = ["gate=quick", "gate.layers=[perplexity]"]


def dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def label_staging(folder: Path, pid: int, host: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / STAGING_OWNER).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname()}))
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    return folder


def test_sigterm_removes_the_staging_folder_and_marks_the_run_killed(tiny_model_dir, tmp_path, empty_mlflow_db):
    """Robust by design, not by timing: the test holds the run's progress lock, so the run is certainly at work
    (its MLflow run open, its staging folder made, waiting in its compress phase) when the SIGTERM lands. It slept
    1 s after the run started before: on an idle machine the tiny run had finished by then and published."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copy(empty_mlflow_db, artifacts / "mlflow.db")
    runs, stderr = artifacts / "runs", tmp_path / "stderr"
    command = [
        sys.executable,
        "-m",
        "compress",
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        *PERPLEXITY_GATE,
        "gate.perplexity.max_windows=64",
    ]
    with FileLock(lock_beside(progress_folder(runs, "rtn_int4", tiny_model_dir)), "the test"):
        with stderr.open("w") as err:
            process = subprocess.Popen(
                command, cwd=REPO, env=cli_env(artifacts), stdout=subprocess.DEVNULL, stderr=err, text=True
            )
            while not (
                "waiting for the layer walk's progress" in stderr.read_text() and run_statuses(artifacts / "mlflow.db")
            ):
                assert process.poll() is None, stderr.read_text()[-3000:]  # no deadline: a slow run is only slow
                time.sleep(0.05)
            assert list(runs.glob(f".*/{STAGING_OWNER}"))
            process.send_signal(signal.SIGTERM)
            process.wait()
    assert process.returncode == -signal.SIGTERM, stderr.read_text()[-3000:]
    assert "Traceback" not in stderr.read_text()
    assert [p.name for p in runs.iterdir()] in ([], [".progress"])  # progress: kept to resume from
    assert run_statuses(artifacts / "mlflow.db") == ["KILLED"]
    detail = "dies of SIGTERM, no traceback, no staging left, MLflow `KILLED`"
    injected("SIGTERM from outside", "`run`, once its MLflow run is open", "nothing lost", detail)


def test_stale_staging_folders_of_dead_processes_are_swept(tmp_path):
    runs = tmp_path / "runs"
    dead = dead_pid()
    label_staging(runs / ".20260101-000000-rtn_int4-aaaaaa-x1", dead)
    live = label_staging(runs / ".20260101-000000-rtn_int4-bbbbbb-x2", os.getpid())
    elsewhere = label_staging(runs / ".20260101-000000-rtn_int4-cccccc-x3", dead, host="another-machine")
    unlabelled = runs / ".not-a-staging-folder"
    unlabelled.mkdir()
    finished = runs / "20260101-000000-rtn_int4-dddddd"
    finished.mkdir()
    assert sweep_stale_staging(runs) == [runs / ".20260101-000000-rtn_int4-aaaaaa-x1"]
    assert sorted(runs.iterdir()) == sorted([live, elsewhere, unlabelled, finished])


def test_running_mlflow_runs_of_dead_processes_are_marked_killed(tmp_path, monkeypatch, empty_mlflow_db):
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = RunLog(uri, "compress", "alive", tags={})  # this process: alive
    host = socket.gethostname()
    experiment = experiment_id(first.client, "compress")
    orphan = first.client.create_run(experiment, tags={PID_TAG: str(dead_pid()), HOST_TAG: host}).info.run_id
    remote = first.client.create_run(experiment, tags={PID_TAG: str(dead_pid()), HOST_TAG: "elsewhere"}).info.run_id
    RunLog(uri, "compress", "next", tags={})
    status = {run_id: first.client.get_run(run_id).info.status for run_id in (first.run_id, orphan, remote)}
    assert status == {first.run_id: "RUNNING", orphan: "KILLED", remote: "RUNNING"}
    assert "killed" in first.client.get_run(orphan).data.tags["compress.error"]


def test_the_gate_logs_and_registers_into_the_runs_own_store(tiny_model_dir, artifacts, tmp_path, empty_mlflow_db):
    """tracking.uri is honoured by the gate too (it used to log to the default store: "Run ... not found"), the
    registry version is the logged checkpoint (runs:/<run>/checkpoint), and a run sweeps what SIGKILL left."""
    import mlflow
    from mlflow import MlflowClient

    shutil.copy(empty_mlflow_db, tmp_path / "custom.db")
    store = f"sqlite:///{tmp_path / 'custom.db'}"
    runs = tmp_path / "runs"
    stale = label_staging(runs / ".20260101-000000-rtn_int4-eeeeee-x4", dead_pid())
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    orphan = client.create_run(
        experiment_id(client, "compress"), tags={PID_TAG: str(dead_pid()), HOST_TAG: socket.gethostname()}
    ).info.run_id
    args = [
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        *PERPLEXITY_GATE,
        "gate.perplexity.max_ratio=100",
        "gate.registry.name=tiny",
        f"tracking.uri={store}",
        f"output.dir={runs}",
    ]
    assert main(args) == 0
    assert not stale.exists()
    [run_dir] = runs.iterdir()
    assert client.get_run(orphan).info.status == "KILLED"
    [run] = client.search_runs([experiment_id(client, "compress")], "tags.`compress.kind` = 'run'")
    assert run.info.status == "FINISHED" and run.data.metrics["gate.passed"] == 1.0
    assert run.data.tags["compress.gate"] == "pass" and run.data.tags["compress.run_dir"] == str(run_dir)
    version = client.get_model_version_by_alias("tiny", "candidate")
    assert version.source == f"runs:/{run.info.run_id}/checkpoint" and version.run_id == run.info.run_id
    downloaded = Path(
        mlflow.artifacts.download_artifacts(version.source, tracking_uri=store, dst_path=str(tmp_path / "download"))
    )
    checkpoint = run_dir / "checkpoint" / "model.safetensors"
    assert (downloaded / "model.safetensors").read_bytes() == checkpoint.read_bytes()
    assert not (artifacts / "mlflow.db").exists()  # nothing went to the default store
    report = json.loads((run_dir / "report.json").read_text())
    assert report["gate"]["registry"]["version"] == 1
    # one number per signal: the gate judges the run's own perplexity pass (same windows, measured once)
    metrics = run.data.metrics
    own = report["perplexity"]["candidate"]["perplexity"] / report["perplexity"]["baseline"]["perplexity"]
    assert metrics["ppl_ratio"] == pytest.approx(own)
    assert metrics["gate.ppl_ratio"] == pytest.approx(metrics["ppl_ratio"], rel=1e-9)
    gate = json.loads((run_dir / "gate" / "gate.json").read_text())
    perplexity_layer = gate["layers"][0]
    assert perplexity_layer["metrics"]["protocol"]["measured_by"] == "run"
    assert perplexity_layer["metrics"]["protocol"]["windows"] == report["perplexity"]["candidate"]["windows"]
    assert json.loads((run_dir / "gate" / "gate.json").read_text())["candidate"] == str(run_dir / "checkpoint")


def test_a_blocked_run_states_the_reason_in_one_line(tiny_model_dir, artifacts, capsys):
    args = [
        "run",
        "recipe=rtn_int4",
        f"model={tiny_model_dir}",
        *SMALL,
        *PERPLEXITY_GATE,
        "gate.perplexity.max_ratio=0.5",
        "tracking.enabled=false",
        "gate.enforce=true",
    ]
    assert main(args) == 1
    out = capsys.readouterr().out
    [run_dir] = (artifacts / "runs").iterdir()
    [reason] = json.loads((run_dir / "report.json").read_text())["gate"]["reasons"]
    assert re.fullmatch(r"perplexity ×[\d.]+ \(95% CI [\d.]+–[\d.]+\) > the 0\.5× limit: BLOCK", reason), reason
    assert f"release gate: BLOCKED — {reason}" in out and out.count("release gate:") == 1  # one verdict line
    assert f"release gate: BLOCKED — {reason}" in (run_dir / "report.md").read_text()


STORAGE_DRIVER = """
import contextlib, io, json, logging, os, subprocess, sys, time

ro, full, work = sys.argv[1:4]
subprocess.run(["mount", "--bind", f"{work}/store", ro], check=True)  # a real MLflow store ...
subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)  # ... seen through a read-only mount
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", full], check=True)  # room for less than the model
logging.basicConfig(stream=sys.__stderr__)
from compress.__main__ import main

cases = {  # the first case pays for importing torch and transformers
    "output_readonly": [f"output.dir={ro}/runs"],
    "store_readonly": [f"tracking.uri=sqlite:///{ro}/mlflow.db", f"output.dir={work}/runs"],
    "store_folder_readonly": [f"tracking.uri=sqlite:///{ro}/new/mlflow.db", f"output.dir={work}/runs"],
    "disk_below_plan": [f"output.dir={full}/runs"],  # refused before any work: the plan needs more disk
    "disk_full": [f"output.dir={full}/runs", "plan.enforce=false"],  # tried anyway: the real ENOSPC
}
results = {}
for name, extra in cases.items():
    err, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["run", "recipe=rtn_int4", *json.loads(sys.argv[4]), *extra])
        except BaseException as error:
            code = f"raised {type(error).__name__}: {error}"
    results[name] = {"code": code, "stderr": err.getvalue(), "seconds": time.perf_counter() - start}
results["left_on_full_disk"] = os.listdir(f"{full}/runs")  # the mount is only visible in here
print("RESULTS" + json.dumps(results))
"""


def test_unwritable_storage_fails_fast_in_one_line_without_leftovers(tiny_model_dir, tmp_path, empty_mlflow_db):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("needs a user and mount namespace (unshare -rm) for real read-only and full file systems")
    ro, full, work = tmp_path / "ro", tmp_path / "full", tmp_path / "work"
    for folder in (ro, full, work / "store", tmp_path / "artifacts"):
        folder.mkdir(parents=True)
    shutil.copy(empty_mlflow_db, work / "store" / "mlflow.db")  # the store the read-only mount shows
    shutil.copy(empty_mlflow_db, tmp_path / "artifacts" / "mlflow.db")  # the default store of the disk_full run
    arguments = json.dumps([f"model={tiny_model_dir}", *SMALL, "gate=none", "eval.perplexity=false"])
    completed = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", STORAGE_DRIVER, str(ro), str(full), str(work), arguments],
        cwd=REPO,
        env=cli_env(tmp_path / "artifacts"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "RESULTS" in completed.stdout, completed.stderr[-3000:]
    results = json.loads(completed.stdout.split("RESULTS", 1)[1])
    expected = {
        "store_readonly": f"error: MLflow store sqlite:///{ro}/mlflow.db: cannot write (attempt to write a readonly "
        "database); set tracking.uri=<a writable store> or tracking.enabled=false",
        "store_folder_readonly": f"error: MLflow store sqlite:///{ro}/new/mlflow.db: cannot write (Read-only file "
        "system); set tracking.uri=<a writable store> or tracking.enabled=false",
        "output_readonly": f"error: output.dir: cannot write run folders under {ro}/runs ({ro} is not a writable "
        "folder); point it at a folder you can write",
        "disk_full": "(No space left on device); free space there or set output.dir=<a writable folder>",
        "disk_below_plan": "MB are free where it writes; free space, set output.dir elsewhere, resume=false, or",
    }
    for name, message in expected.items():
        result = results[name]
        print(name, f"{result['seconds']:.1f} s:", result["stderr"].splitlines()[-1])
        assert result["code"] == 4, (name, result)  # the machine refused: ExitCode.FAILED, not a usage error
        assert "Traceback" not in result["stderr"], (name, result["stderr"])
        [line] = [line for line in result["stderr"].splitlines() if line.startswith("error:")]  # beside progress bars
        assert message in line, (name, line)
    assert results["store_readonly"]["seconds"] < 10  # MLflow's own retries took 114 s
    assert not (work / "runs").exists()  # the store was checked before any folder was made
    assert results["left_on_full_disk"] in ([], [".progress"])  # the half-written staging folder is gone; the walk's
    # progress stays, to continue from once there is room
    detail = "exit 4, one `error:` line naming the place and the fix, no traceback, no staging left"
    for name in expected:
        injected("disk full" if "disk" in name else "read-only storage", name, "refused", detail)


def test_a_run_that_loses_the_race_to_create_the_experiment_uses_the_winners(tmp_path, monkeypatch, empty_mlflow_db):
    """Two runs starting together on a fresh store both find no experiment; the second create fails on the unique
    name (seen in CI as exit 4, 'a bug'). The loser must read the winner's experiment instead."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    winner, loser = MlflowClient(tracking_uri=uri), MlflowClient(tracking_uri=uri)
    stale = [None]  # the loser's first lookup ran before the winner's create
    real_lookup = loser.get_experiment_by_name
    monkeypatch.setattr(loser, "get_experiment_by_name", lambda name: stale.pop() if stale else real_lookup(name))
    created = experiment_id(winner, "compress")
    assert experiment_id(loser, "compress") == created
