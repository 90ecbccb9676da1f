"""A fault battery through the real CLI on a tiny model with a real MLflow sqlite store: SIGKILL at seeded points of a
run, SIGTERM during the gate, Ctrl-C while a run waits at a lock, damaged and mistaken inputs (one line each, nothing
written), two runs sharing one artifacts folder and one store, and a second identical run waiting for the first.
What it guarantees is stated in docs/reliability.md."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from cli_support import REPO, cli_env, run_statuses
from helpers import build_tiny_tokenizer, tiny_model_for
from safetensors.torch import load_file, save_file

from compress.base.locks import FileLock, lock_beside
from compress.base.staging import STAGING_OWNER
from compress.model.resume import progress_folder
from tests.reliability.faults import injected

SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=3", "stages.0.group_size=32"]
QUIET = ["gate=none", "tracking.enabled=false"]


def compress_process(artifacts: Path, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    command = [sys.executable, "-m", "compress", *args]
    return subprocess.Popen(command, cwd=REPO, env=cli_env(artifacts), stdout=subprocess.PIPE, stderr=stderr, text=True)


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
    """Until ``condition`` holds; fails as soon as ``process`` ends without it. No deadline (nor on the waits for a
    process to end below): under load a run takes what it takes, and 180 s / 300 s limits failed runs that were only
    slow (docs/reliability.md, under load). A process that hangs is the CI job's timeout to catch."""
    while not condition():
        assert process.poll() is None, (f"{what} never happened", process.communicate())
        time.sleep(0.02)


def finished_runs(runs: Path) -> list[Path]:
    return [folder for folder in runs.iterdir() if not folder.name.startswith(".")] if runs.exists() else []


def test_sigkill_at_seeded_points_leaves_nothing_that_looks_finished(tiny_model_dir, tmp_path):
    """Killed anywhere between its staging folder appearing and its end, a run leaves either a complete run folder
    (report, a checkpoint transformers loads) or only a hidden staging folder, which the next run sweeps."""
    from transformers import AutoModelForCausalLM

    artifacts, runs = tmp_path / "artifacts", tmp_path / "artifacts" / "runs"
    rng = random.Random(0)
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, *QUIET]
    for delay in sorted(rng.uniform(0.0, 4.0) for _ in range(3)):
        process = compress_process(artifacts, *args)
        wait_for(lambda: any(runs.glob(f".*/{STAGING_OWNER}")), process, "a staging folder")
        time.sleep(delay)
        process.kill()
        process.wait()
        for folder in finished_runs(runs):
            assert (folder / "report.json").is_file() and (folder / "checkpoint" / "size.json").is_file()
            AutoModelForCausalLM.from_pretrained(folder / "checkpoint")
    assert subprocess.run([sys.executable, "-m", "compress", *args], cwd=REPO, env=cli_env(artifacts)).returncode == 0
    assert not any(runs.glob(f".*/{STAGING_OWNER}"))  # the dead runs' staging folders were swept
    detail = "a whole run folder (report, a checkpoint transformers loads) or only a staging folder the next run sweeps"
    injected("SIGKILL from outside", "a run, at seeded times after its staging folder appears", "nothing lost", detail,
             times=3)  # fmt: skip


