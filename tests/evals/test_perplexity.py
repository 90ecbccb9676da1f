"""Perplexity on CPU computes a 16-bit model in fp32 without widening the whole model at once, and never holds a
whole batch's logits."""

import pytest
import torch
from helpers import build_tiny_llama, build_tiny_model, build_tiny_moe

from compress.calibration import decoder_layers, fp32_compute, restore_dtypes, upcast
from evals.perplexity import HEAD_CHUNK, perplexity


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


def _full_logits_nll(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()))


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_the_head_runs_on_a_few_positions_at_a_time_with_the_full_forwards_result(family):
    """The logits of a whole batch never exist at once (gemma2: the final logit soft-capping is kept)."""
    model = build_tiny_moe(family) if family.endswith("moe") else build_tiny_model(family)
    ids = torch.randint(0, 320, (5 * 300,), generator=torch.Generator().manual_seed(0))
    head_positions: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _output: head_positions.append(args[0].shape[:-1].numel())
    )
    result = perplexity(model, ids, 300, batch_size=4, progress=False)
    assert max(head_positions) == HEAD_CHUNK
    expected = _full_logits_nll(model, ids.view(5, 300))
    assert result.mean_nll == pytest.approx(expected, rel=1e-5)


def test_a_model_whose_forward_changes_the_heads_logits_is_scored_by_its_full_forward():
    model = build_tiny_llama(seed=4)
    plain_forward = model.forward

    def scaled_forward(*args, **kwargs):
        output = plain_forward(*args, **kwargs)
        output.logits = output.logits * 0.5  # what e.g. a logit_scale in a custom model's forward does
        return output

    model.forward = scaled_forward
    ids = torch.randint(0, 320, (4 * 32,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, ids, 32, progress=False)
    assert result.mean_nll == pytest.approx(_full_logits_nll(model, ids.view(4, 32)), rel=1e-5)
