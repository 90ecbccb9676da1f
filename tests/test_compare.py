"""``compress compare`` reads runs back from a real MLflow sqlite store by the metric names the pipeline logs."""

from __future__ import annotations

import pytest

from compress.commands import compare
from compress.tracking import experiment_id
from evals.tracking import client, log_gate


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracking = client()
    experiment = experiment_id(tracking, "compress")
    runs = {
        "awq_int4": {"size_mb": 90.0, "ppl_candidate": 21.0, "bits_per_weight": 4.25, "tpot_p50_ms": 9.0},
        "rtn_int4": {"size_mb": 90.0, "ppl_candidate": 24.0, "bits_per_weight": 4.25},
        "fp16": {"size_mb": 270.0, "ppl_candidate": 20.0, "bits_per_weight": 16.0},
    }
    for recipe, metrics in runs.items():
        run_id = tracking.create_run(experiment, tags={"compress.kind": "run"}).info.run_id
        tracking.log_param(run_id, "recipe", recipe)
        tracking.log_param(run_id, "model.path", "smollm2-135m")
        for key, value in metrics.items():
            tracking.log_metric(run_id, key, value)
    log_gate({"gate_passed": 0.0, "needle_accuracy": 0.5}, {"candidate": "/ckpt/broken"}, {}, [], None)
    return tmp_path


def test_table_lists_runs_with_their_metrics_and_verdicts(store, capsys):
    assert compare.main([f"plot={store / 'pareto.png'}"]) == 0
    table = capsys.readouterr().out
    assert "awq_int4" in table and "4.25" in table and "21.000" in table and "9.00" in table
    assert "BLOCK" in table and "50%" in table
    assert (store / "pareto.png").stat().st_size > 0


def test_filters_by_recipe_kind_and_date(store):
    assert [row.recipe for row in compare.load_rows(None, "rtn_int4", None, None, 100)] == ["rtn_int4"]
    assert [row.kind for row in compare.load_rows(None, None, None, "gate", 100)] == ["gate"]
    assert len(compare.load_rows("smollm2", None, None, None, 100)) == 3
    assert compare.load_rows(None, None, compare.dt.date(2999, 1, 1), None, 100) == []


def test_pareto_front_keeps_only_undominated_points():
    assert compare.pareto_front([(90.0, 21.0), (90.0, 24.0), (270.0, 20.0), (300.0, 25.0)]) == [0, 2]


def test_bad_argument_is_a_usage_error(capsys):
    assert compare.main(["colour=red"]) == 2
    assert "usage" in capsys.readouterr().err
