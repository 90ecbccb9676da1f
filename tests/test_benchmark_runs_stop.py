"""A benchmark driver stopped by SIGTERM or Ctrl-C stops the compression it started: that child runs in a session of
its own (so a timeout can kill its whole group), which a signal to the driver alone would never reach."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent (init, here) has yet to reap it


@pytest.mark.skipif(not Path("/usr/bin/time").is_file(), reason="measured_run reads peak RSS through GNU time")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_driver_stops_its_compression(tmp_path, signum):
    pid_file = tmp_path / "child.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    driver = (
        "import sys; from benchmarks.peer_comparison import measured_run; "
        f"measured_run([sys.executable, '-c', {sleeper!r}], __import__('pathlib').Path({str(tmp_path / 'run.log')!r}), "
        "timeout=300)"
    )
    process = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    assert _running(child)
    process.send_signal(signum)
    process.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    outlived = _running(child)
    if outlived:  # clean up before asserting, so a failure leaves no sleeper behind
        os.kill(child, signal.SIGKILL)
    assert not outlived, "the driver's compression outlived it"
    assert process.returncode != 0
