"""A CPU burner: N processes spinning on pure Python (or numpy) so that the tests run on a machine whose cores are
all busy, as on a CI runner beside other jobs. It stops after ``--seconds``, or as soon as the process that started
it exits (each spinner also stops when the burner itself is killed), so it never outlives the run it loads.

    python -m tests.reliability.burner [--processes N] [--seconds S] [--work python|numpy]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

POLL_SECONDS = 0.5  # how soon the burner notices that its parent is gone (it sleeps between checks: no load itself)


def _spin_python(until: float, burner: int) -> None:
    total = 0
    while time.monotonic() < until and os.getppid() == burner:
        for i in range(20_000):  # ~1 ms of pure-Python work between checks
            total += i * i
    sys.exit(0)


def _spin_numpy(until: float, burner: int) -> None:
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"  # one core per spinner
    import numpy as np

    matrix = np.random.default_rng(0).standard_normal((128, 128))
    while time.monotonic() < until and os.getppid() == burner:
        matrix = np.tanh(matrix @ matrix)
    sys.exit(0)


def burn(processes: int, seconds: float, work: str = "python") -> int:
    """Keep ``processes`` cores busy until ``seconds`` pass or this process's parent exits; returns 0."""
    parent, until = os.getppid(), time.monotonic() + seconds
    target = _spin_numpy if work == "numpy" else _spin_python
    burner = os.getpid()
    spinners = [multiprocessing.Process(target=target, args=(until, burner), daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    print(f"burning {processes} core(s) with {work} for at most {seconds:.0f} s (pid {os.getpid()})", flush=True)
    try:
        while time.monotonic() < until and os.getppid() == parent and any(s.is_alive() for s in spinners):
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        pass
    for spinner in spinners:
        spinner.terminate()
        spinner.join()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="spinning processes (cores)")
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long at the latest")
    parser.add_argument("--work", choices=["python", "numpy"], default="python")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.seconds <= 0:
        parser.error("--processes must be >= 1 and --seconds > 0")
    return burn(args.processes, args.seconds, args.work)


if __name__ == "__main__":
    sys.exit(main())
