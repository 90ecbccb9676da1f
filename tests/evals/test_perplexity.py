"""Perplexity on CPU computes a 16-bit model in fp32 without widening the whole model at once."""

import torch
from helpers import build_tiny_llama

from compress.calibration import decoder_layers, fp32_compute, restore_dtypes, upcast
from evals.perplexity import perplexity


def test_fp32_compute_one_layer_at_a_time_equals_widening_the_whole_model():
    model = build_tiny_llama(seed=4).to(torch.bfloat16)
    ids = torch.randint(0, 320, (6 * 32,), generator=torch.Generator().manual_seed(0))
    stored = upcast(model)
    expected = perplexity(model, ids, 32, batch_size=4, progress=False)
    restore_dtypes(model, stored)
    widest: list[int] = []

    def count_fp32_layers(_layer, _args):
        widest.append(sum(layer.mlp.down_proj.weight.dtype == torch.float32 for layer in decoder_layers(model)))

    handles = [layer.register_forward_pre_hook(count_fp32_layers) for layer in decoder_layers(model)]
    with fp32_compute(model):
        result = perplexity(model, ids, 32, batch_size=4, progress=False)
    for handle in handles:
        handle.remove()
    assert result.mean_nll == expected.mean_nll  # the same fp32 arithmetic
    assert widest and max(widest) == 0  # as each layer starts, no other layer is held in fp32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
