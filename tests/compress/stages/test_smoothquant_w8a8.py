import json

import pytest
import torch
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import Int8Linear
from compress.model.layer_walk import decoder_layers
from compress.stages import build_chain

CPU = torch.device("cpu")


def _outlier_model(seed: int = 1):
    """Plant the few large activation channels real LLMs have (what SmoothQuant exists for)."""
    model = build_tiny_llama(seed=seed)
    with torch.no_grad():
        for layer in decoder_layers(model):
            layer.input_layernorm.weight[:3] *= 30.0
            layer.post_attention_layernorm.weight[:3] *= 30.0
    return model


def _apply(model, stage_args, samples):
    return compress_model(model, stage_args, samples, CPU, batch_size=4)


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_smoothquant_alone_leaves_outputs_unchanged():
    samples = torch.randint(0, 320, (8, 32))
    tokens = torch.randint(0, 320, (2, 40))
    model, reference = _outlier_model(), _outlier_model()
    [summary] = _apply(model, [{"type": "smoothquant", "alpha": 0.8}], samples)
    assert summary["smoothed_norms"] == 4
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, reference.model.layers[0].input_layernorm.weight)  # it did move scales
    assert torch.allclose(_logits(model, tokens), _logits(reference, tokens), atol=1e-4, rtol=1e-4)
    per_norm = summary["per_norm"]["model.layers.0.input_layernorm"]
    assert per_norm["after"] < per_norm["activation_max_over_median_before"]


def test_smoothquant_improves_w8a8_on_outlier_activations():
    generator = torch.Generator().manual_seed(0)
    samples = torch.randint(0, 320, (8, 48), generator=generator)
    held_out = torch.randint(0, 320, (4, 48), generator=generator)
    expected = _logits(_outlier_model(), held_out)
    plain, smoothed = _outlier_model(), _outlier_model()
    _apply(plain, [{"type": "w8a8", "weights": "rtn"}], samples)
    _apply(smoothed, [{"type": "smoothquant"}, {"type": "w8a8", "weights": "rtn"}], samples)
    assert isinstance(smoothed.model.layers[0].self_attn.q_proj, Int8Linear)
    plain_error = (_logits(plain, held_out) - expected).pow(2).mean()
    smoothed_error = (_logits(smoothed, held_out) - expected).pow(2).mean()
    assert smoothed_error < 0.7 * plain_error


@pytest.mark.parametrize("weights", ["gptq", "rtn"])
def test_w8a8_checkpoint_is_int_quantized_and_loads_in_transformers(tmp_path, weights):
    samples = torch.randint(0, 320, (4, 32))
    tokens = torch.randint(0, 320, (2, 24))
    model = build_tiny_llama(seed=3)
    [summary] = _apply(model, [{"type": "w8a8", "weights": weights}], samples)
    assert summary["quantized_linears"] == 14
    expected = _logits(model, tokens)
    save = save_checkpoint(model, None, tmp_path / "ckpt")
    assert save.bits_per_weight == pytest.approx(8.0, abs=0.5)
    qconfig = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "int-quantized"
    [group] = qconfig["config_groups"].values()
    assert group["input_activations"]["dynamic"] and group["input_activations"]["strategy"] == "token"
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    assert isinstance(ours.model.layers[1].mlp.down_proj, Int8Linear)
    assert torch.allclose(_logits(ours, tokens), expected, atol=1e-5)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    reference = build_tiny_llama(seed=3)
    drift_theirs = (_logits(theirs, tokens) - _logits(reference, tokens)).abs().max()
    assert drift_theirs < 0.05  # transformers runs its own int8 W8A8 emulation of the same weights and scales


def test_smoothquant_after_a_quantizer_is_rejected_naming_both():
    message = r"stages.1 \(smoothquant\) folds scales into dense weights, but stages.0 \(w8a8\) already quantized"
    with pytest.raises(CompressError, match=message):
        build_chain([{"type": "w8a8"}, {"type": "smoothquant"}])
    with pytest.raises(CompressError, match=r"stages.1 \(gptq\) would quantize weights that stages.0 \(w8a8\)"):
        build_chain([{"type": "w8a8"}, {"type": "gptq"}])


def test_bad_alpha_is_a_config_error():
    with pytest.raises(CompressError, match=r"stages.0 \(smoothquant\): alpha=1.5 must be in \[0, 1\]"):
        build_chain([{"type": "smoothquant", "alpha": 1.5}])
