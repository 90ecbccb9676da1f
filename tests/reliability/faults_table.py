"""Regenerate the faults table of docs/reliability.md from what the fault-injecting tests record (``faults.injected``):
each fault, where it was injected, how many times, the outcome the test checked and the test.

    python -m tests.reliability.faults_table            # runs the fault-injecting tests once, with the log on
    python -m tests.reliability.faults_table --log F    # from a log written by an earlier run (COMPRESS_FAULTS_LOG=F)

``recorded_faults`` reads the fault names straight from the test files (no test runs), for the check that the doc's
table names every fault the tests inject (tests/reliability/test_faults_table.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from tests.reliability.faults import LOG_VARIABLE

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- faults:begin (python -m tests.reliability.faults_table) -->", "<!-- faults:end -->"
TEST_FILES = [  # every test file that calls injected(...)
    "tests/reliability/test_signals.py",
    "tests/reliability/test_faults.py",
    "tests/reliability/test_locks.py",
    "tests/compress/test_resume.py",
    "tests/compress/test_checkpoint.py",
    "tests/compress/test_lifecycle.py",
]
HEADER = ["| Fault | Where | Injected | Outcome | Test |", "|---|---|---|---|---|"]


def _called(call: ast.Call) -> str | None:
    return getattr(call.func, "id", getattr(call.func, "attr", None))


def _injecting_calls(name: str) -> list[tuple[str, ast.Call]]:
    """(test function, ``injected(...)`` call) pairs of a test file, in line order."""
    calls = []
    for function in ast.walk(ast.parse((REPO / name).read_text())):
        if isinstance(function, ast.FunctionDef) and function.name.startswith("test_"):
            calls += [
                (function.name, node)
                for node in ast.walk(function)
                if isinstance(node, ast.Call) and _called(node) == "injected"
            ]
    return sorted(calls, key=lambda pair: pair[1].lineno)


def recorded_faults(files: list[str] = TEST_FILES) -> dict[str, set[str]]:
    """The fault names the tests pass to ``injected(...)`` as string literals, read from their source (in file and
    line order), each with the files that record it."""
    found: dict[str, set[str]] = {}
    for name in files:
        for _, call in _injecting_calls(name):
            for fault in _literal_faults(call, name):
                found.setdefault(fault, set()).add(name)
    return found


def injecting_tests(files: list[str] = TEST_FILES) -> list[str]:
    """The test functions that call ``injected``, as pytest ids (``file::function``): what the table is made from."""
    return list(dict.fromkeys(f"{name}::{function}" for name in files for function, _ in _injecting_calls(name)))


def _literal_faults(call: ast.Call | ast.expr, name: str) -> list[str]:
    """The fault names ``call``'s first argument can be: a string literal or literals chosen inline (``"a" if ...
    else "b"``), never a name or a built string, so that this check needs no test run."""
    node = (call.args[0] if call.args else None) if isinstance(call, ast.Call) else call
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _literal_faults(node.body, name) + _literal_faults(node.orelse, name)
    raise ValueError(f"{name}:{call.lineno}: injected(...) needs the fault as string literals, not built")


def _unique(values) -> list[str]:
    return list(dict.fromkeys(values))


def table(records: list[dict], order: list[str] = ()) -> list[str]:
    """One row per fault (in ``order``, then as recorded): where, times injected, outcome, the test files.
    ``records`` come in the tests' collection order, so that the places of a parametrized test keep theirs."""
    rows = []
    faults = _unique(record["fault"] for record in records)
    for fault in sorted(faults, key=lambda f: list(order).index(f) if f in order else len(order) + faults.index(f)):
        mine = [record for record in records if record["fault"] == fault]
        where = "; ".join(_unique(record["where"] for record in mine))  # a place may hold a comma itself
        outcomes = "; ".join(
            f"**{outcome}**: " + "; ".join(_unique(r["detail"] for r in mine if r["outcome"] == outcome))
            for outcome in _unique(record["outcome"] for record in mine)
        )
        tests = ", ".join(f"`{path}`" for path in _unique(record["test"].split("::")[0] for record in mine))
        rows.append(f"| {fault} | {where} | {sum(record['times'] for record in mine)} | {outcomes} | {tests} |")
    return [*HEADER, *rows]


def section(records: list[dict], command: str, order: list[str]) -> str:
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    note = (
        f"Generated from the tests' own records by `{command}` on {date} (do not edit: rerun it); "
        "*Injected* counts one run of the tests."
    )
    return "\n".join([BEGIN, note, "", *table(records, order), END])


def documented_faults(text: str) -> list[str]:
    """The fault names of the generated table in ``text`` (empty when it has no generated section)."""
    match = re.search(re.escape(BEGIN) + "(.*?)" + re.escape(END), text, re.S)
    rows = [line for line in match.group(1).splitlines() if line.startswith("|")][2:] if match else []
    return [row.split(" | ")[0].removeprefix("| ") for row in rows]


def collection_order() -> list[str]:
    """The fault-injecting tests' ids in pytest's collection order (workers finish in any order)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *injecting_tests()]
    listed = subprocess.run(command, cwd=REPO, capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if "::" in line]


def run_tests(log: Path) -> int:
    """Run the tests that inject faults (only those) once with the log on; their exit status."""
    env = {**os.environ, LOG_VARIABLE: str(log)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--maxprocesses", "4"]
    return subprocess.run([*command, *injecting_tests()], cwd=REPO, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, help="a log written with COMPRESS_FAULTS_LOG (default: run the tests)")
    args = parser.parse_args(argv)
    command = "python -m tests.reliability.faults_table"
    with tempfile.TemporaryDirectory() as scratch:
        log = args.log or Path(scratch) / "faults.jsonl"
        if args.log is None and run_tests(log) != 0:
            print("error: a fault-injecting test failed; the table is left as it was", file=sys.stderr)
            return 1
        if not log.is_file():
            print(f"error: {log} does not exist; run the tests with {LOG_VARIABLE}={log} first", file=sys.stderr)
            return 2
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    order = {test: index for index, test in enumerate(collection_order())}
    records.sort(key=lambda record: order.get(record["test"], len(order)))
    faults = recorded_faults()
    missing = set(faults) - {record["fault"] for record in records}
    if missing:
        print(f"error: no record of {sorted(missing)}: run all of {TEST_FILES} with the log on", file=sys.stderr)
        return 2
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {DOC} has no {BEGIN} ... {END} section; add the two marker lines", file=sys.stderr)
        return 2
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    DOC.write_text(pattern.sub(lambda _: section(records, command, list(faults)), text))
    injections = sum(record["times"] for record in records)
    print(f"{DOC.relative_to(REPO)}: {len(table(records)) - len(HEADER)} faults, {injections} injections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
