"""Calibration windows sampled from the model itself (``data.generated``): mixed with text windows, reproducible,
cached per model, and refused with one clear error when the share is out of range."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_model, build_tiny_tokenizer

from compress.__main__ import main
from compress.api import oneshot
from compress.base.data import DataSpec
from compress.base.errors import CompressError
from compress.model import calibration_set as module
from compress.model.calibration_set import calibration_set, sampled_windows
from compress.model.sources import load

TEXT = " ".join(f"word{i % 37}" for i in range(3000))


def _spec(generated: float, num_samples: int = 4) -> DataSpec:
    return DataSpec(num_samples=num_samples, seq_len=24, generated=generated)


def test_a_share_of_the_windows_is_sampled_from_the_model_and_the_rest_cut_from_text(artifacts):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer), bos_token_id=0)
    text_only = calibration_set(model, tokenizer, TEXT, _spec(0.0), seed=0)
    mixed = calibration_set(model, tokenizer, TEXT, _spec(0.5), seed=0)
    assert mixed.shape == text_only.shape == (4, 24)
    cut = set(map(tuple, text_only.tolist()))
    assert sum(tuple(row) in cut for row in mixed.tolist()) == 2  # two text windows, two sampled ones
    sampled = mixed[2:]
    assert (sampled[:, 0] == 0).all() and sampled.max() < model.config.vocab_size
    assert len({tuple(row) for row in sampled.tolist()}) == 2  # not one sequence twice


def test_sampling_is_reproducible_by_seed_and_cached_per_model(artifacts, monkeypatch):
    model = build_tiny_llama(bos_token_id=0)
    first = sampled_windows(model, 3, 16, seed=0, start=0)
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 1
    with monkeypatch.context() as patch:
        for sampler in ("_sample", "_sample_engine"):
            patch.setattr(module, sampler, lambda *args: pytest.fail("sampled again instead of reading the cache"))
        assert torch.equal(sampled_windows(model, 3, 16, seed=0, start=0), first)
    assert not torch.equal(sampled_windows(model, 3, 16, seed=1, start=0), first)
    other = build_tiny_llama(seed=5, bos_token_id=0)  # other weights: its own windows, not the first model's cache
    assert not torch.equal(sampled_windows(other, 3, 16, seed=0, start=0), first)
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 3


def test_a_smaller_count_reuses_the_batches_of_a_larger_one(artifacts, monkeypatch):
    model = build_tiny_llama(bos_token_id=0)
    monkeypatch.setattr(module, "SAMPLING_BATCH", 2)
    first = sampled_windows(model, 5, 8, seed=0, start=0)
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 3  # batches of 2, 2 and 1
    with monkeypatch.context() as patch:
        for sampler in ("_sample", "_sample_engine"):
            patch.setattr(module, sampler, lambda *args: pytest.fail("sampled again instead of reading the cache"))
        assert torch.equal(sampled_windows(model, 4, 8, seed=0, start=0), first[:4])


@pytest.mark.parametrize(
    ("sampler", "family"), [("_sample", "llama"), ("_sample", "gemma3"), ("_sample_engine", "llama")]
)
def test_batches_decoded_together_are_the_batches_sampled_alone(sampler, family, monkeypatch):
    monkeypatch.setattr(module, "SAMPLING_BATCH", 2)
    model, sample = build_tiny_model(family), getattr(module, sampler)
    alone = [sample(model, size, 12, seed=seed, start=1) for size, seed in [(2, 3), (2, 5), (1, 7)]]
    assert torch.equal(sample(model, 5, 12, seed=3, start=1), torch.cat(alone))


def test_consecutive_missing_batches_are_decoded_together_and_cached_one_by_one(artifacts, monkeypatch):
    model = build_tiny_llama(bos_token_id=0)
    monkeypatch.setattr(module, "SAMPLING_BATCH", 2)
    monkeypatch.setattr(module, "DECODE_BATCHES", 2)
    middle = sampled_windows(model, 2, 8, seed=2, start=0)  # the batch of seed 2 is cached, those of 0 and 4 are not
    calls, real = [], module._sample
    monkeypatch.setattr(module, "_sample", lambda m, count, *args: calls.append(count) or real(m, count, *args))
    windows = sampled_windows(model, 5, 8, seed=0, start=0)
    assert calls == [2, 1] and torch.equal(windows[2:4], middle)  # not consecutive: one decode each
    calls.clear()
    assert sampled_windows(model, 6, 8, seed=10, start=0).shape == (6, 8)
    assert calls == [4, 2]  # seeds 10 and 12 together, then 14
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 6  # every batch its own entry
    calls.clear()
    assert torch.equal(sampled_windows(model, 5, 8, seed=0, start=0), windows) and calls == []


def test_a_gemma_model_samples_from_its_bos(artifacts):
    model = build_tiny_model("gemma3")
    windows = calibration_set(model, None, "", _spec(1.0, num_samples=2), seed=0)
    assert (windows[:, 0] == model.config.bos_token_id).all()


def test_a_lazily_loaded_model_holds_no_layer_after_sampling(tiny_model_dir, artifacts):
    model, tokenizer = load(str(tiny_model_dir))
    assert model.lazy_weights.loaded == set()
    calibration_set(model, tokenizer, TEXT, _spec(0.5), seed=0)
    assert model.lazy_weights.loaded == set()


@pytest.mark.parametrize("share", ["1.5", "-0.1"])
def test_a_share_out_of_range_is_refused_before_any_work(share, tmp_path):
    with pytest.raises(CompressError, match=f"data.generated={float(share)} must be a share between 0 and 1"):
        oneshot(build_tiny_llama(), "rtn_int4", overrides=[f"data.generated={share}"], output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_reports_how_many_calibration_tokens_the_model_sampled(tiny_model_dir, tmp_path, artifacts):
    small = ["data.num_samples=4", "data.seq_len=32", "eval.seq_len=32", "eval.max_windows=2", "gate=none"]
    args = ["run", "recipe=gptq_int4", f"model={tiny_model_dir}", *small, "tracking.enabled=false"]
    assert main([*args, "stages.0.group_size=32", "data.generated=0.25", f"output.dir={tmp_path}"]) == 0
    [report] = tmp_path.glob("*/report.json")
    data = json.loads(report.read_text())["data"]
    assert (data["calibration_tokens"], data["generated_tokens"]) == (128, 32)
    summary = (report.parent / "report.md").read_text()
    assert "128 calibration tokens (pydoc; 32 of them sampled from the model)" in summary


def test_oneshot_calibrates_on_sampled_windows(tiny_model_dir, tmp_path, artifacts):
    overrides = ["data.num_samples=2", "data.seq_len=32", "data.generated=0.5", "stages.0.group_size=32"]
    checkpoint = oneshot(str(tiny_model_dir), "gptq_int4", overrides=overrides, output_dir=tmp_path / "gptq")
    assert (checkpoint / "model.safetensors").is_file()
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 1


def test_a_chain_that_reads_no_calibration_samples_nothing(tiny_model_dir, tmp_path, artifacts, caplog):
    """rtn_int4 reads no calibration inputs: sampling would cost minutes on the default model for windows nobody
    reads, so the share is dropped with one line, and the report counts no sampled token."""
    small = ["data.num_samples=4", "data.seq_len=32", "eval.seq_len=32", "eval.max_windows=2", "gate=none"]
    args = ["run", "recipe=rtn_int4", f"model={tiny_model_dir}", *small, "tracking.enabled=false"]
    with caplog.at_level("INFO"):
        assert main([*args, "stages.0.group_size=32", "data.generated=1.0", f"output.dir={tmp_path}"]) == 0
    assert not (artifacts / "calibration").exists()
    [report] = tmp_path.glob("*/report.json")
    assert json.loads(report.read_text())["data"]["generated_tokens"] == 0
    assert "data.generated=1.0 is not used: no stage of rtn_int4 reads calibration inputs" in caplog.text
    checkpoint = oneshot(str(tiny_model_dir), "rtn_int4", overrides=["data.generated=1.0"], output_dir=tmp_path / "o")
    assert (checkpoint / "model.safetensors").is_file() and not (artifacts / "calibration").exists()


def test_the_rotation_and_awq_recipes_calibrate_on_samples_until_the_user_names_a_text(tmp_path):
    """rotate_gptq_int4, rotate_gptq_int3, awq_int4 and awq_int4_kv_int8 ship with `data: sampled` (the figures
    docs/results.md measured with data.generated=1.0); any data option a user names replaces the whole group, so
    their text is not silently ignored for samples."""
    from compress.app.recipe import compose, resolve_shortcuts

    corpus = tmp_path / "mine.jsonl"
    corpus.write_text(json.dumps({"text": "my own workload"}) + "\n")
    for recipe in ("rotate_gptq_int4", "rotate_gptq_int3", "awq_int4", "awq_int4_kv_int8"):
        assert compose(recipe).data == DataSpec(source="pydoc", generated=1.0, num_samples=32)
        for named in (["data=pydoc"], resolve_shortcuts([f"data={corpus}"])):
            assert compose(recipe, named).data.generated == 0.0
    assert compose("gptq_int4").data.generated == 0.0  # the other recipes still cut pydoc windows
    assert compose("gptq_int4", ["data=sampled"]).data == compose("rotate_gptq_int4").data


def test_awq_int4_kv_int8_runs_awq_int4s_weight_stage_on_its_calibration():
    """Its name promises awq_int4 plus an int8 KV cache: the same weight stage, the same calibration (the weights
    themselves differ past the first layer: test_the_layers_after_a_kv_cache_stage_calibrate_on_its_quantized_cache)."""
    from compress.app.recipe import compose

    with_kv, plain = compose("awq_int4_kv_int8"), compose("awq_int4")
    assert with_kv.stages[0] == plain.stages[0] and with_kv.data == plain.data
    assert [stage["type"] for stage in with_kv.stages] == ["awq", "kv_cache"]


def test_the_layers_after_a_kv_cache_stage_calibrate_on_its_quantized_cache():
    """The walk feeds each layer the previous layer's outputs as the compressed model computes them, KV cache
    quantized: awq_int4_kv_int8's first layer is awq_int4's, its later layers are calibrated on what int8 K/V make
    of their inputs (as the model will run), so their weights differ from awq_int4's."""
    from compress.app.recipe import compose
    from compress.compression.in_memory import compress_model
    from compress.stages import build_chain

    samples = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    packed = {}
    for recipe in ("awq_int4", "awq_int4_kv_int8"):
        model = build_tiny_llama(num_hidden_layers=2, tie_word_embeddings=False)
        compress_model(model, build_chain(compose(recipe, ["stages.0.group_size=32"]).stages), samples, batch_size=2)
        packed[recipe] = {k: v for k, v in model.state_dict().items() if k.endswith("weight_packed")}
    plain, with_kv = packed.values()
    differs = {key.split(".")[2] for key in plain if not torch.equal(plain[key], with_kv[key])}
    assert differs == {"1"}
