"""N:M pruning: exact patterns, SparseGPT < Wanda < magnitude in output error, masks kept by every quantizer."""

import pytest
import torch
from helpers import build_tiny_llama

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.grids.int_grid import WeightScheme, quantize
from compress.grids.sparsity import NMPattern, attach_mask, carry_mask, mask_of, nm_keep_mask
from compress.model.layer_walk import decoder_layers
from compress.stages import build_chain

CPU = torch.device("cpu")
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _outlier_model():
    """Real LLMs have a few loud input channels (what Wanda and SparseGPT exploit); random weights do not."""
    model = build_tiny_llama(seed=1)
    loud = torch.arange(1, 64, 9)  # one per group of 4 or 8 columns, so that N:M has a choice to make about them
    with torch.no_grad():
        for layer in decoder_layers(model):
            layer.input_layernorm.weight[loud] *= 12.0
            layer.post_attention_layernorm.weight[loud] *= 12.0
    return model


def _run(chain, samples, model=None):
    model = model if model is not None else _outlier_model()
    return model, compress_model(model, chain, samples, CPU, batch_size=4)


def _weight(module):
    return module.dequantized_weight() if hasattr(module, "dequantized_weight") else module.weight.data


def _samples(count=16, seed=0):
    return torch.randint(0, 320, (count, 64), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["magnitude_prune", "wanda", "sparsegpt"])
@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
def test_every_group_keeps_exactly_n_of_m(kind, pattern):
    n, m = (int(v) for v in pattern.split(":"))
    model, [summary] = _run([{"type": kind, "sparsity": pattern}], _samples(4))
    for layer in decoder_layers(model):
        for name in LINEARS:
            linear = layer.get_submodule(name)
            kept = (linear.weight.reshape(linear.out_features, -1, m) != 0).sum(-1)
            assert (kept == n).all(), f"{name}: groups keep {kept.unique().tolist()} of {m}"
            assert torch.equal(mask_of(linear), linear.weight != 0)
    assert summary["pruned_linears"] == 14 and summary["mean_sparsity"] == pytest.approx(1 - n / m)
    assert type(model.lm_head) is torch.nn.Linear and (model.lm_head.weight != 0).all()


def test_sparsegpt_beats_wanda_beats_magnitude_on_held_out_tokens():
    reference = _outlier_model()
    held_out = _samples(8, seed=1)

    def error(kind):
        model, _ = _run([{"type": kind}], _samples(16))
        with torch.no_grad():
            return (model(held_out).logits - reference(held_out).logits).pow(2).mean().item()

    magnitude, wanda, sparsegpt = error("magnitude_prune"), error("wanda"), error("sparsegpt")
    assert sparsegpt < 0.9 * wanda and wanda < 0.9 * magnitude, (sparsegpt, wanda, magnitude)


@pytest.mark.parametrize(
    "quantizer",
    [
        {"type": "rtn", "symmetric": True, "group_size": 32},
        {"type": "rtn", "symmetric": False, "group_size": 32},
        {"type": "awq", "grid": 4, "clip_grid": 4, "group_size": 32},
        {"type": "gptq", "clip_search": False, "block_size": 32, "group_size": 32},
        {"type": "w8a8"},
        {"type": "fp8"},
    ],
    ids=["rtn-sym", "rtn-asym", "awq", "gptq", "w8a8", "fp8"],
)
def test_quantizers_keep_the_exact_pattern(quantizer):
    model = _outlier_model()
    pruner, quantizer = build_chain([{"type": "wanda"}, quantizer])
    compress_model(model, [pruner], _samples(8), CPU, batch_size=4)
    masks = {name: mask_of(module).clone() for name, module in model.named_modules() if mask_of(module) is not None}
    compress_model(model, [quantizer], _samples(8), CPU, batch_size=4)
    summary = pruner.finalize(model)  # re-checks every mask after the quantizer
    assert len(masks) == 14
    for name, keep in masks.items():
        module = model.get_submodule(name)
        assert type(module) is not torch.nn.Linear
        assert not (_weight(module)[~keep] != 0).any(), f"{name}: a pruned weight came back"
        assert torch.equal(mask_of(module), keep)
    assert min(summary["per_layer_sparsity"].values()) >= 0.5


def test_carrying_a_mask_zeroes_quantized_codes_at_the_zero_point():
    """The quantizer's output may hold non-zero codes where the mask prunes (GPTQ's compensation refills them);
    replacing the module re-applies the mask exactly, also for asymmetric codes (zero = zero-point code)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 64, generator=generator) + 0.3  # shifted: zero points differ from 0
    keep = nm_keep_mask(torch.rand(16, 64, generator=generator), NMPattern(2, 4))
    dense = torch.nn.Linear(64, 16, bias=False)
    attach_mask(dense, keep, NMPattern(2, 4))
    for symmetric in (True, False):
        codes, scale, zero = quantize(weight, WeightScheme(4, 32, symmetric))
        quantized = QuantizedLinear.from_codes(codes, scale, zero, 4, 32)
        before = quantized.dequantized_weight()
        assert (before[~keep] != 0).float().mean() > 0.8  # the quantizer alone leaves most of them non-zero
        carry_mask(dense, quantized)
        after = quantized.dequantized_weight()
        assert (after[~keep] == 0).all() and torch.equal(after[keep], before[keep])


def test_a_stage_that_refills_pruned_weights_fails_the_run():
    model, _ = _run([{"type": "magnitude_prune"}], _samples(2))
    [stage] = build_chain([{"type": "magnitude_prune"}])
    stage.prepare(_outlier_model())
    stage.pruned = {"model.layers.0.mlp.up_proj": 0.5}
    linear = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        linear.weight[~mask_of(linear)] = 0.01
    with pytest.raises(CompressError, match="model.layers.0.mlp.up_proj: 4096 weights pruned to 2:4 sparsity are non"):
        stage.finalize(model)


@pytest.mark.parametrize(
    ("chain", "message"),
    [
        ([{"type": "rtn"}, {"type": "wanda"}], r"stages.1 \(wanda\) would prune weights that stages.0 \(rtn\)"),
        ([{"type": "wanda"}, {"type": "sparsegpt"}], r"stages.1 \(sparsegpt\): stages.0 already prunes"),
        ([{"type": "sparsegpt", "sparsity": "4:2"}], r"stages.0 \(sparsegpt\): sparsity='4:2' must keep 0 < N < M"),
        ([{"type": "wanda", "sparsity": "half"}], r"sparsity='half' is not an N:M pattern"),
        ([{"type": "sparsegpt", "block_size": 30}], r"block_size=30 must be a multiple of M=4"),
    ],
)
def test_illegal_chains_and_arguments_fail_before_work(chain, message):
    with pytest.raises(CompressError, match=message):
        build_chain(chain)


def test_pattern_that_does_not_tile_a_layer_names_it():
    [stage] = build_chain([{"type": "magnitude_prune", "sparsity": "3:7"}])
    message = r"model.layers.0.self_attn.q_proj: input width 64 is not a multiple of M=7"
    with pytest.raises(CompressError, match=message):
        stage.prepare(build_tiny_llama())
