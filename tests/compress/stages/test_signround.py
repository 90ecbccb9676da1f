"""Sign-gradient rounding: exact export, a learned rounding that beats round-to-nearest, MoE, clear refusals."""

import pytest
import torch
from helpers import build_tiny_llama, relative_error

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import Fp4Linear, QuantizedLinear
from compress.grids.fp4_grid import e2m1_codes
from compress.grids.int_grid import WeightScheme, quantize
from compress.kernels.fp4 import pack_fp4
from compress.model.layer_walk import decoder_layers
from compress.stages import build_chain
from compress.stages.fp4_weights import Fp4Grid, Fp4Layers, rtn_fp4
from compress.stages.gptq import gptq_quantize
from compress.stages.learned_rounding import LearnedFp4Rounding, LearnedRounding

SAMPLES = torch.randint(0, 320, (8, 48), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))


def _logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untrained_parameters_export_exactly_round_to_nearest(symmetric, dtype):
    """V = 0 and no clipping is RTN: same codes, scales and zero points as compress.grids.int_grid.quantize, and the
    weight the module trains with is the one its export stores."""
    linear = torch.nn.Linear(64, 24, bias=False)
    scheme = WeightScheme(4, 32, symmetric)
    module = LearnedRounding.nearest(linear, scheme, dtype)
    exported = module.export()
    reference = QuantizedLinear.from_codes(*quantize(linear.weight.data, scheme, scale_dtype=dtype), 4, 32)
    assert torch.equal(exported.dequantized_weight(), reference.dequantized_weight())
    with torch.no_grad():
        module.offset.uniform_(-0.5, 0.5)
        module.max_scale.uniform_(0.6, 1.0)
        module.min_scale.uniform_(0.6, 1.0)
    trained = module.quantized_weight().detach().to(dtype)  # the export multiplies codes by scales in its dtype
    assert torch.equal(trained, module.export().dequantized_weight())


def test_learned_rounding_beats_round_to_nearest_on_the_model_output():
    """On the calibration tokens, what the stage optimises (a tiny random model has too few of them to say much
    about held-out text: that is measured on the real model, benchmarks/variants.py)."""
    expected = _logits(build_tiny_llama(), SAMPLES)
    errors = {}
    for name, chain in {
        "rtn": [{"type": "rtn", "group_size": 32}],
        "signround": [{"type": "signround", "group_size": 32, "iterations": 30, "batch_size": 4}],
    }.items():
        model = build_tiny_llama()
        summary = compress_model(model, chain, SAMPLES, batch_size=8)[0]
        errors[name] = relative_error(_logits(model, SAMPLES), expected)
    assert summary["mean_loss_vs_start"] < 0.6
    assert summary["quantized_linears"] == 7 * len(decoder_layers(model))
    assert errors["signround"] < 0.6 * errors["rtn"], errors


def test_same_seed_same_codes_and_other_seed_other_codes():
    def codes(seed: int) -> torch.Tensor:
        model = build_tiny_llama()
        compress_model(
            model, [{"type": "signround", "group_size": 32, "iterations": 6, "batch_size": 4, "seed": seed}], SAMPLES
        )
        return decoder_layers(model)[1].mlp.down_proj.weight_packed

    first = codes(0)
    assert torch.equal(first, codes(0))
    assert not torch.equal(first, codes(1))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"iterations": 0}, "iterations=0 must be at least 1"),
        ({"lr": -1.0}, "lr=-1.0 must be positive"),
        ({"min_clip": 0.0}, r"min_clip=0.0 must be in \(0, 1\]"),
        ({"steps": 3}, "unknown key"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args, message):
    with pytest.raises(CompressError, match=message):
        build_chain([{"type": "signround", **args}])


def test_fp4_activations_are_refused_before_any_work():
    with pytest.raises(CompressError, match="signround learns weight rounding only; use activations=none"):
        build_chain([{"type": "signround", "format": "nvfp4", "group_size": 16, "activations": "fp4"}])


