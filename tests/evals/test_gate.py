"""The release gate end to end on tiny random Llama models with a real BPE tokenizer, a real lm-eval run and a real
MLflow sqlite store."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import pydoc_tokenizer, save, scale_by_noise, small_gate_policy, tiny_model_for

from compress.app.tracking import tracking_uri
from compress.base.data import DataSpec, load_corpus
from compress.base.errors import CompressError
from compress.commands import gate as gate_command
from compress.evals.gate import run_gate


def client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri(), registry_uri=tracking_uri())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "base": save(tiny_model_for(tokenizer), tokenizer, root / "base"),
        "broken": save(scale_by_noise(tiny_model_for(tokenizer)), tokenizer, root / "broken"),
    }


@pytest.fixture
def made_store(tmp_path, empty_mlflow_db):
    """The test's store made already: the first test's gate makes its own, the others need not pay MLflow for it."""
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


def test_unchanged_model_passes_against_itself_and_is_registered(checkpoints, tmp_path):
    out = tmp_path / "gate"
    code = gate_command.main(
        [
            f"checkpoint={checkpoints['base']}",
            f"baseline={checkpoints['base']}",
            "gate=quick",
            f"out={out}",
            "promote=true",
            "gate.registry.name=tiny-llama",
            "gate.backend=transformers",
        ]
    )
    assert code == 0
    report = json.loads((out / "gate.json").read_text())
    assert report["passed"] and report["verdict"] == "pass"
    layers = {layer["name"]: layer for layer in report["layers"]}
    assert list(layers) == ["perplexity", "kl", "lm_eval", "json", "needle", "long_context", "latency"]
    assert layers["perplexity"]["status"] == layers["kl"]["status"] == "pass"
    assert layers["perplexity"]["estimate"] == pytest.approx(1.0) and layers["kl"]["estimate"] == pytest.approx(0.0)
    # a random model answers ARC-Easy at chance: the accuracy layer says it cannot judge instead of passing
    assert layers["lm_eval"]["status"] in ("pass", "cannot_judge")
    arc = layers["lm_eval"]["metrics"]["candidate"]["compress_arc_easy"]
    assert len(arc["outcomes"]["acc"]) == 200 and 0.24 <= arc["chance"] <= 0.26
    assert (out / "needle_heatmap.png").stat().st_size > 0
    assert "# Release gate: PASSED" in (out / "gate.md").read_text()

    store = client()
    candidate = store.get_model_version_by_alias("tiny-llama", "candidate")
    champion = store.get_model_version_by_alias("tiny-llama", "champion")
    assert int(candidate.version) == int(champion.version) == 1
    assert candidate.source == f"runs:/{candidate.run_id}/checkpoint"  # the registry holds the files, not a path
    import mlflow

    downloaded = Path(
        mlflow.artifacts.download_artifacts(
            candidate.source, tracking_uri=tracking_uri(), dst_path=str(tmp_path / "download")
        )
    )
    assert sorted(p.name for p in checkpoints["base"].iterdir()) == sorted(p.name for p in downloaded.iterdir())
    run = store.get_run(candidate.run_id)
    assert run.data.tags["compress.kind"] == "gate"
    assert run.data.metrics["gate.passed"] == 1.0
    assert run.data.metrics["gate.ppl_ratio"] == pytest.approx(1.0)
    assert {"gate.needle_accuracy", "gate.json_validity", "gate.json_schema_compliance", "gate.tpot_ratio"} <= set(
        run.data.metrics
    )


@pytest.mark.usefixtures("made_store")
def test_broken_checkpoint_is_blocked_by_the_perplexity_layer(checkpoints, tmp_path):
    out = tmp_path / "gate"
    code = gate_command.main(
        [
            f"checkpoint={checkpoints['broken']}",
            f"baseline={checkpoints['base']}",
            "gate=quick",
            f"out={out}",
            "gate.backend=transformers",
        ]
    )
    assert code == 1
    report = json.loads((out / "gate.json").read_text())
    statuses = {layer["name"]: layer["status"] for layer in report["layers"]}
    assert statuses == {
        "perplexity": "fail",
        "kl": "skipped",
        "lm_eval": "skipped",
        "json": "skipped",
        "needle": "skipped",
        "long_context": "skipped",
        "latency": "skipped",
    }
    pattern = r"perplexity ×[\d.]+ \(95% CI [\d.]+–[\d.]+\) > the 1\.05× limit: BLOCK"
    assert re.fullmatch(pattern, report["reasons"][0]), report["reasons"][0]
    assert report["verdict"] == "block" and report["layers"][0]["low"] > 1.05
    markdown = (out / "gate.md").read_text()
    assert "# Release gate: BLOCKED" in markdown and report["reasons"][0] in markdown
    assert report["registry"] is None
    assert client().search_registered_models() == []


def test_an_evaluator_that_raises_blocks(tokenizer, tmp_path):
    """Fail closed: NaN weights make the perplexity evaluator raise, and the gate blocks instead of skipping it."""
    baseline = tiny_model_for(tokenizer)
    candidate = tiny_model_for(tokenizer)
    with torch.no_grad():
        candidate.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    policy = {
        "layers": ["perplexity", "json"],
        "backend": "transformers",
        "perplexity": {"seq_len": 64, "max_windows": 2},
    }
    texts = load_corpus(DataSpec()).evaluation
    result = run_gate(candidate, baseline, policy, tmp_path, evaluation_texts=texts, candidate_tokenizer=tokenizer)
    assert not result.passed
    assert [layer.status for layer in result.layers] == ["error", "skipped"]
    assert "evaluator error (fail closed): FloatingPointError" in result.reasons[0]
    assert result.to_dict()["layers"][0]["error"].startswith("FloatingPointError")


def test_unknown_policy_key_is_a_usage_error(checkpoints, capsys):
    code = gate_command.main(
        [f"checkpoint={checkpoints['base']}", f"baseline={checkpoints['base']}", "gate.perplexity.max_ratoi=1.1"]
    )
    assert code == 2
    assert "gate.perplexity: unknown key 'max_ratoi' (did you mean 'max_ratio'?)" in capsys.readouterr().err


def test_a_policy_passed_to_the_library_is_refused_in_the_cli_s_words(checkpoints, tmp_path):
    """run_gate reads a policy mapping with the same one-line key and type errors as the command line."""
    texts = load_corpus(DataSpec()).evaluation
    with pytest.raises(CompressError, match=r"^gate.needle.trials='many' has the wrong type: give an integer$"):
        run_gate(
            checkpoints["base"], checkpoints["base"], {"needle": {"trials": "many"}}, tmp_path, evaluation_texts=texts
        )


@pytest.mark.usefixtures("made_store")
def test_disabled_gate_checks_nothing(checkpoints, tmp_path):
    code = gate_command.main(
        [f"checkpoint={checkpoints['base']}", f"baseline={checkpoints['base']}", "gate=none", f"out={tmp_path}"]
    )
    assert code == 0
    assert json.loads((tmp_path / "gate.json").read_text())["layers"] == []
    assert client().search_registered_models() == []  # "nothing is checked and nothing is registered"


@pytest.mark.usefixtures("made_store")
@pytest.mark.parametrize(
    "layers",
    [["gate.layers=[]"], ["gate.layers=[perplexity,json]", "gate.perplexity.enabled=false", "gate.json.enabled=false"]],
)
def test_a_gate_that_ran_no_check_blocks(checkpoints, tmp_path, layers):
    code = gate_command.main(
        [
            f"checkpoint={checkpoints['base']}",
            f"baseline={checkpoints['base']}",
            "gate=quick",
            f"out={tmp_path}",
            *layers,
        ]
    )
    assert code == 1
    report = json.loads((tmp_path / "gate.json").read_text())
    assert not report["passed"] and report["reasons"][0].startswith("no check ran")
    assert client().search_registered_models() == []


@pytest.mark.usefixtures("made_store")
def test_a_gate_whose_limits_are_all_null_blocks(checkpoints, tmp_path):
    code = gate_command.main(
        [
            f"checkpoint={checkpoints['base']}",
            f"baseline={checkpoints['base']}",
            "gate=quick",
            f"out={tmp_path}",
            "gate.layers=[perplexity]",
            "gate.perplexity.max_ratio=null",
        ]
    )
    assert code == 1
    assert "every limit set to null" in json.loads((tmp_path / "gate.json").read_text())["reasons"][0]


@pytest.mark.parametrize("models_in_memory", [1, 2])
def test_the_gate_holds_as_many_models_as_its_policy_allows(checkpoints, tmp_path, monkeypatch, models_in_memory):
    """With one model in memory the baseline is measured on every layer and freed before the candidate loads; with two
    both stay loaded and latency is timed interleaved. Both judge the same metrics."""
    import gc
    import weakref

    from compress.evals import sides

    alive, most_alive = [], [0]
    real_load = sides.load_for_eval

    def counting_load(source):
        gc.collect()
        model, tokenizer = real_load(source)
        alive.append(weakref.ref(model))
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in alive))
        return model, tokenizer

    monkeypatch.setattr(sides, "load_for_eval", counting_load)
    policy = small_gate_policy(models_in_memory)
    texts = load_corpus(DataSpec()).evaluation
    result = run_gate(checkpoints["base"], checkpoints["base"], policy, tmp_path, evaluation_texts=texts)
    assert most_alive[0] == models_in_memory
    assert len(alive) == 2  # each side loaded once
    assert result.layers[0].status == "pass" and result.layers[1].metrics["candidate"]["outcomes"]
    assert result.metric("perplexity", "perplexity") == result.metric("perplexity", "perplexity", "baseline")
    assert result.layers[2].metrics["interleaved"] is (models_in_memory == 2)
    assert result.layers[2].metrics["tpot_ratio"] > 0


def test_models_in_memory_other_than_one_or_two_is_a_policy_error(checkpoints, tmp_path):
    texts = load_corpus(DataSpec()).evaluation
    with pytest.raises(CompressError, match="models_in_memory=3"):
        run_gate(checkpoints["base"], checkpoints["base"], {"models_in_memory": 3}, tmp_path, evaluation_texts=texts)


@pytest.mark.usefixtures("made_store")
def test_a_baseline_with_another_tokenizer_is_refused_before_any_evaluation(checkpoints, tmp_path, monkeypatch):
    """Both sides are scored on the candidate's token ids: a baseline of another vocabulary would make perplexity and
    KL meaningless, and could pass. One line naming both tokenizers, the usage-error code, no model loaded."""
    from helpers import build_tiny_tokenizer

    from compress.evals import sides

    other = build_tiny_tokenizer(vocab_size=400)
    baseline = save(tiny_model_for(other), other, tmp_path / "other-family")

    def no_loading(source):
        raise AssertionError(f"loaded {source} although the baseline could not be judged against")

    monkeypatch.setattr(sides, "load_for_eval", no_loading)
    texts = load_corpus(DataSpec()).evaluation
    with pytest.raises(sides.MismatchedTokenizers, match=r"vocabularies differ \(384 and 400 tokens\)"):
        run_gate(checkpoints["base"], baseline, {"layers": ["perplexity"]}, tmp_path / "d", evaluation_texts=texts)
    out = tmp_path / "gate"
    code = gate_command.main([f"checkpoint={checkpoints['base']}", f"baseline={baseline}", "gate=quick", f"out={out}"])
    assert code == 2
    assert not (out / "gate.json").exists()


def test_tokenizers_with_one_vocabulary_but_other_splits_are_told_apart():
    from compress.evals.sides import MismatchedTokenizers, check_same_tokenization

    tokenizer = pydoc_tokenizer()
    check_same_tokenization(tokenizer, pydoc_tokenizer(), "def f(x):\n    return x")
    reordered = pydoc_tokenizer()
    reordered.backend_tokenizer.model = type(tokenizer.backend_tokenizer.model)(vocab=tokenizer.get_vocab(), merges=[])
    with pytest.raises(MismatchedTokenizers, match="split the evaluation text"):
        check_same_tokenization(tokenizer, reordered, "def f(x):\n    return x")
