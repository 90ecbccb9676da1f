"""The faults table of docs/reliability.md is the tests' own record (``python -m tests.reliability.faults_table``):
checked here against the test files' ``injected(...)`` calls, without running the slow tests that inject them."""

from __future__ import annotations

import ast
import json

import pytest

from tests.reliability import faults_table
from tests.reliability.faults import LOG_VARIABLE, injected


def test_the_docs_table_names_every_fault_the_tests_inject_and_no_other():
    recorded = faults_table.recorded_faults()
    documented = faults_table.documented_faults(faults_table.DOC.read_text())
    assert len(recorded) >= 10  # the scan finds the tests' calls
    missing = sorted(set(recorded) - set(documented))
    assert not missing, f"rerun `python -m tests.reliability.faults_table`: the table lacks {missing}"
    stale = sorted(set(documented) - set(recorded))
    assert not stale, f"rerun `python -m tests.reliability.faults_table`: no test injects {stale}"
    assert len(documented) == len(set(documented))


def test_every_file_that_records_a_fault_is_one_the_table_is_made_from():
    """A new fault-injecting test file must be added to TEST_FILES, or the table would silently miss it."""
    users = sorted(
        str(path.relative_to(faults_table.REPO))
        for path in (faults_table.REPO / "tests").rglob("test_*.py")
        if "injected(" in path.read_text() and path.name != "test_faults_table.py"
    )
    assert users == sorted(faults_table.TEST_FILES)


def test_a_record_is_one_json_line(tmp_path, monkeypatch):
    """Naming its test, and written only when COMPRESS_FAULTS_LOG asks for it."""
    log = tmp_path / "faults.jsonl"
    monkeypatch.delenv(LOG_VARIABLE, raising=False)
    injected("a fault", "here", "refused", "one line")
    assert not log.exists()
    monkeypatch.setenv(LOG_VARIABLE, str(log))
    injected("a fault", "here", "refused", "one line", times=2)
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["times"] == 2 and record["test"].endswith("::test_a_record_is_one_json_line")
    with pytest.raises(ValueError, match="is not one of"):
        injected("a fault", "here", "survived", "a word the table does not know")


def test_the_table_sums_injections_per_fault_and_keeps_places_and_outcomes_apart():
    records = [
        {"fault": "B", "where": "save", "outcome": "nothing lost", "detail": "130", "times": 1, "test": "t.py::b"},
        {"fault": "A", "where": "walk", "outcome": "resumed", "detail": "same tensors", "times": 3, "test": "u.py::a"},
        {"fault": "B", "where": "data", "outcome": "nothing lost", "detail": "130", "times": 1, "test": "t.py::b"},
        {"fault": "B", "where": "save", "outcome": "refused", "detail": "one line", "times": 2, "test": "v.py::c"},
    ]
    header, rule, first, second = faults_table.table(records, order=["A", "B"])
    assert first == "| A | walk | 3 | **resumed**: same tensors | `u.py` |"
    assert second == "| B | save; data | 4 | **nothing lost**: 130; **refused**: one line | `t.py`, `v.py` |"
    text = faults_table.section(records, "cmd", ["A", "B"])
    assert faults_table.documented_faults(text) == ["A", "B"]


def test_places_that_hold_commas_stay_apart():
    """``gptq, after layer 1 is kept`` and ``awq, after layer 1 is kept`` must not read as four places."""
    records = [
        {"fault": "A", "where": where, "outcome": "resumed", "detail": "x", "times": 1, "test": "t.py::a"}
        for where in ("awq, after layer 1 is kept", "gptq, after layer 1 is kept")
    ]
    row = faults_table.table(records)[2]
    assert row == "| A | awq, after layer 1 is kept; gptq, after layer 1 is kept | 2 | **resumed**: x | `t.py` |"


def test_a_fault_name_must_be_literal_for_the_check_to_read_it():
    built = ast.parse('injected(f"{name} dropped", "here", "refused", "x")').body[0].value
    with pytest.raises(ValueError, match="string literals"):
        faults_table._literal_faults(built, "t.py")
    chosen = ast.parse('injected("A" if sigint else "B", "here", "refused", "x")').body[0].value
    assert faults_table._literal_faults(chosen, "t.py") == ["A", "B"]
