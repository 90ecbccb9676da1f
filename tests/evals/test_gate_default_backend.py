"""The release gate with its default generation backend (``backend: auto``, which resolves to ``compress.engine``):
every other gate test pins ``backend=transformers``, so this is the one that runs the engine through the gate end to
end, on an int4 checkpoint the engine serves from its packed weights (the quick gate's ``cpu_dense_weights: false``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import pydoc_tokenizer, save, tiny_model_for

from compress.checkpoint import save_checkpoint
from compress.commands import gate as gate_command
from compress.compression.in_memory import compress_model


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch, empty_mlflow_db):
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    monkeypatch.setenv("COMPRESS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # The engine as a CPU machine runs it: its `auto` attention and KV writes pick Triton under the interpreter the
    # suite sets (tests/conftest.py), which is 50x slower (json + needle: 46 s against 1.6 s), and torch without it.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _replies(report: dict, side: str) -> list[str]:
    [layer] = [layer for layer in report["layers"] if layer["name"] == "json"]
    return [sample["reply"] for sample in layer["metrics"][side]["samples"]]


def test_the_default_backend_runs_the_engine_through_the_whole_gate(tmp_path):
    tokenizer = pydoc_tokenizer()
    base = save(tiny_model_for(tokenizer), tokenizer, tmp_path / "base")
    model = tiny_model_for(tokenizer)
    compress_model(model, [{"type": "rtn", "bits": 8, "group_size": 32}], torch.zeros(1, 4, dtype=torch.long), "cpu")
    save_checkpoint(model, tokenizer, tmp_path / "int8")

    common = [f"checkpoint={tmp_path / 'int8'}", f"baseline={base}", "gate=quick", "gate.registry.register=false"]
    assert gate_command.main([*common, f"out={tmp_path / 'gate'}"]) == 0  # no backend named: the policy's default
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert report["policy"]["backend"] == "auto" and report["backend"] == "engine"
    assert report["verdict"] == "pass", report["reasons"]
    statuses = {layer["name"]: layer["status"] for layer in report["layers"]}
    assert statuses["perplexity"] == statuses["kl"] == "pass"
    for name in ("json", "needle", "latency"):  # the layers that generate, measured (a random model cannot be judged)
        assert statuses[name] in ("pass", "cannot_judge", "warn"), (name, statuses[name])
    assert "generation backend: `engine`" in (tmp_path / "gate" / "gate.md").read_text()

    # the engine's greedy replies are the transformers loop's on the same prompts and checkpoints
    tf = [*common, f"out={tmp_path / 'tf'}", "gate.backend=transformers", "gate.layers=[perplexity,json]"]
    assert gate_command.main(tf) == 0
    theirs = json.loads((tmp_path / "tf" / "gate.json").read_text())
    assert theirs["backend"] == "transformers"
    for side in ("candidate", "baseline"):
        assert _replies(report, side) == _replies(theirs, side), side
