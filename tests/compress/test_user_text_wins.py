"""Every recipe that samples its calibration windows (a data group with ``generated > 0``: ``sampled``,
``half_sampled``) calibrates on the user's text instead as soon as the user names one, through the Python API and the
command line alike; sampling only when asked for (``data.generated=...``)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from helpers import adapters_for

from compress import api
from compress.__main__ import main
from compress.app.recipe import available, compose
from compress.base.data import tokenize
from compress.base.paths import recipes_dir
from compress.model.sources import load


def _samples(name: str) -> bool:
    """Its file selects a data group whose windows are (partly) sampled: read from the files' text (composing every
    recipe at collection would cost seconds); the first test checks it."""
    found = re.search(r"override data: (\w+)", (recipes_dir() / f"{name}.yaml").read_text())
    return bool(found) and yaml.safe_load((recipes_dir() / "data" / f"{found[1]}.yaml").read_text())["generated"] > 0


SAMPLING_RECIPES = [name for name in available() if _samples(name)]
SMALL = ["data.num_samples=3", "data.seq_len=16"]
SMALL_DISTILL = {"steps": 2, "seq_len": 16, "held_out": 1, "batch_size": 2}  # keeps a distill stage to a second
MY_TEXT = [f"my own workload, line {i}: the quick brown fox jumps over the lazy dog." for i in range(60)]


def test_every_recipe_that_samples_is_listed():
    sampling = [name for name in available() if compose(name, adapters_for(name)).data.generated > 0]
    shipped_sampling = {"awq_int4", "rotate_gptq_int4", "autoround_int4", "autoround_int3", "rotate_autoround_int4"}
    assert sampling == SAMPLING_RECIPES and shipped_sampling <= set(sampling)


def _small(recipe: str) -> list[str]:
    stages = compose(recipe).stages
    distill = [i for i, stage in enumerate(stages) if stage["type"] == "distill"]
    return [*SMALL, *(f"stages.{i}.{key}={value}" for i in distill for key, value in SMALL_DISTILL.items())]


def _calibrated_on(monkeypatch) -> list[torch.Tensor]:
    """The calibration ids ``oneshot`` hands to the compression (recorded, then passed on unchanged)."""
    seen = []
    real = api.compress_model

    def recording(model, stages, samples, *args, **kwargs):
        seen.append(samples.clone())
        return real(model, stages, samples, *args, **kwargs)

    monkeypatch.setattr(api, "compress_model", recording)
    return seen


def _windows_of(ids: torch.Tensor, text_ids: list[int]) -> bool:
    """Every row of ``ids`` is a run of consecutive tokens of the text."""
    joined = " " + " ".join(map(str, text_ids)) + " "
    return all(" " + " ".join(map(str, row.tolist())) + " " in joined for row in ids)


@pytest.mark.parametrize("recipe", SAMPLING_RECIPES)
def test_oneshot_calibrates_on_the_given_strings(recipe, tiny_model_dir, tmp_path, artifacts, monkeypatch):
    seen = _calibrated_on(monkeypatch)
    checkpoint = api.oneshot(
        str(tiny_model_dir), recipe, data=MY_TEXT, overrides=_small(recipe), output_dir=tmp_path / "out"
    )
    assert (checkpoint / "model.safetensors").is_file()
    assert not (artifacts / "calibration").exists()  # nothing sampled
    [samples] = seen
    _, tokenizer = load(str(tiny_model_dir))
    assert samples.shape == (3, 16) and _windows_of(samples, tokenize(tokenizer, "\n\n".join(MY_TEXT)).tolist())


def test_oneshot_calibrates_on_the_given_file(tiny_model_dir, tmp_path, artifacts, monkeypatch):
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in MY_TEXT))
    seen = _calibrated_on(monkeypatch)
    api.oneshot(str(tiny_model_dir), "awq_int4", data=str(corpus), overrides=SMALL, output_dir=tmp_path / "out")
    assert not (artifacts / "calibration").exists()
    [samples] = seen
    _, tokenizer = load(str(tiny_model_dir))
    assert _windows_of(samples, tokenize(tokenizer, "\n\n".join(MY_TEXT)).tolist())


def test_oneshot_samples_a_share_of_the_given_text_only_when_asked(tiny_model_dir, tmp_path, artifacts, monkeypatch):
    seen = _calibrated_on(monkeypatch)
    overrides = ["data.num_samples=4", "data.seq_len=16", "data.generated=0.5"]
    api.oneshot(str(tiny_model_dir), "awq_int4", data=MY_TEXT, overrides=overrides, output_dir=tmp_path / "out")
    [samples] = seen
    _, tokenizer = load(str(tiny_model_dir))
    text_ids = tokenize(tokenizer, "\n\n".join(MY_TEXT)).tolist()
    assert _windows_of(samples[:2], text_ids) and not _windows_of(samples[2:], text_ids)
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 1


@pytest.mark.parametrize("recipe", SAMPLING_RECIPES)
def test_the_command_line_calibrates_on_the_named_file(recipe, tiny_model_dir, tmp_path, artifacts):
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in MY_TEXT * 4))
    small = [*_small(recipe), "eval.seq_len=16", "eval.max_windows=2", "gate=none", "tracking.enabled=false"]
    assert (
        main(["run", f"recipe={recipe}", f"model={tiny_model_dir}", f"data={corpus}", *small, f"output.dir={tmp_path}"])
        == 0
    )
    [report] = tmp_path.glob("*/report.json")
    data = json.loads(report.read_text())["data"]
    assert (data["source"], data["calibration_tokens"], data["generated_tokens"]) == ("file", 48, 0)
    assert not (artifacts / "calibration").exists()