@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_untrained_parameters_export_exactly_round_to_nearest(fmt, group, dtype):
    """On the e2m1 grid too: V = 0 and no clipping is RTN's codes and scales (compress.stages.fp4_weights.rtn_fp4), and
    after training the weight the module computes with is the one its export stores."""
    linear = torch.nn.Linear(64, 24, bias=False)
    with torch.no_grad():
        linear.weight[:, :group] *= 20  # groups of very different ranges: the fp8 / e8m0 scales matter
    grid = Fp4Grid.for_weight(linear.weight.data.to(dtype), fmt, clip_search=False)
    module = LearnedFp4Rounding.nearest_fp4(
        linear, grid, WeightScheme(4, group, True, fmt), dtype, Fp4Layers(fmt, False)
    )
    exported = module.export()
    codes, scale, global_scale = rtn_fp4(linear.weight.data.to(dtype), fmt)
    assert torch.equal(exported.weight_packed, pack_fp4(codes)) and torch.equal(exported.weight_scale, scale)
    with torch.no_grad():
        module.offset.uniform_(-0.5, 0.5)
        module.max_scale.uniform_(0.6, 1.0)
        module.min_scale.uniform_(0.6, 1.0)
    exported = module.export()
    assert not torch.equal(exported.weight_packed, pack_fp4(codes))  # the offsets and clipping changed codes
    assert torch.equal(module.quantized_weight().detach(), exported.dequantized_weight().float())


def test_an_offset_within_half_a_spacing_reaches_either_fp4_neighbour():
    """e2m1 is not uniform (0.5 apart below 2, 1 below 4, 2 above): an offset is scaled by the spacing where the
    weight lies, so ±½ takes 2.9 to 2 or 3 and 4.9 to 4 or 6: the grid values on either side of it, as an integer
    position reaches its floor or its ceiling."""
    position = torch.tensor([[0.7, 2.9, 4.9, -1.2]])
    linear = torch.nn.Linear(4, 1, bias=False)
    module = LearnedFp4Rounding(linear, position, torch.ones(1, 1), None, WeightScheme(4, 4, True, "mxfp4"),
                                torch.float32, Fp4Layers("mxfp4", False))  # fmt: skip
    with torch.no_grad():
        assert module.quantized_weight().tolist() == [[0.5, 3.0, 4.0, -1.0]]
        module.offset.fill_(0.49)
        assert module.quantized_weight().tolist() == [[1.0, 3.0, 6.0, -1.0]]
        module.offset.fill_(-0.49)
        assert module.quantized_weight().tolist() == [[0.5, 2.0, 4.0, -1.5]]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_learned_rounding_beats_round_to_nearest_on_the_model_output(fmt):
    group = 16 if fmt == "nvfp4" else 32
    expected = _logits(build_tiny_llama(), SAMPLES)
    errors = {}
    for name, stage in {
        "rtn": {"type": "rtn"},
        "signround": {"type": "signround", "iterations": 30, "batch_size": 4},
        "gptq": {"type": "gptq"},
        "signround from gptq": {"type": "signround", "init": "gptq", "iterations": 30, "lr": 0.005},
    }.items():
        model = build_tiny_llama()
        compress_model(model, [{**stage, "format": fmt, "group_size": group}], SAMPLES, batch_size=8)
        assert isinstance(decoder_layers(model)[0].self_attn.q_proj, Fp4Linear)
        errors[name] = relative_error(_logits(model, SAMPLES), expected)
    assert errors["signround"] < 0.8 * errors["rtn"], errors
    assert errors["signround from gptq"] < errors["gptq"], errors


