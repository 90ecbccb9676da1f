"""The shipped models' one-time conversion stages like every other output (compress.base.staging): labelled with its
process so a killed conversion's folder is swept by the next one, flushed to disk before the rename, and done once
when two runs on a fresh machine ask for the model at the same time. The GGUF loaders are replaced by a tiny model:
what is under test is the staging and the lock, not the dequantization (tests/compress/test_models.py, slow)."""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import sys
import time

import pytest
import transformers

from compress.base.staging import STAGING_OWNER
from compress.model import sources


@pytest.fixture
def tiny_gguf(tiny_model_dir, tmp_path, monkeypatch):
    """``convert_gguf`` reads the tiny model where it would read a GGUF."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    gguf = tmp_path / "source" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    return gguf


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_killed_conversion_s_folder_is_swept_by_the_next_and_nothing_else_is_left(tiny_gguf, tmp_path):
    models = tmp_path / "models"
    stale = models / ".smollm2-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a model")
    (stale / STAGING_OWNER).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    sources.convert_gguf(tiny_gguf, models / "smollm2")
    assert sorted(p.name for p in models.iterdir()) == ["smollm2"]
    assert not (models / "smollm2" / STAGING_OWNER).exists()
    assert (models / "smollm2" / "config.json").is_file()


def _ask_for_the_default_model() -> None:
    sources.default_model_dir()


def test_two_runs_on_a_fresh_machine_convert_the_default_model_once(artifacts, tmp_path, monkeypatch):
    calls = tmp_path / "conversions.log"

    def slow_conversion(gguf, target):
        with calls.open("a") as log:
            log.write(f"{target}\n")
        time.sleep(1.0)  # long enough that the second run asks while the first converts
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr(sources, "convert_gguf", slow_conversion)
    monkeypatch.setattr(sources, "smollm2_gguf_path", lambda: tmp_path / "model.gguf")
    context = multiprocessing.get_context("fork")  # the children keep this test's replacements
    runs = [context.Process(target=_ask_for_the_default_model) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(30)
    assert [run.exitcode for run in runs] == [0, 0]
    assert len(calls.read_text().splitlines()) == 1
