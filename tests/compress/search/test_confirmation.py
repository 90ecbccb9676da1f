"""The sealed confirmation of ``compress search``: its windows are disjoint from the trials' windows, a choice that
fails it is not a pass, and the record (search.json, search.md, MLflow) holds its verdict."""

from __future__ import annotations

import json

import pytest

from compress.commands.run import validate
from compress.evals.gate.windows import SEALED, SEARCH, WindowSplit, spread_order
from compress.search import SearchSpec, run_search

PERPLEXITY_GATE = ["gate=quick", "gate.layers=[perplexity]"]
SMALL = ["data.num_samples=4", "data.seq_len=64", "eval.data=null"]


@pytest.mark.parametrize("available", [5, 12, 53, 1200])
def test_the_sealed_windows_are_disjoint_from_the_search_windows_and_together_every_window(available):
    search, sealed = (WindowSplit(part, 0.4).positions(available) for part in (SEARCH, SEALED))
    assert not set(search) & set(sealed) and sorted(search + sealed) == list(range(available))
    assert len(sealed) == round(0.4 * available) and search == spread_order(available)[: len(search)]


def _gate_positions(folder) -> list[int]:
    gate = json.loads(folder.joinpath("gate.json").read_text())
    [perplexity] = [layer for layer in gate["layers"] if layer["name"] == "perplexity"]
    return perplexity["metrics"]["protocol"]["window_positions"]


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_confirmed_choice_was_gated_on_windows_no_trial_scored(tiny_model_dir, artifacts):
    from mlflow import MlflowClient

    overrides = [f"model={tiny_model_dir}", *SMALL, *PERPLEXITY_GATE, "gate.perplexity.max_ratio=100"]
    _, [config] = validate("rtn_int4", overrides, multirun=False)
    spec = SearchSpec(budget_bits=16.0, candidates=["int8", "bf16"], max_trials=1, start_bits=16.0)
    result = run_search(config, spec, artifacts / "search")
    assert result.passed and result.exit_code == 0 and result.confirmation.passed, result.line
    trial_windows = _gate_positions(artifacts / "search" / "trial-1" / "gate")
    sealed_windows = _gate_positions(artifacts / "search" / "confirmation")
    assert sealed_windows == result.confirmation.window_positions and len(sealed_windows) >= 2
    assert not set(trial_windows) & set(sealed_windows)
    saved = json.loads((artifacts / "search" / "search.json").read_text())
    assert saved["passed"] and saved["confirmation"]["verdict"] == "pass"
    assert (
        "confirmed on" in result.line and "Confirmation of trial 1" in (artifacts / "search" / "search.md").read_text()
    )
    parent = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert parent.data.tags["compress.search.confirmation"] == "pass" and parent.data.metrics["passed"] == 1


@pytest.mark.usefixtures("default_mlflow_store")
def test_a_choice_that_fails_its_confirmation_is_not_a_pass(tiny_model_dir, artifacts):
    """The perplexity limit set between the trial's ratio on its windows and its ratio on the sealed ones: the trial
    passes, its confirmation blocks, and the search is not passed, nothing is registered, the record says why."""
    from mlflow import MlflowClient

    spec = SearchSpec(budget_bits=4.0, candidates=["int3_g64", "int4_g64"], max_trials=1)
    base = [f"model={tiny_model_dir}", *SMALL, *PERPLEXITY_GATE, "gate.confidence=0.5"]
    _, [measure] = validate("rtn_int4", [*base, "gate.perplexity.max_ratio=100"], multirun=False)
    measured = run_search(measure, spec, artifacts / "measure")
    searched, sealed = measured.trials[0].ppl_interval[1], measured.confirmation.ppl_interval[1]
    # the limit between the upper ends of the two intervals (at a low confidence, so they stay narrow)
    assert searched < sealed, "the tiny model's sealed windows must be the harder ones to plant a failure"
    limit = (searched + sealed) / 2
    _, [config] = validate("rtn_int4", [*base, f"gate.perplexity.max_ratio={limit!r}"], multirun=False)
    result = run_search(config, spec, artifacts / "planted")
    assert result.trials[0].passed  # on the search's windows; gate.decide may add sealed ones below
    assert not result.passed and result.outcome == "unconfirmed" and result.exit_code in (1, 3)
    assert result.line.startswith("search: NOT CONFIRMED — the chosen checkpoint ")
    saved = json.loads((artifacts / "planted" / "search.json").read_text())
    assert not saved["passed"] and saved["confirmation"]["verdict"] in ("block", "inconclusive")
    parent = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert parent.data.metrics["passed"] == 0 and parent.data.metrics["confirmation_passed"] == 0
    assert "compress.search.registered" not in parent.data.tags