def test_gptq_fp4_positions_round_to_its_codes():
    """GPTQ keeps each FP4 weight's position in units of its group's scale: rounded onto e2m1 it is GPTQ's code, so
    SignRound from GPTQ starts from GPTQ's stored layer exactly."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=generator) @ torch.randn(64, 64, generator=generator)
    linear = torch.nn.Linear(64, 24, bias=True)
    scheme, layers = WeightScheme(4, 16, True, "nvfp4"), Fp4Layers("nvfp4", False)
    grid = Fp4Grid.for_weight(linear.weight.data, "nvfp4")
    result = gptq_quantize(linear.weight.data, x.T @ x, scheme, grid=grid, keep_positions=True)
    assert torch.equal(e2m1_codes(result.positions), result.codes.to(torch.uint8))
    gptq = layers.module(linear, result.codes, result.scale, grid.global_scale)
    start = LearnedFp4Rounding.from_fp4(linear, gptq, result.positions, scheme, torch.float32, layers)
    assert torch.equal(start.export().weight_packed, gptq.weight_packed)
    assert torch.equal(start.export().weight_scale, gptq.weight_scale)


@pytest.mark.parametrize(("symmetric", "act_order"), [(True, False), (False, True)])
def test_gptq_start_is_gptq_solution_exactly(symmetric, act_order):
    """GPTQ's positions round (within the code range) to its codes, so with V = 0 the refinement starts from GPTQ's
    stored layer bit for bit."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=generator) @ torch.randn(64, 64, generator=generator)
    linear = torch.nn.Linear(64, 24, bias=True)
    scheme = WeightScheme(4, 32, symmetric)
    result = gptq_quantize(linear.weight.data, x.T @ x, scheme, act_order=act_order, keep_positions=True)
    zero = 0 if result.zero_point is None else result.zero_point.float().repeat_interleave(32, 1)
    rounded = (torch.round(result.positions) + zero).clamp(scheme.qmin, scheme.qmax)
    assert torch.equal(rounded, result.codes.float())
    gptq = QuantizedLinear.from_codes(result.codes, result.scale, result.zero_point, 4, 32, linear.bias.data)
    start = LearnedRounding.starting_from(linear, gptq, result.positions, scheme, torch.float32)
    assert torch.equal(start.export().weight_packed, gptq.weight_packed)
    assert torch.equal(start.export().weight_scale, gptq.weight_scale)


def test_refining_gptq_keeps_or_lowers_its_error():
    expected = _logits(build_tiny_llama(), SAMPLES)
    errors, summaries = {}, {}
    for name, chain in {
        "gptq": [{"type": "gptq", "group_size": 32}],
        "signround": [{"type": "signround", "group_size": 32, "init": "gptq", "iterations": 30, "lr": 0.005}],
    }.items():
        model = build_tiny_llama()
        summaries[name] = compress_model(model, chain, SAMPLES, batch_size=8)[0]
        errors[name] = relative_error(_logits(model, SAMPLES), expected)
    assert summaries["signround"]["algorithm"].startswith("sign-gradient rounding from GPTQ's solution")
    assert summaries["signround"]["mean_loss_vs_start"] < 1.0
    assert errors["signround"] < errors["gptq"], errors


def test_the_next_layer_is_fed_by_the_refined_layer_not_by_gptq():
    """Starting from GPTQ, GPTQ's walk leaves its own outputs in the context; the refined layer differs, and feeding
    the next layer GPTQ's outputs made each layer correct an upstream error the final model no longer has (x1.8
    perplexity on the default model before this was fixed)."""
    from compress.model.layer_walk import capture_first_layer_inputs, run_layer
    from compress.stages.base import LayerContext

    model = build_tiny_llama()
    inputs = capture_first_layer_inputs(model, SAMPLES, 8, torch.device("cpu"))
    [stage] = build_chain([{"type": "signround", "group_size": 32, "init": "gptq", "iterations": 20, "lr": 0.05}])
    stage.prepare(model)
    layer = decoder_layers(model)[0]
    ctx = LayerContext(0, "model.layers.0", layer, model.config, inputs, torch.device("cpu"))
    stage.process_layer(ctx)
    assert stage.layer_losses["model.layers.0"]["best_loss"] < stage.layer_losses["model.layers.0"]["start_loss"]
    if ctx.outputs is not None:
        expected = run_layer(layer, inputs, "model.layers.0").hidden
        assert all(torch.equal(a, b) for a, b in zip(ctx.outputs.hidden, expected, strict=True))


def _first_layer(config: dict, samples: torch.Tensor = SAMPLES, per_batch: int | None = None):
    """A stage prepared on a tiny model, the context of its layer 0 (calibration batches of ``per_batch`` samples,
    by default one batch of every sample) and the full-precision layer's outputs, the stage's targets."""
    from compress.model.layer_walk import capture_first_layer_inputs, run_layer
    from compress.stages.base import LayerContext

    model = build_tiny_llama()
    inputs = capture_first_layer_inputs(model, samples, per_batch or len(samples), torch.device("cpu"))
    [stage] = build_chain([{"group_size": 32, **config}])
    stage.prepare(model)
    layer = decoder_layers(model)[0]
    targets = run_layer(layer, inputs, "reference")
    return stage, LayerContext(0, "model.layers.0", layer, model.config, inputs, torch.device("cpu")), targets


