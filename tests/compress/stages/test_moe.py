"""Mixture-of-Experts families (transformers 5 fuses their experts into 3-D parameters) through every stage, the
checkpoint (per-expert names as hub checkpoints and vLLM spell them), transformers' loader and ours; and the
one-line refusal of fused weights no stage knows, before any work."""

import json

import pytest
import torch
from helpers import MOE_FAMILIES, build_tiny_deepseek_v3, build_tiny_moe, never_route_to, relative_error
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import Fp8Linear, Int8Linear, QuantizedLinear
from compress.formats.moe_experts import UnfusedExperts, unfuse_experts
from compress.grids.sparsity import mask_of
from compress.stages import LayerContext, build_chain
from compress.stages.mappings import layer_mappings, previous_width

CPU = torch.device("cpu")
VOCAB = 320
SAMPLES = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
EXPERTS, LAYERS = 4, 2
# recipe → (stages, bound on the relative logit error, module type every expert linear must end as)
CHAINS = {
    "rtn": ([{"type": "rtn", "group_size": 32}], 0.3, QuantizedLinear),
    "gptq": ([{"type": "gptq", "group_size": 32}], 0.3, QuantizedLinear),
    "awq": ([{"type": "awq", "group_size": 32, "grid": 5, "clip_grid": 5}], 0.3, QuantizedLinear),
    "gptq_input_correction": ([{"type": "gptq", "group_size": 32, "input_correction": True}], 0.3, QuantizedLinear),
    "signround": ([{"type": "signround", "group_size": 32, "iterations": 4, "batch_size": 2}], 0.3, QuantizedLinear),
    "smoothquant_w8a8": ([{"type": "smoothquant"}, {"type": "w8a8"}], 0.03, Int8Linear),
    "fp8_static": ([{"type": "fp8", "activations": "static"}], 0.1, Fp8Linear),
    "kv_int8": ([{"type": "kv_cache", "dtype": "int8"}], 0.03, torch.nn.Linear),
    "sparsegpt": ([{"type": "sparsegpt"}], 0.8, torch.nn.Linear),
    "wanda": ([{"type": "wanda"}], 0.8, torch.nn.Linear),
}


def _logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def _expert_linears(model) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if ".experts." in name and name.count(".") == 6 and hasattr(module, "in_features")
    }


def _compress(family: str, chain: list[dict]):
    model = build_tiny_moe(family, VOCAB)
    stages = build_chain(chain)
    summaries = compress_model(model, stages, SAMPLES, CPU, batch_size=4)
    return model, stages, summaries


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("recipe", list(CHAINS))
def test_every_stage_compresses_every_expert_and_the_checkpoint_reloads(tmp_path, family, recipe):
    chain, bound, expert_type = CHAINS[recipe]
    reference = _logits(build_tiny_moe(family, VOCAB))
    model, stages, summaries = _compress(family, chain)
    compressed = _logits(model)
    error = relative_error(compressed, reference)
    assert 0 < error < bound, f"{family}/{recipe}: relative logit error {error:.4f}"
    experts = _expert_linears(model)
    assert len(experts) == LAYERS * EXPERTS * 3
    assert all(type(module) is expert_type for module in experts.values())
    if stages[0].prunes_weights:
        assert all(mask_of(module) is not None for module in experts.values())
    kv_scheme = next((s.kv_cache_scheme for s in stages if s.quantizes_kv_cache), None)
    save_checkpoint(model, None, tmp_path / "ckpt", kv_cache_scheme=kv_scheme)
    reloaded, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.allclose(_logits(reloaded), compressed, atol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routers_stay_dense_and_the_checkpoint_ignores_them(tmp_path, family):
    model, _, _ = _compress(family, CHAINS["gptq"][0])
    router = model.model.layers[0].mlp.gate
    assert not isinstance(router, QuantizedLinear | Int8Linear | Fp8Linear)
    save_checkpoint(model, None, tmp_path / "ckpt")
    ignore = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]["ignore"]
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert f"model.layers.0.{block}.gate" in ignore and f"model.layers.1.{block}.gate" in ignore
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate" in ignore
        assert type(model.model.layers[0].mlp.shared_expert_gate) is torch.nn.Linear


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpoint_names_are_the_hub_layout_vllm_loads_and_transformers_reads_them(tmp_path, family):
    """Every tensor of the int4 checkpoint is a name of the float model's hub layout (what transformers itself
    saves: per-expert linears, Mixtral's block_sparse_moe.experts.N.w1) plus a compressed-tensors suffix; loading
    the folder with transformers (its MoE weight conversion fuses the experts back) gives our logits."""
    float_model = build_tiny_moe(family, VOCAB)
    float_model.save_pretrained(tmp_path / "float")
    hub_names = _keys(tmp_path / "float")
    model, _, _ = _compress(family, CHAINS["gptq"][0])
    save_checkpoint(model, None, tmp_path / "ckpt")
    ours = _keys(tmp_path / "ckpt")
    packed = {key.rpartition(".")[0] for key in ours if key.endswith(".weight_packed")}
    assert len(packed) == LAYERS * (4 + EXPERTS * 3 + (3 if family == "qwen2_moe" else 0))
    assert {f"{name}.weight" for name in packed} <= hub_names
    plain = {key for key in ours if not key.endswith(("weight_packed", "weight_scale", "weight_shape"))}
    assert plain == hub_names - {f"{name}.weight" for name in packed}  # biases, norms, routers, embeddings
    expert = "block_sparse_moe.experts.3.w2" if family == "mixtral" else "mlp.experts.3.down_proj"
    assert f"model.layers.1.{expert}.weight_packed" in ours and f"model.layers.1.{expert}.weight_scale" in ours
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.allclose(_logits(theirs), _logits(model), atol=1e-5)


