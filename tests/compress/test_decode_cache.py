"""The calibration sampler's preallocated KV cache: the same windows as transformers' growing cache, bit for bit, in
every family (the windows cached before it stay valid), with no per-step copy of the cache."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, build_tiny_model

from compress.model.calibration_set import _sample
from compress.model.decode_cache import PreallocatedLayer, preallocated_cache


@pytest.mark.parametrize("family", FAMILIES)
def test_the_preallocated_cache_samples_the_windows_the_growing_cache_samples(family):
    model = build_tiny_model(family).eval()
    preallocated = _sample(model, 3, 24, seed=0, start=1)
    assert torch.equal(preallocated, _sample(model, 3, 24, seed=0, start=1, preallocate=False))


def test_each_step_writes_into_one_buffer_and_attention_reads_its_filled_prefix():
    layer = PreallocatedLayer(capacity=5)
    steps = [torch.randn(2, 3, n, 4) for n in (2, 1, 1)]
    for step in steps:
        keys, values = layer.update(step, -step)
    assert torch.equal(keys, torch.cat(steps, dim=-2)) and torch.equal(values, -torch.cat(steps, dim=-2))
    assert keys.data_ptr() == layer.key_buffer.data_ptr() and layer.get_seq_length() == 4
    with pytest.raises(ValueError, match="holds 5 tokens; this step would make it 6"):
        layer.update(torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4))


def _gemma3_mixed() -> torch.nn.Module:
    """One sliding layer (a window of 8, shorter than the windows sampled) and one full-attention layer."""
    from transformers import Gemma3ForCausalLM

    config = build_tiny_model("gemma3").config
    config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 8
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def test_sliding_window_layers_keep_transformers_own_and_sample_alike():
    model = _gemma3_mixed()
    kinds = [type(layer).__name__ for layer in preallocated_cache(model.config, capacity=16).layers]
    assert kinds == ["DynamicSlidingWindowLayer", "PreallocatedLayer"]
    preallocated = _sample(model, 3, 24, seed=0, start=1)
    assert torch.equal(preallocated, _sample(model, 3, 24, seed=0, start=1, preallocate=False))