def _output_error(ctx, targets) -> float:
    from compress.model.layer_walk import run_layer

    out = run_layer(ctx.layer, ctx.inputs, "quantized").hidden
    return sum(float((o - t).pow(2).sum()) for o, t in zip(out, targets.hidden, strict=True))


@pytest.mark.parametrize("symmetric", [True, False])
def test_min_and_max_scales_at_one_and_zero_offsets_export_round_to_nearest_bit_for_bit(symmetric):
    """AutoRound's parameters at their start (V = 0, α = β = 1) are round-to-nearest, zero points included; each of α
    and β then moves its own end of the range: shrinking the maximum alone keeps the weights at the minimum's end."""
    linear = torch.nn.Linear(64, 24, bias=True)
    scheme = WeightScheme(4, 32, symmetric)
    module = LearnedRounding.nearest(linear, scheme, torch.float32)
    assert torch.equal(module.max_scale, torch.ones(24, 2, 1)) and torch.equal(module.min_scale, torch.ones(24, 2, 1))
    exported = module.export()
    codes, scale, zero = quantize(linear.weight.data, scheme, scale_dtype=torch.float32)
    assert torch.equal(exported.weight_packed, QuantizedLinear.from_codes(codes, scale, zero, 4, 32).weight_packed)
    assert torch.equal(exported.weight_scale, scale)
    assert (exported.weight_zero_point is None) == symmetric
    if not symmetric:
        assert torch.equal(exported.weight_zero_point, zero)
        with torch.no_grad():
            module.max_scale.fill_(0.5)
        clipped = module.export()
        assert not torch.equal(clipped.weight_scale, scale)
        lowest = linear.weight.data.argmin(1)  # the most negative weight of each row stays where it was, about
        before = exported.dequantized_weight().gather(1, lowest[:, None])
        after = clipped.dequantized_weight().gather(1, lowest[:, None])
        assert torch.allclose(before, after, atol=float(clipped.weight_scale.max()))


def test_offsets_and_min_max_scales_stay_in_the_published_box():
    """A target no rounding can reach (the block's linears silenced: output = its input) pulls every weight to zero:
    offsets run into ±½ and the min/max scales into ½, where they must stop, with the best (last) iterate kept."""
    stage, ctx, _ = _first_layer({"type": "signround", "iterations": 12, "lr": 0.2, "batch_size": 8})
    from compress.model.layer_walk import LayerInputs
    from compress.stages.signround import _frozen, _swap
    from compress.stages.weights import target_linears

    unreachable = LayerInputs(hidden=[h.clone() for h in ctx.inputs.hidden], kwargs=ctx.inputs.kwargs)
    modules = stage._starting_points(ctx, target_linears(ctx.layer, ctx.name, []))
    with _frozen(ctx.layer):
        for name, module in modules.items():
            _swap(ctx.layer, name, module)
        losses = stage._train(ctx, modules, unreachable)
    assert losses["best_step"] > 0
    offsets = torch.cat([m.offset.detach().flatten() for m in modules.values()])
    scales = torch.cat([torch.cat([m.max_scale.flatten(), m.min_scale.flatten()]).detach() for m in modules.values()])
    assert float(offsets.abs().max()) == 0.5 and float(scales.min()) == 0.5 and float(scales.max()) <= 1.0


