"""A lazily loaded model sampled on another device comes back as lean as it went: its decoder layers on meta, the
rest where it was. Its own module without Hydra imports, so the GPU suite (``pytest -m gpu``) collects it bare."""

from __future__ import annotations

import pytest
import torch

from compress.model import calibration_set as module
from compress.model.calibration_set import on_device, sampled_windows
from compress.model.sources import load


def _assert_home_and_lean(model) -> None:
    assert model.get_input_embeddings().weight.device == torch.device("cpu")
    assert model.lazy_weights.loaded == set()
    layer_devices = {p.device.type for p in model.model.layers.parameters()}
    assert layer_devices == {"meta"}


def test_a_lazily_loaded_model_comes_back_from_another_device(tiny_model_dir):
    """``cpu:0`` is another device to ``on_device`` (``torch.device("cpu") != torch.device("cpu", 0)``), so the CPU
    walks the path a GPU run takes: the layers are read, moved, released to meta, and the rest moved home. The 8B run
    of 2026-11-30 on an H200 failed here: ``model.to(home)`` cannot copy the released (meta) layers."""
    model, _ = load(str(tiny_model_dir))
    with on_device(model, torch.device("cpu", 0)):
        assert model.lazy_weights.loaded == set(range(len(model.model.layers)))
    _assert_home_and_lean(model)
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits  # the layers read again where they are needed
    assert torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to move the model to")
def test_a_lazily_loaded_model_samples_on_the_gpu_and_comes_back(tiny_model_dir, artifacts, monkeypatch):
    seen, real = [], module._sample_engine

    def recording(model, *args):
        seen.append(model.get_input_embeddings().weight.device)
        return real(model, *args)

    monkeypatch.setattr(module, "_sample_engine", recording)
    model, _ = load(str(tiny_model_dir))
    windows = sampled_windows(model, 3, 16, seed=0, start=0, device="cuda")
    assert windows.shape == (3, 16) and seen == [torch.device("cuda", 0)]
    _assert_home_and_lean(model)


def test_windows_the_engine_draws_on_an_accelerator_are_cached_under_their_own_key(monkeypatch):
    """On an accelerator the engine samples there, from other random streams than on the CPU: the same seed gives
    other windows, so they must not share a cache entry (checked without a GPU: no batch is sampled here)."""
    from helpers import build_tiny_llama

    labels = []

    def recorded(sample, identity, batches, seq_len, start, path):
        labels.append(path)
        return [torch.zeros(count, seq_len, dtype=torch.long) for count, _ in batches]

    monkeypatch.setattr(module, "_cached_batches", recorded)
    model = build_tiny_llama(bos_token_id=0)
    for device in ("cpu", "meta"):  # meta stands for an accelerator: nothing moves unless a batch is sampled
        sampled_windows(model, 2, 8, seed=0, start=0, device=device, path="engine")
    sampled_windows(model, 2, 8, seed=0, start=0, device="meta", path="loop")
    assert labels == ["engine", "engine meta", "loop"]
