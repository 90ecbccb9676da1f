"""Figures docs/gate.md quotes from the gate's calibration are the results file's, re-rendered here."""

import json
from pathlib import Path

from benchmarks import gate_intervals

REPO = Path(__file__).resolve().parents[1]


def test_the_calibration_figures_in_docs_gate_md_are_the_results_files():
    results = json.loads((REPO / "benchmarks" / "results" / "gate-calibration.json").read_text(encoding="utf-8"))
    expected = gate_intervals.docs_summary(results["intervals"], results["operating_characteristic"])
    docs = (REPO / "docs" / "gate.md").read_text(encoding="utf-8")
    start, end = docs.index(gate_intervals.DOCS_BEGIN), docs.index(gate_intervals.DOCS_END)
    assert docs[start : end + len(gate_intervals.DOCS_END)] == expected, (
        "docs/gate.md quotes other figures than benchmarks/results/gate-calibration.json: paste "
        "benchmarks.gate_intervals.docs_summary(...) of the results file into it"
    )
