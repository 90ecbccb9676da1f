"""Calibration windows are sampled on the run's device, through the engine's batched decode where it runs the
model's family, and both sampling paths draw exactly temperature-1 samples of the model's next-token distribution."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_tiny_llama

from compress.__main__ import main
from compress.api import oneshot
from compress.model import calibration_set as module
from compress.model.calibration_set import _sample, _sample_engine, sampled_windows, sampling_path


def _replayed(model, ids: torch.Tensor, generators: list[torch.Generator], batched: bool) -> torch.Tensor:
    """The windows a temperature-1 sampler with these generators draws, given the model's own next-token
    probabilities along ``ids`` (one plain transformers forward over each whole window)."""
    with torch.no_grad():
        probabilities = torch.softmax(model(input_ids=ids).logits.float(), dim=-1)  # [rows, positions, vocab]
    drawn = ids[:, :1].clone()
    for position in range(ids.shape[1] - 1):
        if batched:  # the loop: one generator draws the whole batch's next tokens
            step = torch.multinomial(probabilities[:, position], 1, generator=generators[0])
        else:  # the engine: every window its own generator
            rows = [torch.multinomial(probabilities[r, position], 1, generator=g) for r, g in enumerate(generators)]
            step = torch.stack(rows)
        drawn = torch.cat([drawn, step], dim=1)
    return drawn


def test_the_engine_draws_temperature_one_samples_seeded_per_window():
    model = build_tiny_llama(bos_token_id=0)
    ids = _sample_engine(model, 4, 12, seed=3, start=0)
    assert ids.shape == (4, 12) and (ids[:, 0] == 0).all()
    generators = [torch.Generator().manual_seed(3 + row) for row in range(4)]
    assert torch.equal(_replayed(model, ids, generators, batched=False), ids)
    assert torch.equal(_sample_engine(model, 2, 12, seed=4, start=0)[0], ids[1])  # independent of its batch mates


def test_the_loop_draws_the_same_distribution_with_one_generator_per_batch():
    model = build_tiny_llama(bos_token_id=0)
    ids = _sample(model, 4, 24, seed=3, start=0)
    assert torch.equal(_replayed(model, ids, [torch.Generator().manual_seed(3)], batched=True), ids)


def test_the_paths_are_cached_apart_and_a_family_the_engine_lacks_uses_the_loop(artifacts, monkeypatch):
    from transformers import OlmoConfig, OlmoForCausalLM

    model = build_tiny_llama(bos_token_id=0)
    assert (sampling_path(model), sampling_path(model, "cuda")) == ("loop", "engine")  # the faster on each
    engine = sampled_windows(model, 3, 8, seed=0, start=0, path="engine")
    loop = sampled_windows(model, 3, 8, seed=0, start=0)
    assert not torch.equal(engine, loop)  # other generators: other windows, so other cache entries
    assert len(list((artifacts / "calibration").glob("*.pt"))) == 2
    settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=320)
    olmo = OlmoForCausalLM(OlmoConfig(**settings)).eval()
    assert sampling_path(olmo, "cuda") == "loop"
    monkeypatch.setattr(module, "_sample_engine", lambda *args: pytest.fail("the engine does not run olmo"))
    assert sampled_windows(olmo, 2, 8, seed=0, start=0, path=sampling_path(olmo, "cuda")).shape == (2, 8)


def _record_sampling(monkeypatch) -> list[tuple[str, torch.device]]:
    """``(path, device the model was on)`` for every batch sampled (recorded, then sampled for real)."""
    seen = []
    for name in ("_sample", "_sample_engine"):
        real = getattr(module, name)

        def recording(model, *args, real=real, name=name):
            seen.append((name, model.get_input_embeddings().weight.device))
            return real(model, *args)

        monkeypatch.setattr(module, name, recording)
    return seen


def test_oneshot_samples_on_the_device_it_calibrates_on(tiny_model_dir, tmp_path, artifacts, monkeypatch):
    seen = _record_sampling(monkeypatch)
    moved = []
    real = module.on_device
    monkeypatch.setattr(module, "on_device", lambda model, device: moved.append(device) or real(model, device))
    overrides = ["data.num_samples=2", "data.seq_len=16"]
    oneshot(str(tiny_model_dir), "awq_int4", overrides=overrides, output_dir=tmp_path / "out", device="cpu")
    assert moved == [torch.device("cpu")] and seen == [("_sample", torch.device("cpu"))]


def test_a_run_samples_on_the_run_device_through_the_engine(tiny_model_dir, tmp_path, artifacts, monkeypatch):
    """The engine path end to end on a CPU (the default there is the loop, measured faster)."""
    seen = _record_sampling(monkeypatch)
    monkeypatch.setitem(module.SAMPLING_PATH, "cpu", "engine")
    small = ["data.num_samples=2", "data.seq_len=16", "eval.seq_len=16", "eval.max_windows=2", "gate=none"]
    args = ["run", "recipe=awq_int4", f"model={tiny_model_dir}", *small, "tracking.enabled=false", "device=cpu"]
    assert main([*args, f"output.dir={tmp_path}"]) == 0
    assert seen == [("_sample_engine", torch.device("cpu"))]
    [report] = tmp_path.glob("*/report.json")
    assert json.loads(report.read_text())["data"]["generated_tokens"] == 32
