import logging

import pytest
import torch
from helpers import build_tiny_llama

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.grids.int_grid import WeightScheme, fake_quantize, quantize
from compress.stages import build_chain
from compress.stages.gptq import CLIP_RATIOS, _group_params, cholesky_inverse_upper, gptq_quantize

CPU = torch.device("cpu")


def _correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Real activations are correlated across channels and have a few large ones; GPTQ exploits exactly that."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=generator) / width**0.5
    x = torch.randn(tokens, width, generator=generator) @ mix + 0.1 * torch.randn(tokens, width, generator=generator)
    x[:, :4] *= 8.0
    return x


@pytest.mark.parametrize(
    ("bits", "symmetric", "act_order"), [(4, True, False), (3, True, True), (4, False, True), (8, True, False)]
)
def test_gptq_output_error_below_rtn_on_the_same_layer(bits, symmetric, act_order):
    x = _correlated_inputs(2048, 128)
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    hessian = x.T @ x / len(x)
    scheme = WeightScheme(bits, 32, symmetric)
    result = gptq_quantize(weight, hessian, scheme, block_size=32, act_order=act_order)
    codes = result.codes.float().view(96, 4, 32)
    if result.zero_point is not None:
        codes = codes - result.zero_point.float().unsqueeze(-1)
    gptq_weight = (codes * result.scale.unsqueeze(-1)).view(96, 128)
    assert result.codes.min() >= scheme.qmin and result.codes.max() <= scheme.qmax
    rtn_error = (x @ (fake_quantize(weight, scheme) - weight).T).pow(2).mean()
    gptq_error = (x @ (gptq_weight - weight).T).pow(2).mean()
    assert gptq_error < 0.6 * rtn_error
    assert result.retries == 0


def test_singular_hessian_is_retried_with_more_dampening(caplog):
    """A rank-1 Hessian with negligible dampening cannot be factorized; the retry must fix it and say so."""
    hessian = torch.ones(64, 64)
    with caplog.at_level(logging.WARNING, logger="compress.stages.gptq"):
        upper, damp, retries = cholesky_inverse_upper(hessian, 1e-9, max_retries=6, name="model.layers.0.q_proj")
    assert retries >= 1 and damp == pytest.approx(1e-9 * 10**retries)
    assert torch.isfinite(upper).all()
    assert "model.layers.0.q_proj: Hessian not positive definite" in caplog.text
    with pytest.raises(CompressError, match="stayed singular after 1 dampening increases"):
        cholesky_inverse_upper(hessian, 1e-9, max_retries=1, name="q_proj")
    weight = torch.randn(8, 64)
    result = gptq_quantize(weight, hessian, WeightScheme(4, 32, True), dampening=1e-9, name="q_proj")
    assert result.retries >= 1


def _run_gptq(model, samples, **args):
    [summary] = compress_model(model, [{"type": "gptq", "bits": 4, "group_size": 32, **args}], samples, CPU, 4)
    return summary


def test_gptq_stage_beats_rtn_on_held_out_logits():
    generator = torch.Generator().manual_seed(0)
    samples = torch.randint(0, 320, (16, 64), generator=generator)
    held_out = torch.randint(0, 320, (8, 64), generator=generator)
    reference = build_tiny_llama(seed=2)
    gptq = build_tiny_llama(seed=2)
    summary = _run_gptq(gptq, samples, bits=3)
    rtn = build_tiny_llama(seed=2)
    compress_model(rtn, [{"type": "rtn", "bits": 3, "group_size": 32}], samples, CPU, batch_size=4)
    assert summary["quantized_linears"] == 14 and summary["cholesky_retries"] == {}
    assert isinstance(gptq.model.layers[1].mlp.down_proj, QuantizedLinear)
    with torch.no_grad():
        expected = reference(held_out).logits
        gptq_error = (gptq(held_out).logits - expected).pow(2).mean()
        rtn_error = (rtn(held_out).logits - expected).pow(2).mean()
    assert gptq_error < 0.8 * rtn_error


def test_nan_in_calibration_activations_names_the_linear():
    model = build_tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")  # NaN enters mlp.gate_proj's input
    with pytest.raises(CompressError, match=r"model.layers.0.mlp.gate_proj: calibration activations hold NaN/inf"):
        _run_gptq(model, torch.randint(0, 320, (2, 16)), ignore=["lm_head", "self_attn.o_proj"])


def test_three_bit_group_that_does_not_divide_the_width_fails_before_work():
    [stage] = build_chain([{"type": "gptq", "bits": 3, "group_size": 48}])
    with pytest.raises(
        CompressError,
        match=r"model.layers.0.self_attn.q_proj: input width 64 is not a multiple of "
        r"group_size=48; sizes that fit: \[16, 32, 64\]",
    ):
        stage.prepare(build_tiny_llama())


