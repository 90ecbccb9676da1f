"""Pooled accuracy calibration (``gate.lm_eval.benchmark: [arc_easy, piqa]``): stored per-item outcomes of several
benchmarks read as one item set, resampled within each benchmark, judged by the gate's own check. Tiny inputs."""

from __future__ import annotations

import json

import pytest

from benchmarks import gate_verdicts as gv
from compress.evals.gate.policy import resolve_policy


def _store(folder, stem: str, baseline: list[float], candidates: dict[str, list[float]]) -> None:
    (folder / f"{stem}.json").write_text(json.dumps({"outcomes": {"acc": baseline}}))
    for name, outcomes in candidates.items():
        (folder / f"{stem}-{name}.json").write_text(json.dumps({"candidate": name, "outcomes": {"acc": outcomes}}))


def test_the_pooled_set_concatenates_both_benchmarks_and_draws_within_each(tmp_path):
    arc, piqa = [1.0, 0.0] * 30, [1.0] * 90
    _store(tmp_path, "accuracy-task", arc, {"same": arc, "only_arc": arc})
    _store(tmp_path, "accuracy-piqa", piqa, {"same": piqa, "piqa_lost": [0.0] * 45 + [1.0] * 45})
    parts = {"arc_easy": gv.load_accuracy(tmp_path), "piqa": gv.load_accuracy(tmp_path, "accuracy-piqa")}
    pooled = gv.pooled_accuracy(parts)
    assert pooled["sizes"] == {"arc_easy": 60, "piqa": 90} and pooled["baseline"] == arc + piqa
    assert set(pooled) == {"sizes", "baseline", "same"}  # a candidate stored on one benchmark only is left out
    for indices in gv.stratified_draws([60, 90], 20, seed=1):
        assert len(indices) == 150 and all(i < 60 for i in indices[:60]) and all(60 <= i < 150 for i in indices[60:])
    parts["piqa"]["same"] = parts["piqa"]["piqa_lost"]  # PIQA loses 45 of 150 pooled items: −30 points
    pooled = gv.pooled_accuracy(parts)
    assert pooled["same"]["change"] == pytest.approx(-30.0)
    assert pooled["same"]["changes"] == {"arc_easy": 0.0, "piqa": pytest.approx(-50.0)}
    rates = gv.pooled_rates(pooled, resolve_policy({"lm_eval": {"max_drop_points": 3.0}}), 0.99)
    assert rates["same"]["block"] == 1.0 and rates["same"]["slices"] == gv.DRAWS