@pytest.mark.parametrize("recipe", ["rtn", "gptq", "fp8_static", "sparsegpt"])
def test_deepseek_v3_experts_and_mla_linears_compress_and_reload_in_both_loaders(tmp_path, recipe):
    """DeepSeek-V3 (MLA attention, shared expert): the weight stages that need no scale mapping."""
    chain, bound, expert_type = CHAINS[recipe]
    model = build_tiny_deepseek_v3(VOCAB)
    reference = _logits(model)
    compress_model(model, chain, SAMPLES, CPU, batch_size=4)
    compressed = _logits(model)
    assert 0 < relative_error(compressed, reference) < bound
    experts = _expert_linears(model)
    assert len(experts) == LAYERS * EXPERTS * 3 and all(type(m) is expert_type for m in experts.values())
    save_checkpoint(model, None, tmp_path / "ckpt")
    assert torch.allclose(_logits(load_checkpoint(tmp_path / "ckpt")[0]), compressed, atol=1e-5)
    if recipe == "gptq":
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        assert torch.allclose(_logits(theirs), compressed, atol=1e-5)


def test_deepseek_v3_scale_folding_is_refused_in_one_line():
    with pytest.raises(CompressError, match=r"^AWQ: no scale mapping for model type 'deepseek_v3'; supported: "):
        compress_model(build_tiny_deepseek_v3(VOCAB), [{"type": "awq"}], SAMPLES, CPU, batch_size=4)


def _keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def test_unfusing_leaves_the_model_unchanged():
    for family in MOE_FAMILIES:
        model = build_tiny_moe(family, VOCAB)
        reference = _logits(model)
        assert unfuse_experts(model) == LAYERS
        assert isinstance(model.model.layers[1].mlp.experts, UnfusedExperts)
        assert torch.allclose(_logits(model), reference, atol=1e-5), family


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_awq_scale_folding_through_experts_and_router_leaves_the_float_model_unchanged(family):
    """Random scales through every MoE mapping: the norm → every expert's gate/up (and the router, which must absorb
    the scale or routing changes), each expert's up → its down."""
    model = build_tiny_moe(family, VOCAB)
    reference = _logits(model)
    unfuse_experts(model)
    [stage] = build_chain([{"type": "awq", "group_size": 32}])
    stage.prepare(model)
    generator = torch.Generator().manual_seed(2)
    for index, layer in enumerate(model.model.layers):
        ctx = LayerContext(index, f"model.layers.{index}", layer, model.config, None, CPU)
        mappings = layer_mappings(layer, stage.mappings)
        assert len(mappings) == 3 + EXPERTS + (1 if family == "qwen2_moe" else 0)
        for mapping in mappings:
            width = previous_width(layer, mapping, model.config)
            stage.apply_scale(ctx, mapping, torch.rand(width, generator=generator) * 3 + 0.25)
    assert relative_error(_logits(model), reference) < 1e-5


