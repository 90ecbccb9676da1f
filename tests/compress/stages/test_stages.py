import pytest
import torch
from helpers import build_tiny_llama

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.model.layer_walk import capture_first_layer_inputs, decoder_layers
from compress.stages import LayerContext, build_chain
from compress.stages.mappings import layer_mappings

CPU = torch.device("cpu")


def _outlier_model():
    """Random weights give flat activations; real LLMs have a few large input channels. Plant some, as AWQ expects."""
    model = build_tiny_llama(seed=1)
    with torch.no_grad():
        for layer in decoder_layers(model):
            layer.input_layernorm.weight[:4] *= 12.0
            layer.post_attention_layernorm.weight[:4] *= 12.0
    return model


def _compress(kind: str, samples, **args):
    model = _outlier_model()
    [summary] = compress_model(model, [{"type": kind, "bits": 3, "group_size": 32, **args}], samples, CPU, 4)
    return model, summary


def _logit_error(model, reference, tokens):
    with torch.no_grad():
        return (model(tokens).logits - reference(tokens).logits).pow(2).mean().item()


def _calibration_and_held_out() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 320, (16, 64), generator=generator), torch.randint(0, 320, (8, 64), generator=generator)


def test_awq_beats_rtn_on_held_out_tokens():
    samples, held_out = _calibration_and_held_out()
    reference = _outlier_model()
    rtn, rtn_summary = _compress("rtn", samples)
    awq, awq_summary = _compress("awq", samples)
    assert rtn_summary["quantized_linears"] == awq_summary["quantized_linears"] == 14
    assert isinstance(awq.model.layers[0].self_attn.o_proj, QuantizedLinear)
    assert type(rtn.lm_head) is torch.nn.Linear
    assert _logit_error(awq, reference, held_out) < 0.8 * _logit_error(rtn, reference, held_out)


def test_awq_with_gptq_rounding_beats_awq_with_rtn():
    """AWQ's scales, then GPTQ's error-compensating rounding instead of round-to-nearest."""
    samples, held_out = _calibration_and_held_out()
    reference = _outlier_model()
    awq, _ = _compress("awq", samples)
    gptq, _ = _compress("gptq", samples)
    awq_gptq, summary = _compress("awq", samples, rounding="gptq")
    assert summary["quantized_linears"] == 14 and summary["mean_hessian_rel_error"] > 0
    assert 0 < summary["rounding_seconds"] < summary["seconds"]  # the rest is the scale search: which to speed up
    assert "rounding_seconds" not in _compress("awq", samples)[1]
    assert isinstance(awq_gptq.model.layers[1].mlp.down_proj, QuantizedLinear)
    error = _logit_error(awq_gptq, reference, held_out)
    assert error < 0.9 * _logit_error(awq, reference, held_out) and error < _logit_error(gptq, reference, held_out)
    [stage] = build_chain([{"type": "awq", "rounding": "gptq"}])
    assert stage.algorithm().startswith("AWQ: activation-aware scales (grid 20, duo scaling both), then GPTQ (")
    with pytest.raises(CompressError, match=r"awq: rounding='gtpq'; use rtn or gptq"):
        build_chain([{"type": "awq", "rounding": "gtpq"}])[0].prepare(_outlier_model())


def test_awq_act_order_reaches_its_gptq_rounding_only():
    """act_order is GPTQ's column order, so it passes to the rounder; round-to-nearest has no column order, so
    ``stages.0.rounding=rtn`` on a recipe that sets it is AWQ as published, no second override needed."""
    [stage] = build_chain([{"type": "awq", "group_size": 32, "rounding": "gptq", "act_order": True}])
    stage.prepare(_outlier_model())
    assert stage.rounder.config.act_order and "act-order" in stage.algorithm()
    [stage] = build_chain([{"type": "awq", "group_size": 32, "act_order": True}])
    stage.prepare(_outlier_model())
    assert stage.rounder is None and "act-order" not in stage.algorithm()
    samples, _ = _calibration_and_held_out()
    ordered, summary = _compress("awq", samples, rounding="gptq", act_order=True)
    assert summary["quantized_linears"] == 14
    assert ordered.model.layers[0].mlp.up_proj.weight_g_idx is None  # static groups: the layout does not change


