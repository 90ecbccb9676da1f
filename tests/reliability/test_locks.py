"""OS file locks between runs (``compress.base.locks``), each held by a real second process: the waiter says so in one
line and then finds the holder's work; a lock dies with its holder; a removed lock file is never shared by two
holders."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from cli_support import REPO, cli_env

from compress.base.errors import CompressError
from compress.base.locks import FileLock, lock_beside
from tests.reliability.faults import injected

HOLDER = """
import sys
from pathlib import Path
from compress.base.locks import FileLock
lock = FileLock(sys.argv[1], "a test").acquire()
print("held", flush=True)
sys.stdin.readline()  # the test says when to let go
if len(sys.argv) > 2:
    Path(sys.argv[2]).mkdir()  # what the holder made while it held the lock
lock.release()
"""


def holder(lock: Path, *made: Path) -> subprocess.Popen:
    """A process that holds ``lock`` until it reads a line (then makes the folder ``made``, if given, and lets go)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), *map(str, made)],
        cwd=REPO, env=cli_env(lock.parent), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout.readline() == "held\n"
    return process


def in_thread(work) -> tuple[threading.Thread, list]:
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # noqa: BLE001 - handed to the test to assert on
            outcome.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def until_waiting(thread: threading.Thread, caplog) -> None:
    """Until the thread says it waits for a lock (a condition, not a timeout)."""
    while "waiting for" not in caplog.text:
        assert thread.is_alive(), "finished without waiting"
        thread.join(0.01)


def test_a_lock_dies_with_its_holder(tmp_path):
    path = tmp_path / "x.lock"
    process = holder(path)
    assert not FileLock(path, "x").try_acquire()
    process.kill()
    process.wait()
    lock = FileLock(path, "x")
    assert lock.try_acquire()
    lock.release()
    assert not path.exists()  # the last holder removes its file
    injected("a lock holder killed (SIGKILL)", "`FileLock`", "nothing lost", "the lock is free at once")


def test_a_waiter_whose_lock_file_was_removed_locks_the_new_one(tmp_path, caplog):
    """The holder removes the file before it lets go: the waiter then holds a removed file's lock, sees that and
    locks again, so a third process arriving meanwhile cannot hold the lock beside it."""
    path = tmp_path / "x.lock"
    process = holder(path)
    thread, outcome = in_thread(lambda: FileLock(path, "x").acquire())
    until_waiting(thread, caplog)
    process.communicate("go\n")
    thread.join()
    [lock] = outcome
    assert lock.descriptor is not None and path.exists()
    assert not FileLock(path, "x").try_acquire()  # one holder
    lock.release()
    assert caplog.text.count("waiting for") == 1
    detail = "the waiter locks the new file: one holder"
    injected("a lock file removed while another process waits", "`FileLock`", "waited", detail)


def test_a_second_writer_of_one_checkpoint_name_waits_then_refuses_in_one_line(tmp_path, caplog):
    from compress.checkpoint.writer import CheckpointWriter

    target = tmp_path / "checkpoint"
    process = holder(lock_beside(target), target)  # another writer of this name, mid-write
    thread, outcome = in_thread(lambda: CheckpointWriter(target))
    until_waiting(thread, caplog)
    assert "waiting for the checkpoint name" in caplog.text
    process.communicate("go\n")  # it publishes its checkpoint and lets go
    thread.join()
    [error] = outcome
    assert isinstance(error, CompressError) and "already exists" in str(error)
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoint"]  # no staging folder, no lock left
    detail = "the second waits, then is refused in one line; no staging folder or lock left"
    injected("two writers of one checkpoint name", "`CheckpointWriter`", "refused", detail)


SAMPLES = """
import sys, torch
from transformers import AutoModelForCausalLM
from compress.model import calibration_set
sample = calibration_set._sample
def announced(*args):
    print("sampling", flush=True)
    sys.stdin.readline()  # the test says when to go on
    return sample(*args)
calibration_set._sample = announced
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
torch.save(calibration_set.sampled_windows(model, 2, 16, 0, 1), sys.argv[2])
"""