def test_bad_dampening_is_a_config_error():
    with pytest.raises(CompressError, match=r"stages.0 \(gptq\): dampening=0 must be in \(0, 1\]"):
        build_chain([{"type": "gptq", "dampening": 0}])


@pytest.mark.parametrize(
    "recipe",
    [
        "gptq_int4",
        "gptq_int3",
        "autoround_int4",
        "smoothquant_w8a8",
        "smoothquant_gptq_w8a8",
        "fp8_dynamic",
        "fp8_static",
        "kv_fp8",
        "kv_int8",
        "awq_int4_kv_int8",
    ],
)
def test_quantization_recipes_build_legal_chains(recipe):
    import yaml

    from compress.base.paths import recipes_dir

    stages = build_chain(yaml.safe_load((recipes_dir() / f"{recipe}.yaml").read_text())["stages"])
    assert stages and sum(s.quantizes_weights for s in stages) <= 1


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_search_picks_per_row_the_ratio_with_least_hessian_weighted_error(symmetric, dtype):
    """Against a plain search: quantize at each ratio with compress.grids.int_grid.quantize, dequantize, score every
    row."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator) * torch.rand(48, 1, generator=generator)
    x = torch.randn(256, 32, generator=generator)
    hessian = x.T @ x / 256
    scheme = WeightScheme(4, None, symmetric)
    errors, scales, zeros = [], [], []
    for ratio in CLIP_RATIOS:
        codes, scale, zero = quantize(weight, scheme, ratio, scale_dtype=dtype)
        shift = 0 if zero is None else zero.float()
        delta = (codes.float() - shift) * scale.float() - weight
        errors.append(((delta @ hessian) * delta).sum(1))
        scales.append(scale)
        zeros.append(zero)
    best = torch.stack(errors).argmin(0)
    rows = torch.arange(48)
    scale, zero = _group_params(weight.t(), hessian, scheme, clip_search=True, dtype=dtype)
    assert scale.dtype == dtype and torch.equal(scale, torch.stack(scales)[best, rows])
    assert scale.shape == (48, 1)
    assert (zero is None) == symmetric
    if zero is not None:
        assert zero.dtype == torch.int8 and torch.equal(zero, torch.stack(zeros)[best, rows])
    assert len(set(best.tolist())) > 1  # rows do pick different ratios


class _OneLinear(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.proj(x)


def test_input_correction_targets_the_least_squares_weight_for_the_full_precision_output():
    """W′ = W C H̃⁻¹ solves min ‖W′ X̃ − W X‖²: its residual is orthogonal to X̃ (the normal equations); when the two
    inputs agree, W′ = W."""
    from compress.model.layer_walk import LayerInputs
    from compress.stages.cross_moments import CrossMoments

    generator = torch.Generator().manual_seed(0)
    full = _correlated_inputs(1024, 32)
    distortion = torch.eye(32) + 0.1 * torch.randn(32, 32, generator=generator)  # what quantized layers did to X
    walked = full @ distortion + 0.01 * torch.randn(full.shape, generator=generator)
    weight = torch.randn(16, 32, generator=generator)
    for quantized, exact in ((walked, False), (full, True)):
        cross = CrossMoments(_OneLinear(32), LayerInputs([full[None]], [{}]), "layer")
        cross.add("proj", 0, quantized)
        hessian = quantized.T @ quantized / len(quantized)
        target = cross.corrected_weight("proj", weight, hessian, dampening=1e-6)
        if exact:
            assert torch.allclose(target, weight, atol=1e-4)
            continue
        residual = quantized @ target.T - full @ weight.T
        assert (residual.T @ quantized).abs().max() < 1e-3 * (full @ weight.T).abs().max() * len(full) ** 0.5
        assert residual.pow(2).mean() < 0.1 * (quantized @ weight.T - full @ weight.T).pow(2).mean()


def test_input_correction_lowers_the_model_error_on_calibration_tokens():
    samples = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = build_tiny_llama()(samples).logits
    errors = {}
    for correct in (False, True):
        model = build_tiny_llama()
        chain = [{"type": "gptq", "bits": 3, "group_size": 32, "input_correction": correct}]
        compress_model(model, chain, samples, CPU, batch_size=4)
        with torch.no_grad():
            errors[correct] = (model(samples).logits - expected).norm() / expected.norm()
    assert errors[True] < 0.8 * errors[False], errors


def test_input_correction_needs_true_sequential():
    with pytest.raises(CompressError, match="input_correction=true needs true_sequential=true"):
        build_chain([{"type": "gptq", "input_correction": True, "true_sequential": False}])