def test_awq_scaling_alone_leaves_the_float_model_unchanged():
    """Folding 1/s into the previous op and s into the linears must be exact, including the GQA v→o mapping."""
    model = _outlier_model()
    reference = _outlier_model()
    [stage] = build_chain([{"type": "awq", "bits": 4, "group_size": 32}])
    stage.prepare(model)
    samples = torch.randint(0, 320, (4, 32))
    inputs = capture_first_layer_inputs(model, samples, 4, CPU)
    layer = decoder_layers(model)[0]
    ctx = LayerContext(0, "model.layers.0", layer, model.config, inputs, CPU)
    activations = stage._capture(ctx, layer_mappings(layer, stage.mappings))
    for mapping in stage.mappings:
        scale = torch.rand(layer.get_submodule(mapping.previous).weight.shape[0]) + 0.5
        stage.apply_scale(ctx, mapping, scale)
    assert stage._kv_groups(ctx, stage.mappings[1]) == (2, 16)  # v_proj (32 outputs) feeds o_proj (64 inputs)
    with torch.no_grad():
        assert torch.allclose(model(samples).logits, reference(samples).logits, atol=1e-4)
    assert set(activations) == {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"}


def test_ignored_linears_stay_dense():
    samples = torch.randint(0, 320, (4, 32))
    model, summary = _compress("awq", samples, ignore=["lm_head", "mlp.down_proj"])
    assert type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert summary["quantized_linears"] == 12


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        (
            {"type": "gptq", "ignore": ["lm_head", "mlp.down_prj"]},
            r"stages.0 \(gptq\): ignore pattern 'mlp.down_prj' matches no module of this model "
            r"\(did you mean 'mlp.down_proj'\?\)",
        ),
        ({"type": "rtn", "ignore": ["re:^decoder\\."]}, r"ignore pattern 're:\^decoder\\\\.' matches no module"),
        (
            {"type": "mixed", "method": "rtn", "schemes": {"self_attn.q_proj": "int8", "mlp.gate_prj": "int8"}},
            r"stages.0 \(mixed\): schemes pattern 'mlp.gate_prj' .* \(did you mean 'mlp.gate_proj'\?\)",
        ),
    ],
)
def test_a_module_pattern_that_matches_nothing_is_refused_before_any_work(stage, message):
    """A typo in ignore (or a mixed scheme's pattern) would quantize the layer the user meant to keep."""
    model = build_tiny_llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CompressError, match=message):
        compress_model(model, [stage], torch.randint(0, 320, (2, 16)), "cpu")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_unknown_stage_key_names_valid_ones():
    message = r"stages.0 \(awq\): unknown key 'gruop_size' \(did you mean 'group_size'\?\)"
    with pytest.raises(CompressError, match=message):
        build_chain([{"type": "awq", "gruop_size": 64}])
    with pytest.raises(CompressError, match=r"type=.awk. is not a known stage; available: awq, "):
        build_chain([{"type": "awk"}])


def test_second_weight_quantizer_is_rejected():
    with pytest.raises(CompressError, match=r"stages.1 \(awq\) would quantize weights that stages.0 \(rtn\)"):
        build_chain([{"type": "rtn"}, {"type": "awq"}])


def test_group_size_that_does_not_tile_a_layer_fails_before_work():
    [stage] = build_chain([{"type": "awq", "group_size": 48}])
    message = r"model.layers.0.self_attn.q_proj: input width 64 .* sizes that fit: \[16, 32, 64\]"
    with pytest.raises(CompressError, match=message):
        stage.prepare(build_tiny_llama())


def test_nan_in_calibration_activations_names_the_layer():
    model = build_tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CompressError, match="model.layers.1.mlp.up_proj: weight holds NaN"):
        compress_model(model, [{"type": "rtn", "group_size": 32}], torch.randint(0, 320, (2, 16)), CPU, batch_size=2)
    model = build_tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("inf"))
    with pytest.raises(CompressError, match="model.layers.0"):
        compress_model(model, [{"type": "awq", "group_size": 32}], torch.randint(0, 320, (2, 16)), CPU, batch_size=2)