def test_step_size_starts_at_one_over_iterations_and_decays_linearly_to_zero():
    [stage] = build_chain([{"type": "signround"}])
    steps = stage.schedule()
    assert stage.config.iterations == 200 and stage.config.batch_size == 8 and stage.config.lr is None
    assert len(steps) == 200 and steps[0] == 1 / 200
    assert steps == pytest.approx([(1 / 200) * (1 - k / 200) for k in range(200)], rel=1e-12)
    decrements = [a - b for a, b in zip(steps, steps[1:], strict=False)]
    assert max(decrements) - min(decrements) < 1e-12 and 0 < steps[-1] < steps[0] / 100
    [fixed] = build_chain([{"type": "signround", "iterations": 4, "lr": 0.1}])
    assert fixed.schedule() == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_the_best_iterate_is_kept_not_the_last():
    """A schedule planted to overshoot (steps of 0.45 throw every offset to the edge of its box): the last iterates
    score worse than an earlier one, and the layer exported is the best one: its error on the calibration tokens (every
    sample in each step's batch, so a step's loss is that error) is the lowest step loss, not the last."""
    stage, ctx, targets = _first_layer({"type": "signround", "iterations": 6, "lr": 0.45, "batch_size": 8})
    stage.process_layer(ctx)
    losses = stage.step_losses["model.layers.0"]
    kept = stage.layer_losses["model.layers.0"]
    assert losses[-1] > min(losses) and kept["best_loss"] == min(losses)
    tokens = sum(h.numel() for h in targets.hidden)
    assert _output_error(ctx, targets) / tokens == pytest.approx(min(losses), rel=1e-4)


def test_a_step_larger_than_a_calibration_batch_draws_from_several():
    """AutoRound draws a step's sequences from the whole calibration set. Eight sequences a step over calibration
    batches of two must use all four batches: the first step's loss (round-to-nearest's parameters) is then the
    error over every calibration token, not over one batch's two sequences."""
    stage, ctx, targets = _first_layer({"type": "signround", "iterations": 1, "batch_size": 8}, per_batch=2)
    assert len(ctx.inputs.hidden) == 4
    stage.process_layer(ctx)
    [first] = stage.step_losses["model.layers.0"]
    rtn, rtn_ctx, _ = _first_layer({"type": "rtn"}, per_batch=2)
    rtn.process_layer(rtn_ctx)
    tokens = sum(h.numel() for h in targets.hidden)
    assert first == pytest.approx(_output_error(rtn_ctx, targets) / tokens, rel=1e-4)


def test_published_defaults_learn_a_layer_closer_to_full_precision_than_round_to_nearest():
    """AutoRound's defaults (200 steps of 8 sequences from round-to-nearest, α and β learned) on one tiny block."""
    errors = {}
    for name, config in {"rtn": {"type": "rtn"}, "autoround": {"type": "signround"}}.items():
        stage, ctx, targets = _first_layer(config)
        stage.process_layer(ctx)
        errors[name] = _output_error(ctx, targets)
    assert errors["autoround"] < 0.7 * errors["rtn"], errors


@pytest.mark.parametrize("with_zero", [False, True])
def test_the_fused_fake_quantize_gradients_equal_autograd_of_the_expression(with_zero):
    """The hand-written backward (offsets, grid units, scales, zero points) against autograd of the expression it
    fuses, codes clamped at both ends included: a wrong gradient would only show as a worse rounding."""
    from compress.stages.learned_rounding import _FakeQuantize, round_ste

    gen = torch.Generator().manual_seed(3)
    shape, group = (6, 4, 16), (6, 4, 1)
    position = torch.randn(shape, generator=gen, dtype=torch.float64) * 5  # some codes beyond [-8, 7]
    leaves = {
        "offset": torch.rand(shape, generator=gen, dtype=torch.float64) - 0.5,
        "units": 0.8 + 0.4 * torch.rand(group, generator=gen, dtype=torch.float64),
        "scale": 0.01 + torch.rand(group, generator=gen, dtype=torch.float64),
        "zero": torch.randint(-2, 3, group, generator=gen).double() if with_zero else None,
    }
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)

    def grads(fused: bool) -> dict[str, torch.Tensor]:
        own = {k: None if v is None else v.clone().requires_grad_(True) for k, v in leaves.items()}
        offset, units, scale, zero = own["offset"], own["units"], own["scale"], own["zero"]
        if fused:
            out = _FakeQuantize.apply(position, offset, units, scale, zero, -8, 7)
        else:
            shifted = round_ste(position * units + offset) + (0 if zero is None else zero)
            out = (shifted.clamp(-8, 7) - (0 if zero is None else zero)) * scale
        out.backward(grad)
        return {k: v.grad for k, v in own.items() if v is not None}

    fused, reference = grads(True), grads(False)
    assert set(fused) == set(reference)
    for name in reference:
        torch.testing.assert_close(fused[name], reference[name], msg=name)
    assert (position * leaves["units"] + leaves["offset"]).abs().max() > 8  # the clamp was exercised
