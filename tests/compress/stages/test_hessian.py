"""GPTQ and SparseGPT solve against one Hessian, gathered and inverted by compress.stages.hessian."""

import copy

import pytest
import torch
from helpers import FAMILIES, build_tiny_llama, build_tiny_model

from compress.base.errors import CompressError
from compress.grids.int_grid import WeightScheme, fake_quantize
from compress.grids.sparsity import NMPattern
from compress.model.layer_walk import capture_first_layer_inputs, decoder_layers, run_layer
from compress.stages import LayerContext
from compress.stages.gptq import gptq_quantize
from compress.stages.hessian import (
    HessianAccumulator,
    _stand_in,
    cholesky_inverse_upper,
    collect_hessians,
    input_groups,
    sequential_hessians,
    without_dead_channels,
)
from compress.stages.prune import sparsegpt_prune
from compress.stages.weights import target_linears

CPU = torch.device("cpu")


@pytest.mark.parametrize("width", [32, 600])  # one block; three blocks of rows, the last one short
def test_accumulated_hessian_is_the_second_moment_over_every_batch(width):
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(tokens, width, generator=generator) for tokens in (7, 64, 19)]
    full, diagonal = HessianAccumulator(), HessianAccumulator(diagonal=True)
    for x in batches:
        full.add(x)
        diagonal.add(x)
    x = torch.cat(batches).double()
    expected = x.T @ x / len(x)
    assert torch.allclose(full.hessian().double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(diagonal.hessian().double(), expected.diagonal(), rtol=1e-5, atol=1e-6)


def _first_layer_context(batches: int = 2) -> LayerContext:
    model = build_tiny_llama(seed=3)
    samples = torch.randint(0, 320, (2 * batches, 16), generator=torch.Generator().manual_seed(1))
    inputs = capture_first_layer_inputs(model, samples, 2, CPU)
    return LayerContext(0, "model.layers.0", decoder_layers(model)[0], model.config, inputs, CPU)


def test_layer_hessians_match_the_inputs_seen_and_shared_inputs_share_one():
    ctx = _first_layer_context()
    seen: dict[str, list[torch.Tensor]] = {"self_attn.q_proj": [], "mlp.down_proj": []}
    handles = [
        ctx.layer.get_submodule(name).register_forward_hook(
            lambda _m, args, _o, name=name: seen[name].append(args[0].reshape(-1, args[0].shape[-1]).double())
        )
        for name in seen
    ]
    with torch.no_grad():
        for hidden, kwargs in zip(ctx.inputs.hidden, ctx.inputs.kwargs, strict=True):
            ctx.layer(hidden, **kwargs)
    for handle in handles:
        handle.remove()
    names = ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"]
    hessians = collect_hessians(ctx, names, stop_at=None)
    for name in seen:
        x = torch.cat(seen[name])
        assert torch.allclose(hessians[name].double(), x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    assert torch.equal(hessians["self_attn.q_proj"], hessians["self_attn.k_proj"])  # one input, one Hessian
    stopped = collect_hessians(ctx, ["self_attn.q_proj"], stop_at="self_attn.q_proj")
    assert torch.equal(stopped["self_attn.q_proj"], hessians["self_attn.q_proj"])


def test_a_linear_the_forward_never_reaches_is_named():
    ctx = _first_layer_context(batches=1)
    with pytest.raises(CompressError, match=r"model.layers.0.mlp.down_proj: no calibration token reached"):
        collect_hessians(ctx, ["mlp.down_proj"], stop_at="self_attn.q_proj")


def test_input_groups_put_linears_that_read_one_input_together_in_forward_order():
    targets = ["mlp.down_proj", "self_attn.v_proj", "mlp.up_proj", "self_attn.q_proj", "mlp.gate_proj", "extra"]
    assert input_groups(targets) == [
        ["self_attn.q_proj", "self_attn.v_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
        ["extra"],
    ]


def test_gptq_and_sparsegpt_refuse_a_non_positive_definite_hessian_with_the_same_line():
    """Negative definite: no dampening relative to mean(diag H) can fix it, so both give up with one clear line."""
    hessian = -torch.eye(32)
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    solvers = (
        lambda: sparsegpt_prune(weight, hessian, NMPattern(2, 4), dampening=0.01, retries=2, name="layer.q_proj"),
        lambda: gptq_quantize(
            weight, hessian, WeightScheme(4, 32), dampening=0.01, max_damp_retries=2, name="layer.q_proj"
        ),
    )
    messages = []
    for solve in solvers:
        with pytest.raises(CompressError) as error:
            solve()
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("layer.q_proj: the Hessian stayed singular after 2 dampening increases")
    assert "\n" not in messages[0]


def _rtn_in_place(layer: torch.nn.Module, names: list[str]) -> None:
    """A stand-in for what GPTQ/SparseGPT do to a group between two statistics: change its weights."""
    with torch.no_grad():
        for name in names:
            linear = layer.get_submodule(name)
            linear.weight.copy_(fake_quantize(linear.weight, WeightScheme(3, 16, True)))


@pytest.mark.parametrize("family", FAMILIES)
def test_sequential_hessians_equal_one_forward_per_group_and_leave_the_layer_outputs(family):
    """The replaying walk (scopes rerun from recorded inputs, final attention outputs rebuilt from o_proj's input)
    must see exactly what a forward of the whole layer up to each group sees after the groups before it changed."""
    model = build_tiny_model(family, seed=5)
    samples = torch.randint(0, 320, (6, 16), generator=torch.Generator().manual_seed(2))
    inputs = capture_first_layer_inputs(model, samples, 2, CPU)
    reference_layer = decoder_layers(model)[0]
    layer = copy.deepcopy(reference_layer)
    groups = input_groups(target_linears(layer, "model.layers.0", []))
    ctx = LayerContext(0, "model.layers.0", layer, model.config, inputs, CPU)
    reference_ctx = LayerContext(0, "model.layers.0", reference_layer, model.config, inputs, CPU)
    for group, hessian in sequential_hessians(ctx, groups):
        expected = collect_hessians(reference_ctx, [group[0]], stop_at=group[0])[group[0]]
        assert torch.allclose(hessian, expected, rtol=1e-5, atol=1e-7), group
        _rtn_in_place(layer, group)
        _rtn_in_place(reference_layer, group)
    expected_outputs = run_layer(reference_layer, inputs, "model.layers.0")
    for output, expected in zip(ctx.outputs.hidden, expected_outputs.hidden, strict=True):
        assert torch.allclose(output, expected, rtol=1e-5, atol=1e-6)


def test_upper_inverse_factor_is_the_cholesky_factor_of_the_dampened_inverse():
    x = torch.randn(512, 48, generator=torch.Generator().manual_seed(0)).double()
    hessian = x.T @ x / len(x)
    given = hessian.clone()
    upper, damp, retries = cholesky_inverse_upper(hessian, 0.01, 0, "q_proj")
    assert torch.equal(hessian, given)  # damped on a copy, never in place
    dampened = hessian + 0.01 * hessian.diagonal().mean() * torch.eye(48, dtype=hessian.dtype)
    assert retries == 0 and torch.equal(upper, upper.triu()) and bool((upper.diagonal() > 0).all())
    assert torch.allclose(upper.T @ upper, torch.linalg.inv(dampened), rtol=1e-8, atol=1e-10)


def test_dead_inputs_are_fixed_on_copies_and_live_ones_are_not_copied():
    """A 4B model's down_proj Hessian is 268 MB: copy it only when a dead input must be changed."""
    weight, hessian = torch.randn(4, 3), torch.eye(3)
    W, H = without_dead_channels(weight, hessian)
    assert W.data_ptr() == weight.data_ptr() and H.data_ptr() == hessian.data_ptr()
    hessian[1, 1] = 0.0
    W, H = without_dead_channels(weight, hessian)
    assert torch.equal(H, torch.eye(3)) and bool((W[:, 1] == 0).all()) and bool((weight[:, 1] != 0).all())
    assert hessian[1, 1] == 0


class _CountLinearProducts(torch.overrides.TorchFunctionMode):
    """Counts ``F.linear`` calls per weight: the matrix products a walk actually computes."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names, self.counts = names, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            name = self.names.get(id(args[1]), "other")
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_sequential_hessians_compute_each_linear_once_per_batch():
    """Calibration is mostly matrix products: o_proj and down_proj used to run unquantized while their inputs were
    observed and again quantized, and the MLP's gate/up twice (down_proj's wider input was not kept); each linear
    of a layer whose kept inputs fit the budget now runs once per batch, on its final weights."""
    ctx = _first_layer_context(batches=3)
    groups = input_groups(target_linears(ctx.layer, "model.layers.0", []))
    names = {id(module.weight): name for name, module in ctx.layer.named_modules() if hasattr(module, "weight")}
    with _CountLinearProducts(names) as counter:
        for group, _hessian in sequential_hessians(ctx, groups):
            _rtn_in_place(ctx.layer, group)
    assert counter.counts == {name: 3 for name in sum(groups, [])}


def test_a_kept_linears_stand_in_output_holds_no_memory():
    """The zeros a kept linear returns while its inputs are observed are only compared by identity, never read: as
    real zeros they were a copy of the linear's output over every calibration token (402 MB for a 4B model's o_proj
    on 64x512 tokens) on top of the kept inputs."""
    recorded = []
    x = torch.randn(2, 5, 8)
    output = _stand_in(x, 12, recorded)
    assert output.shape == (2, 5, 12) and output.dtype == x.dtype and not output.any()
    assert recorded[0] is output
    assert output.untyped_storage().nbytes() == output.element_size()
