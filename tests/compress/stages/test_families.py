"""Every compression stage on every supported family, then the checkpoint: the stage × family matrix.

Each family's tiny model (tests/helpers.py) keeps what sets it apart from Llama — Gemma's (1 + w) norms and sandwich
norms, Phi-3's fused qkv_proj/gate_up_proj, Qwen3/Gemma-3's k_norm, Gemma-2's soft-capping — with randomised norm
weights, so a folding rule that is right only for Llama changes the model and shows here.
"""

from dataclasses import dataclass

import pytest
import torch
from helpers import FAMILIES, build_tiny_model, relative_error
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import QuantizedLinear
from compress.model.layer_walk import decoder_layers
from compress.stages import LayerContext, build_chain
from compress.stages.lora import read_adapter, save_adapter
from compress.stages.mappings import previous_width
from tests.compress.stages.test_lora import _merge, _random_factors, _unmerged_logits

CPU = torch.device("cpu")
VOCAB = 320
SAMPLES = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

# recipe → (stages, bound on the relative logit error after compression). The bounds hold with ~1.5x margin on the
# most sensitive family (Gemma: its sandwich norms amplify each layer's error). On random weights pruning has no
# redundancy to exploit: half of each linear's weights removed moves the logits 0.50-0.72 of the way to the model whose
# decoder linears output zeros (measured on every family), so a pruning bound is that share of the zeroed model's
# error, which a pruner that zeroes whole linears cannot meet, and half of every pruned linear must be zeros.


@dataclass(frozen=True)
class OfZeroed:
    """A bound that is ``share`` x the relative logit error of the family's model with its decoder linears zeroed."""

    share: float


FOUR_BIT, PRUNED = 0.5, OfZeroed(0.8)
CHAINS = {
    "rtn": ([{"type": "rtn", "group_size": 32}], FOUR_BIT),
    "awq": ([{"type": "awq", "group_size": 32, "grid": 5, "clip_grid": 5}], FOUR_BIT),
    "gptq": ([{"type": "gptq", "group_size": 32}], FOUR_BIT),
    "gptq_input_correction": ([{"type": "gptq", "group_size": 32, "input_correction": True}], FOUR_BIT),
    "signround": ([{"type": "signround", "group_size": 32, "iterations": 4, "batch_size": 2}], FOUR_BIT),
    "smoothquant_w8a8": ([{"type": "smoothquant"}, {"type": "w8a8"}], 0.06),
    "fp8_dynamic": ([{"type": "fp8"}], 0.2),
    "fp8_static": ([{"type": "fp8", "activations": "static"}], 0.2),
    "kv_int8": ([{"type": "kv_cache", "dtype": "int8"}], 0.04),
    "kv_fp8": ([{"type": "kv_cache", "dtype": "fp8"}], 0.12),
    "sparsegpt": ([{"type": "sparsegpt"}], PRUNED),
    "wanda": ([{"type": "wanda"}], PRUNED),
    "magnitude": ([{"type": "magnitude_prune"}], PRUNED),
    "distill": ([{"type": "magnitude_prune"}, {"type": "distill", "steps": 2, "seq_len": 16, "held_out": 1}], PRUNED),
}


def _logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _compress(family: str, chain: list[dict]):
    model = build_tiny_model(family, VOCAB)
    stages = build_chain(chain)
    compress_model(model, stages, SAMPLES, CPU, batch_size=4)
    return model, stages


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", list(CHAINS))
def test_stage_runs_stays_close_and_checkpoint_reloads_identically(tmp_path, family, recipe):
    reference = _logits(build_tiny_model(family, VOCAB))
    model, stages = _compress(family, CHAINS[recipe][0])
    compressed = _logits(model)
    _check_error(family, recipe, compressed, reference)
    if isinstance(CHAINS[recipe][1], OfZeroed):
        for layer in decoder_layers(model):
            for name, linear in layer.named_modules():
                if type(linear) is torch.nn.Linear:
                    assert (linear.weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01), name
    kv_scheme = next((s.kv_cache_scheme for s in stages if s.quantizes_kv_cache), None)
    save_checkpoint(model, None, tmp_path / "ckpt", kv_cache_scheme=kv_scheme)
    reloaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.allclose(_logits(reloaded), compressed, atol=1e-5)


def _zeroed_model(family: str) -> torch.nn.Module:
    """The family's model with every decoder linear's output zero: what a pruner that breaks the model gives."""
    model = build_tiny_model(family, VOCAB)
    with torch.no_grad():
        for layer in decoder_layers(model):
            for linear in layer.modules():
                if type(linear) is torch.nn.Linear:
                    linear.weight.zero_()
                    if linear.bias is not None:
                        linear.bias.zero_()
    return model


def _check_error(family: str, recipe: str, compressed: torch.Tensor, reference: torch.Tensor) -> None:
    """The compressed model moved (a stage ran) and stayed within the recipe's bound."""
    bound = CHAINS[recipe][1]
    if isinstance(bound, OfZeroed):
        bound = bound.share * relative_error(_logits(_zeroed_model(family)), reference)
    error = relative_error(compressed, reference)
    assert 0 < error < bound, f"{family}/{recipe}: relative logit error {error:.4f} (bound {bound:.4f})"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", [recipe for recipe, (_, bound) in CHAINS.items() if isinstance(bound, OfZeroed)])