def test_sigterm_during_the_gate_ends_its_mlflow_run_killed_and_writes_no_verdict(tiny_model_dir, tmp_path):
    """Robust by design, not by timing: this test holds the lock of the baseline's reference cache entry, so the gate
    is certainly at work (its MLflow run open, both sides described, waiting to measure the baseline) when the
    SIGTERM lands, however loaded the machine. A first gate finds the entry's name (a hash of model, text and
    protocol); the entry is then removed, so the second gate must measure the baseline, under the lock."""
    cache, out, stderr = tmp_path / "cache", tmp_path / "gate", tmp_path / "stderr"
    args = ["gate", f"checkpoint={tiny_model_dir}", f"baseline={tiny_model_dir}", "gate=quick", f"out={out}",
            "gate.backend=transformers", "gate.layers=[perplexity,kl]", f"gate.cache_dir={cache}"]  # fmt: skip
    first = compress_process(tmp_path / "first", *args)
    _, err = first.communicate()
    assert first.returncode == 0, err[-3000:]
    (entry,) = cache.glob("*.safetensors")
    entry.unlink()
    (out / "gate.json").write_text(json.dumps({"passed": True}))  # a previous verdict in the reused folder
    artifacts = tmp_path / "artifacts"
    with FileLock(lock_beside(entry), "the test") as held:
        with stderr.open("w") as err:
            process = compress_process(artifacts, *args, stderr=err)
            wait_for(lambda: "waiting for the baseline reference" in stderr.read_text(), process, "the lock wait")
            assert run_statuses(artifacts / "mlflow.db") == ["RUNNING"]
            process.send_signal(signal.SIGTERM)
            process.communicate()
        assert process.returncode == -signal.SIGTERM, stderr.read_text()[-3000:]
        assert held.descriptor is not None  # the gate never had the lock
    assert "Traceback" not in stderr.read_text()
    assert run_statuses(artifacts / "mlflow.db") == ["KILLED"]
    assert not (out / "gate.json").exists()  # CI cannot read the old PASS as this gate's verdict
    assert not entry.exists()  # nor a reference half measured
    detail = "dies of SIGTERM, MLflow `KILLED`, the old verdict removed and no new one"
    injected("SIGTERM from outside", "`gate`, waiting at its baseline reference's lock", "nothing lost", detail)


def test_damaged_and_mistaken_inputs_fail_in_one_line_and_write_nothing(tiny_model_dir, tmp_path):
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    (truncated / "config.json").write_text((tiny_model_dir / "config.json").read_text()[:40])
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 64)
    nan = tmp_path / "nan"
    shutil.copytree(tiny_model_dir, nan)
    weights = load_file(nan / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    other = build_tiny_tokenizer(vocab_size=400)
    other_family = tmp_path / "other-family"
    tiny_model_for(other).save_pretrained(other_family)
    other.save_pretrained(other_family)
    run = ["run", "recipe=rtn_int4", *SMALL, *QUIET]
    cases = {
        "truncated config.json": ([*run, f"model={truncated}"], "config.json is not valid JSON"),
        "corrupt safetensors": ([*run, f"model={corrupt}"], "is corrupt or truncated"),
        "NaN weights": ([*run, f"model={nan}"], "non-finite values (NaN/inf)"),
        "recipe key typo": ([*run, f"model={tiny_model_dir}", "stages.0.gruop_size=32"], "did you mean 'group_size'"),
        "pattern matching nothing": (
            [*run, f"model={tiny_model_dir}", "stages.0.ignore=[lm_head,mlp.down_prj]"],
            "ignore pattern 'mlp.down_prj' matches no module",
        ),
        "baseline of another tokenizer": (
            ["gate", f"checkpoint={tiny_model_dir}", f"baseline={other_family}", f"out={tmp_path / 'gate'}"],
            "is not the candidate's",
        ),
    }
    artifacts_of = {name: tmp_path / f"artifacts-{name.replace(' ', '-')}" for name in cases}
    processes = {name: compress_process(artifacts_of[name], *args) for name, (args, _) in cases.items()}  # at once:
    for name, process in processes.items():  # each spends its seconds importing, so two cores run two at a time
        _, stderr = process.communicate()
        message, artifacts = cases[name][1], artifacts_of[name]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert process.returncode == 2, (name, stderr[-2000:])
        assert len(errors) == 1 and message in errors[0], (name, stderr[-2000:])
        assert "Traceback" not in stderr, name
        assert finished_runs(artifacts / "runs") == [] and not any((artifacts / "runs").glob(".*")), name
        assert not (tmp_path / "gate" / "gate.json").exists(), name
        detail = "exit 2, one `error:` line, no traceback, nothing written"
        injected("damaged or mistaken input", name, "refused", detail)


def test_two_runs_into_one_artifacts_folder_and_store_both_complete(tiny_model_dir, tmp_path, empty_mlflow_db):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copy(empty_mlflow_db, artifacts / "mlflow.db")
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, "gate=none"]
    processes = [compress_process(artifacts, *args) for _ in range(2)]
    for process in processes:
        _, err = process.communicate()
        assert process.returncode == 0, err[-3000:]
    runs = finished_runs(artifacts / "runs")
    assert len(runs) == 2 and all((run / "report.json").is_file() for run in runs)
    assert run_statuses(artifacts / "mlflow.db") == ["FINISHED", "FINISHED"]
    detail = "both exit 0, two run folders, both MLflow runs `FINISHED`"
    injected("two identical runs started together", "one artifacts folder and MLflow store", "nothing lost", detail)