def sampler(tiny_model_dir: Path, tmp_path: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SAMPLES, str(tiny_model_dir), str(tmp_path / f"{name}.pt")],
        cwd=REPO, env=cli_env(tmp_path / "artifacts"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_runs_sampling_one_calibration_cache_entry_sample_it_once(tiny_model_dir, tmp_path):
    """The second waits at the entry's lock while the first samples, then reads the first's windows from the cache."""
    first = sampler(tiny_model_dir, tmp_path, "first")
    assert first.stdout.readline() == "sampling\n"  # it holds the entry's lock
    second = sampler(tiny_model_dir, tmp_path, "second")
    line = second.stderr.readline()
    while "waiting for the calibration cache entry" not in line:
        assert line, "the second never waited"
        line = second.stderr.readline()
    first.communicate("go\n")
    out, err = second.communicate("go\n")
    assert first.returncode == 0 and second.returncode == 0, err[-3000:]
    assert "sampling" not in out  # read from the cache, not sampled again
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))
    detail = "the second waits, then reads the first's windows: sampled once"
    injected("two samplers of one calibration cache entry", "`sampled_windows`", "waited", detail)


def test_a_lock_this_process_left_held_is_taken_over_not_waited_for(tmp_path):
    """Work that failed in this process (an in-process walk that raised) must not make the next one wait for itself."""
    path = tmp_path / "x.lock"
    left = FileLock(path, "x").acquire()
    taken = FileLock(path, "x").acquire()
    assert left.descriptor is None and taken.descriptor is not None
    taken.release()
    assert not path.exists()
    detail = "taken over, not waited for"
    injected("a lock left held by failed work in this process", "`FileLock`", "nothing lost", detail)


def gate_process(tiny_model_dir: Path, tmp_path: Path, name: str, cache: Path, **popen) -> subprocess.Popen:
    """A quick gate of the tiny model against itself, judging perplexity and KL (its baseline reference cached in
    ``cache``), into ``tmp_path/name``."""
    policy = ["gate=quick", "gate.backend=transformers", "gate.layers=[perplexity,kl]", f"gate.cache_dir={cache}"]
    args = ["gate", f"checkpoint={tiny_model_dir}", f"baseline={tiny_model_dir}", f"out={tmp_path / name}", *policy]
    env = cli_env(tmp_path / f"artifacts-{name}")
    return subprocess.Popen([sys.executable, "-m", "compress", *args], cwd=REPO, env=env, text=True, **popen)


def cached_from(verdict: Path) -> str | None:
    """The reference cache file a gate's KL layer read its baseline from (None: measured)."""
    layers = json.loads(verdict.read_text())["layers"]
    return next(layer["metrics"]["candidate"]["reference_cached"] for layer in layers if layer["name"] == "kl")


def test_two_gates_of_one_baseline_measure_its_reference_once(tiny_model_dir, tmp_path):
    """A gate that finds no cached reference waits at the entry's lock while another gate measures it, then reads what
    that one cached instead of measuring again. This test plays the other gate: it holds the lock and puts the entry
    (measured by a first gate, then moved aside) in place once the second gate waits."""
    cache = tmp_path / "cache"
    first = gate_process(tiny_model_dir, tmp_path, "first", cache, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = first.communicate()
    assert first.returncode == 0, err[-3000:]
    (entry,) = cache.glob("*.safetensors")
    assert cached_from(tmp_path / "first" / "gate.json") is None
    aside = entry.rename(tmp_path / "measured.safetensors")
    with FileLock(lock_beside(entry), "the test"), (tmp_path / "second.err").open("w") as log:
        second = gate_process(tiny_model_dir, tmp_path, "second", cache, stdout=subprocess.DEVNULL, stderr=log)
        while "waiting for the baseline reference" not in (tmp_path / "second.err").read_text():
            assert second.poll() is None, (tmp_path / "second.err").read_text()[-3000:]  # no deadline: only slow
            time.sleep(0.05)
        aside.rename(entry)
    assert second.wait() == 0, (tmp_path / "second.err").read_text()[-3000:]
    assert cached_from(tmp_path / "second" / "gate.json") == str(entry)
    detail = "the second waits, then reads the first's reference: measured once"
    injected("two gates of one baseline", "the baseline reference's cache entry", "waited", detail)