def test_every_expert_is_calibrated_and_the_report_names_the_ones_never_routed():
    """The router never picks expert 3: its statistics still cover every calibration token (GPTQ quantizes it from
    a real Hessian, not from nothing), and the summary names it as never routed."""
    model = build_tiny_moe("qwen3_moe", VOCAB)
    for layer in model.model.layers:
        never_route_to(layer.mlp.gate, 3)
    [summary] = compress_model(model, [{"type": "gptq", "group_size": 32}], SAMPLES, CPU, batch_size=4)
    tokens = SAMPLES.numel()
    for index in range(LAYERS):
        report = summary["expert_tokens"][f"model.layers.{index}.mlp.experts"]
        assert report["statistics_tokens_per_expert"] == tokens
        assert sum(report["routed_tokens_per_expert"]) == tokens * model.config.num_experts_per_tok
        assert report["routed_tokens_per_expert"][3] == 0 and min(report["routed_tokens_per_expert"][:3]) > 0
        assert report["never_routed"] == [3]
        stats = summary["per_layer"][f"model.layers.{index}.mlp.experts.3.down_proj"]
        assert 0 < stats["hessian_rel_error"] < 0.1


def test_rtn_quantizes_every_expert_of_the_qwen3_moe_that_main_left_in_full_precision():
    """The issue's case: on main, rtn_int4 on Qwen3-MoE quantized the 8 attention linears and silently kept every
    (fused) expert in full precision."""
    model, _, [summary] = _compress("qwen3_moe", [{"type": "rtn", "group_size": 32}])
    assert summary["quantized_linears"] == LAYERS * (4 + EXPERTS * 3)
    assert not [name for name, p in model.named_parameters() if p.dim() == 3]


def _gpt_oss():
    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
    )
    return GptOssForCausalLM(config).eval()


def _transposed_qwen3_moe():
    """A Qwen3-MoE whose experts store ``down_proj`` as [E, I, H] (gpt-oss's transposed layout): a fused layout the
    unfusing does not know, in a family it supports."""
    model = build_tiny_moe("qwen3_moe", VOCAB)
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data.transpose(1, 2).contiguous())
    return model


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (_gpt_oss, r"^rtn: model\.layers\.0\.mlp\.router\.weight \(\[4, 64\], in GptOssTopKRouter\) is a weight rtn "),
        (
            _transposed_qwen3_moe,
            r"^rtn: model\.layers\.0\.mlp\.experts\.gate_up_proj \(\[4, 64, 64\], in Qwen3MoeExperts\)",
        ),
    ],
)
@pytest.mark.parametrize("recipe", ["rtn", "gptq", "fp8_static", "sparsegpt", "smoothquant_w8a8"])
def test_weights_no_stage_knows_are_refused_in_one_line_before_any_work(build, message, recipe):
    model = build()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    chain = CHAINS[recipe][0]
    with pytest.raises(CompressError) as error:
        compress_model(model, chain, SAMPLES, CPU, batch_size=4)
    text = str(error.value)
    assert "\n" not in text and "supported MoE families: deepseek_v3, mixtral, qwen2_moe, qwen3_moe" in text
    if recipe == "rtn":
        assert error.match(message)
    after = model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


@pytest.mark.usefixtures("default_mlflow_store")
def test_run_rtn_int4_on_qwen3_moe_quantizes_every_expert_and_writes_vllm_names(tmp_path, artifacts):
    """The issue's command, end to end through the CLI: on main it exited 0 with 8 quantized linears."""
    from helpers import build_tiny_tokenizer

    from compress.__main__ import main

    tokenizer = build_tiny_tokenizer()
    build_tiny_moe("qwen3_moe", len(tokenizer)).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    small = ["data.num_samples=4", "data.seq_len=64", "eval.seq_len=64", "eval.max_windows=2", "stages.0.group_size=32"]
    assert main(["run", "recipe=rtn_int4", f"model={tmp_path / 'moe'}", *small, "gate=none"]) == 0
    [run_dir] = (artifacts / "runs").iterdir()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["checkpoint"]["quantized_linears"] == LAYERS * (4 + EXPERTS * 3)
    assert "model.layers.1.mlp.experts.3.up_proj.weight_packed" in _keys(run_dir / "checkpoint")