def checkpoint_tensors(run: Path) -> dict:
    return {
        key: value
        for shard in sorted((run / "checkpoint").glob("*.safetensors"))
        for key, value in load_file(shard).items()
    }


def test_ctrl_c_ends_a_run_with_130_and_leaves_nothing(tiny_model_dir, tmp_path):
    """Robust by design, not by timing: this test holds the run's progress lock, so the run is certainly still at work
    (waiting in its compress phase, its staging folder made) when the Ctrl-C lands, however loaded the machine."""
    artifacts = tmp_path / "artifacts"
    runs, stderr = artifacts / "runs", tmp_path / "stderr"
    with FileLock(lock_beside(progress_folder(runs, "rtn_int4", tiny_model_dir)), "the test") as held:
        with stderr.open("w") as err:
            process = compress_process(artifacts, "run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, *QUIET,
                                       stderr=err)  # fmt: skip
            wait_for(lambda: "waiting for the layer walk's progress" in stderr.read_text(), process, "the lock wait")
            assert any(runs.glob(f".*/{STAGING_OWNER}"))
            process.send_signal(signal.SIGINT)
            process.communicate()
        assert process.returncode in (130, -signal.SIGINT), stderr.read_text()[-3000:]
        assert held.descriptor is not None  # the run never had the lock
    assert finished_runs(runs) == [] and not any(runs.glob(f".*/{STAGING_OWNER}"))
    assert [path.name for path in runs.glob(".*")] == [".progress"] and not any((runs / ".progress").iterdir())
    detail = "exit 130, nothing published, no staging left"
    injected("SIGINT from outside (Ctrl-C)", "a run waiting at its progress lock", "nothing lost", detail)


RUN_PAUSED_IN_ITS_WALK = """
import sys
from compress.model import resume
keep = resume.WalkProgress.save
def keep_then_wait(self, index, *args):
    keep(self, index, *args)
    if index == 0:
        print("layer 0 kept", file=sys.stderr, flush=True)
        sys.stdin.readline()  # the test says when to go on
resume.WalkProgress.save = keep_then_wait
from compress.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_identical_run_waits_for_the_first_and_both_publish_the_same_checkpoint(tiny_model_dir, tmp_path):
    """Two identical runs share one progress folder: the second waits at its lock, says so in one line, and then
    goes on from the first's progress. The first is held inside its walk (by this test) until the second waits."""
    artifacts, runs = tmp_path / "artifacts", tmp_path / "artifacts" / "runs"
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *SMALL, *QUIET]
    first_err, second_err = tmp_path / "first.err", tmp_path / "second.err"
    with first_err.open("w") as err:
        command = [sys.executable, "-c", RUN_PAUSED_IN_ITS_WALK, *args]
        first = subprocess.Popen(command, cwd=REPO, env=cli_env(artifacts), stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=err, text=True)  # fmt: skip
        wait_for(lambda: "layer 0 kept" in first_err.read_text(), first, "the first run's walk")
        with second_err.open("w") as err2:
            second = compress_process(artifacts, *args, stderr=err2)
            wait_for(lambda: "waiting for the layer walk's progress" in second_err.read_text(), second, "the wait")
            first.communicate("go\n")
            second.communicate()
    assert first.returncode == 0, first_err.read_text()[-3000:]
    assert second.returncode == 0, second_err.read_text()[-3000:]
    waits = [line for line in second_err.read_text().splitlines() if "waiting for" in line]
    assert len(waits) == 1, waits
    assert "waiting for" not in first_err.read_text()
    one, other = finished_runs(runs)
    tensors, expected = checkpoint_tensors(one), checkpoint_tensors(other)
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert not (runs / ".progress").exists()  # the last run to publish removed it
    detail = "the second waits (one line), then both exit 0 with identical checkpoint tensors"
    injected("two identical runs, one inside its walk", "the progress folder's lock", "waited", detail)
