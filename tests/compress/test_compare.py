"""``compress compare`` reads runs back from a real MLflow sqlite store by the metric names the pipeline logs."""

from __future__ import annotations

import shutil

import pytest

from compress.app.tracking import RunLog, experiment_id, tracking_uri
from compress.commands import compare


@pytest.fixture
def store(tmp_path, monkeypatch, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    gate = RunLog(tracking_uri(), "compress", None, tags={"compress.kind": "gate"})
    gate.params({"candidate": "/ckpt/broken"})
    gate.metrics({"gate.passed": 0.0, "gate.needle_accuracy": 0.5})
    gate.finish()
    tracking = gate.client
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


def test_runs_without_tpot_are_drawn_in_grey(store):
    """A colormap draws a NaN colour fully transparent: runs without TPOT were invisible though the legend says grey."""
    figure = compare.pareto_figure(compare.load_rows(None, None, None, "run", 100))
    figure.canvas.draw()
    visible = set()
    for collection in figure.axes[0].collections:
        offsets, colours = collection.get_offsets().tolist(), collection.get_facecolors()
        colours = colours if len(colours) == len(offsets) else [colours[0]] * len(offsets)  # one colour for all
        visible |= {tuple(offset) for offset, colour in zip(offsets, colours, strict=True) if colour[3] > 0}
    assert visible == {(90.0, 21.0), (90.0, 24.0), (270.0, 20.0)}
    assert "TPOT not measured" in [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_pareto_front_keeps_only_undominated_points():
    assert compare.pareto_front([(90.0, 21.0), (90.0, 24.0), (270.0, 20.0), (300.0, 25.0)]) == [0, 2]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("colour=red", "unknown key 'colour'"),
        ("since=yesterday", "since='yesterday': give a date as YYYY-MM-DD"),
        ("kind=sweep", "kind='sweep': choose run or gate or search-trial"),
        ("limit=many", "limit='many': give an integer"),
    ],
)
def test_bad_argument_is_a_usage_error(argument, message, capsys):
    assert compare.main([argument]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and message in errors[0]


def test_search_trials_are_squares_coloured_by_their_verdict(store):
    from matplotlib.colors import to_rgba

    from compress.app.tracking import tracking_uri

    parent = RunLog(tracking_uri(), "compress", "search", tags={"compress.kind": "search"})
    for number, (size, ppl, passed) in enumerate([(60.0, 30.0, 0.0), (75.0, 22.0, 1.0)], start=1):
        tags = {"compress.kind": "search-trial", "compress.recipe": f"gptq_int4 search #{number}"}
        trial = RunLog(tracking_uri(), "compress", f"trial-{number}", tags, parent.run_id)
        trial.metrics({"size_mb": size, "gate.ppl_candidate": ppl, "gate.passed": passed})
        trial.finish()
    assert trial.client.get_run(trial.run_id).data.tags["mlflow.parentRunId"] == parent.run_id
    figure = compare.pareto_figure(compare.load_rows(None, None, None, None, 100))
    squares = {
        collection.get_label(): (collection.get_offsets().tolist(), tuple(collection.get_facecolors()[0]))
        for collection in figure.axes[0].collections
        if collection.get_label().startswith("search trial")
    }
    assert squares == {
        "search trial: pass": ([[75.0, 22.0]], to_rgba("tab:green")),
        "search trial: BLOCK": ([[60.0, 30.0]], to_rgba("tab:red")),
    }