def test_a_model_whose_linears_output_zeros_fails_the_pruning_bound(family, recipe):
    """The pruning bound catches a pruner that breaks the model (the old absolute bound of 1.5 let it pass)."""
    reference = _logits(build_tiny_model(family, VOCAB))
    with pytest.raises(AssertionError, match="relative logit error"):
        _check_error(family, recipe, _logits(_zeroed_model(family)), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_symmetric_pack_quantized_checkpoint(tmp_path, family):
    linears = len(_linear_names(build_tiny_model(family, VOCAB)))
    model, _ = _compress(family, CHAINS["gptq"][0])
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 2 * linears
    save_checkpoint(model, None, tmp_path / "ckpt")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.allclose(_logits(theirs), _logits(model), atol=1e-5)


def _linear_names(model) -> list[str]:
    return [name for name, m in decoder_layers(model)[0].named_modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_scale_folding_leaves_the_float_model_unchanged(family):
    """Random scales folded through every AWQ mapping of every layer, no rounding: the model's function must not
    move (Gemma's (1 + w) norms, its pre-feedforward norm, Phi-3's v rows and up half, GQA head repetition)."""
    model = build_tiny_model(family, VOCAB)
    reference = _logits(model)
    [stage] = build_chain([{"type": "awq", "group_size": 32}])
    stage.prepare(model)
    generator = torch.Generator().manual_seed(2)
    for index, layer in enumerate(decoder_layers(model)):
        ctx = LayerContext(index, f"model.layers.{index}", layer, model.config, None, CPU)
        for mapping in stage.mappings:
            width = previous_width(layer, mapping, model.config)
            stage.apply_scale(ctx, mapping, torch.rand(width, generator=generator) * 3 + 0.25)
    assert len(stage.mappings) == 4
    assert relative_error(_logits(model), reference) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_smoothquant_alone_leaves_the_float_model_unchanged(family):
    model = build_tiny_model(family, VOCAB)
    reference = _logits(model)
    norms_before = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    _, [stage] = _run_on(model, [{"type": "smoothquant", "alpha": 0.8}])
    moved = max((p - norms_before[n]).abs().max().item() for n, p in model.named_parameters() if "norm" in n)
    assert stage.finalize(model)["smoothed_norms"] == 4 and moved > 0.1  # the scales really did something
    assert relative_error(_logits(model), reference) < 1e-5


def _run_on(model, chain):
    stages = build_chain(chain)
    compress_model(model, stages, SAMPLES, CPU, batch_size=4)
    return model, stages


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_scales_come_from_the_keys_the_cache_holds(family):
    """K is observed after k_norm (Qwen3, Gemma-3) and rotary embedding: layer 0's scale is the cached keys' peak."""
    original = build_tiny_model(family, VOCAB)
    with torch.no_grad():
        cache = original(SAMPLES, use_cache=True).past_key_values
    cached = cache.layers[0]
    model, _ = _run_on(build_tiny_model(family, VOCAB), [{"type": "kv_cache", "dtype": "int8"}])
    attention = decoder_layers(model)[0].self_attn
    for stored, states in ((attention.k_scale, cached.keys), (attention.v_scale, cached.values)):
        expected = states.abs().amax(dim=(0, 2, 3)) / 127.0
        assert torch.allclose(stored.flatten(), expected, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_merge_on_every_linear(tmp_path, family):
    base = build_tiny_model(family, VOCAB)
    targets = tuple(_linear_names(base))
    adapter = save_adapter(tmp_path / "adapter", _random_factors(base, rank=4, seed=1, targets=targets), 4, 8)
    expected = _unmerged_logits(base, [(read_adapter(adapter), 1.0)], TOKENS)
    assert relative_error(expected, _logits(base)) > 1e-2  # the adapter really changes the model
    _merge(base, [str(adapter)])
    assert torch.allclose(_logits(base), expected, atol=1e-5)


def test_family_without_scale_mappings_is_refused_naming_the_supported_ones():
    model = build_tiny_model("llama", VOCAB)
    model.config.model_type = "gpt_neox"
    for kind, stage_name in (("awq", "AWQ"), ("smoothquant", "SmoothQuant")):
        [stage] = build_chain([{"type": kind}])
        with pytest.raises(
            CompressError,
            match=rf"^{stage_name}: no scale mapping for model type 'gpt_neox'; "
            "supported: gemma2, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe$",
        ):
            stage.prepare(model)


@pytest.mark.parametrize("kind", ["gptq", "sparsegpt"])
def test_phi3_fused_linears_run_in_true_sequential_order(kind):
    """o_proj's statistics must be gathered after qkv_proj is compressed (so it compensates qkv's error), as for the
    unfused q/k/v: Phi-3 declares o_proj first, which the walk must not follow."""
    _, [stage] = _compress("phi3", [{"type": kind, **({"group_size": 32} if kind == "gptq" else {})}])
    done = list(stage.stats if kind == "gptq" else stage.pruned)
    suffixes = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    assert done[:4] == [f"model.layers.0.{name}" for name in suffixes]
