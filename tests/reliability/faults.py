"""What a fault-injecting test records, for the generated faults table of docs/reliability.md
(``python -m tests.reliability.faults_table``). A test calls ``injected`` after the assertions on what the fault
left, so a record means the outcome was checked, not only that the fault happened. Nothing is written unless
COMPRESS_FAULTS_LOG names a file (one JSON object per line; pytest workers append to it side by side)."""

from __future__ import annotations

import json
import os

LOG_VARIABLE = "COMPRESS_FAULTS_LOG"
OUTCOMES = ("nothing lost", "resumed", "waited", "refused")  # what the run did about the fault


def injected(fault: str, where: str, outcome: str, detail: str, times: int = 1) -> None:
    """Record that ``fault`` was injected ``times`` times at ``where`` and the run's outcome (one of ``OUTCOMES``,
    ``detail`` saying what was checked). ``fault`` is the table's row: keep one wording per kind of fault."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    record = {"fault": fault, "where": where, "outcome": outcome, "detail": detail, "times": times, "test": test}
    with open(path, "a", encoding="utf-8") as log:  # one write of one line: appends from two workers don't mix
        log.write(json.dumps(record) + "\n")
