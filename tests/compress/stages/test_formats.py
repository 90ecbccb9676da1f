"""FP8-block and FP4 (NVFP4, MXFP4) formats end to end: stage on a tiny model -> checkpoint -> our loader and
transformers + compressed-tensors; GPTQ on the FP4 grid against RTN; shapes refused in one line; recipes compose."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from compressed_tensors.quantization import preset_name_to_scheme
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.base.errors import CompressError
from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.formats import Fp4Linear, Fp8BlockLinear
from compress.grids.int_grid import WeightScheme
from compress.kernels.backend import use_backend
from compress.kernels.fp4 import pack_fp4
from compress.stages import build_chain
from compress.stages.fp4_weights import Fp4Grid, rtn_fp4
from compress.stages.gptq import gptq_quantize

CPU = torch.device("cpu")
RECIPES = Path(__file__).resolve().parents[3] / "recipes"
FP4 = {"type": "rtn", "bits": 4, "symmetric": True}
PRESETS = {  # compressed-tensors preset -> (our stage, the checkpoint format)
    "FP8_BLOCK": ({"type": "fp8", "strategy": "block"}, "float-quantized"),
    "NVFP4A16": ({**FP4, "format": "nvfp4", "group_size": 16}, "nvfp4-pack-quantized"),
    "NVFP4": ({**FP4, "format": "nvfp4", "group_size": 16, "activations": "fp4"}, "nvfp4-pack-quantized"),
    "MXFP4A16": ({**FP4, "format": "mxfp4", "group_size": 32}, "mxfp4-pack-quantized"),
    "MXFP4": ({**FP4, "format": "mxfp4", "group_size": 32, "activations": "fp4"}, "mxfp4-pack-quantized"),
}
SIGNROUND = {"type": "signround", "iterations": 4, "batch_size": 2}
CASES = [  # (compressed-tensors preset, stage, checkpoint format): every preset, and SignRound's FP4 exports
    *((preset, *PRESETS[preset]) for preset in PRESETS),
    ("NVFP4A16", {**SIGNROUND, "format": "nvfp4", "group_size": 16}, "nvfp4-pack-quantized"),
    ("MXFP4A16", {**SIGNROUND, "format": "mxfp4", "group_size": 32, "init": "gptq"}, "mxfp4-pack-quantized"),
]


def _bf16_model(**overrides):
    """A bf16 checkpoint: compressed-tensors decompresses FP4 weights to bf16, so transformers runs FP4 in bf16."""
    model = build_tiny_llama(seed=3, hidden_size=128, intermediate_size=256, **overrides)
    frequencies = model.model.rotary_emb.inv_freq.clone()  # .to() casts them; a loaded bf16 model keeps them fp32
    model.to(torch.bfloat16).model.rotary_emb.inv_freq = frequencies
    model.config.dtype = torch.bfloat16
    return model


@pytest.mark.parametrize(("preset", "stage", "fmt"), CASES, ids=[f"{p}-{s['type']}" for p, s, _ in CASES])
def test_checkpoint_is_the_compressed_tensors_preset_and_transformers_loads_it(tmp_path, preset, stage, fmt):
    model = _bf16_model()
    compress_model(model, [stage], torch.randint(0, 320, (4, 32)), CPU, batch_size=4)
    save_checkpoint(model, None, tmp_path / "ckpt")
    qconfig = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    [group] = qconfig["config_groups"].values()
    assert qconfig["format"] == fmt and group.pop("format") == fmt
    expected = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    assert group == {key: value for key, value in expected.items() if key != "format"}

    tokens = torch.randint(0, 320, (2, 24))
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    with torch.no_grad():
        in_memory, loaded, reference = (m(tokens).logits.float() for m in (model, ours, theirs))
    assert torch.equal(loaded, in_memory)  # our loader rebuilds exactly what the stage made
    kind = Fp8BlockLinear if preset == "FP8_BLOCK" else Fp4Linear
    assert isinstance(ours.model.layers[1].mlp.down_proj, kind)

    # The weights transformers decompresses are ours (to its bf16 rounding); with 16-bit activations so are logits.
    mine, yours = ours.model.layers[1].mlp.down_proj, theirs.model.layers[1].mlp.down_proj
    dense = mine.dequantized_weight()
    assert (yours.weight.float() - dense).abs().max() <= dense.abs().max() * 2**-8
    scale = reference.abs().max()
    if "input_activations" not in group or group["input_activations"] is None:
        assert (loaded - reference).abs().max() <= 0.02 * scale
        return
    # Dynamic activation quantization: one linear on the same input. compressed-tensors' fake quant takes FP8
    # activation scales in bf16 (ours and vLLM's in fp32), so e4m3 codes near a rounding tie may differ by one step.
    x = torch.randn(4, 7, mine.in_features).mul(3).to(torch.bfloat16)
    with torch.no_grad():
        y_mine, y_yours = mine(x).float(), yours(x).float()
    tolerance = 0.05 if preset == "FP8_BLOCK" else 0.01
    assert (y_mine - y_yours).abs().max() <= tolerance * y_yours.abs().max()


def test_fp8_block_handles_partial_edge_blocks_and_runs_the_triton_kernel():
    """Widths that are not multiples of 128 (the default model's 576) get partial blocks; the Triton path (run by
    the interpreter here) gives the reference's numbers."""
    model = build_tiny_llama(seed=1, hidden_size=96, intermediate_size=160)
    compress_model(model, [{"type": "fp8", "strategy": "block"}], torch.zeros(1, 4, dtype=torch.long), CPU, 1)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Fp8BlockLinear) and tuple(layer.weight_scale.shape) == (1, 2)
    dense = build_tiny_llama(seed=1, hidden_size=96, intermediate_size=160).model.layers[0].mlp.down_proj.weight
    assert (layer.dequantized_weight() - dense).abs().max() <= dense.abs().max() / 16
    x = torch.randn(5, 160, dtype=torch.float16)
    with torch.no_grad():
        reference = layer(x)
        with use_backend("triton"):
            triton_out = layer(x)
    assert torch.allclose(triton_out.float(), reference.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_module_runs_the_triton_kernel_with_the_reference_numbers(fmt):
    torch.manual_seed(0)
    codes, scale, global_scale = rtn_fp4(torch.randn(48, 64), fmt)
    module = Fp4Linear.from_packed(pack_fp4(codes), scale, global_scale)
    x = torch.randn(3, 64, dtype=torch.float16)
    with torch.no_grad():
        reference = module(x)
        with use_backend("triton"):
            triton_out = module(x)
    assert torch.allclose(triton_out.float(), reference.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gptq_on_the_fp4_grid_has_lower_output_error_than_rtn(fmt):
    """Same grid, same group scales' recipe: GPTQ's compensation lowers the error on correlated inputs."""
    torch.manual_seed(0)
    inputs = torch.randn(1024, 64) @ (torch.eye(64) + 0.3 * torch.randn(64, 64))
    hessian = inputs.T @ inputs / inputs.shape[0]
    weight = torch.randn(32, 64)
    scheme = WeightScheme(4, 16 if fmt == "nvfp4" else 32, True, fmt)
    grid = Fp4Grid.for_weight(weight, fmt, clip_search=False)
    result = gptq_quantize(weight, hessian, scheme, grid=grid, clip_search=False)
    assert result.codes.min() >= 0 and result.codes.max() <= 15

    def output_error(dequantized):
        delta = dequantized - weight
        return float(((delta @ hessian) * delta).sum())

    codes, scale, global_scale = rtn_fp4(weight, fmt)
    rtn = Fp4Linear.from_packed(pack_fp4(codes), scale, global_scale).dequantized_weight()
    gptq = Fp4Grid.dequantize(result.codes, result.scale)
    assert output_error(gptq) < 0.8 * output_error(rtn)
    assert abs(result.hessian_error - output_error(gptq) / float(((weight @ hessian) * weight).sum())) < 1e-4


def test_gptq_fp4_stage_builds_fp4_modules_and_shares_the_global_scale_of_fused_linears():
    model = build_tiny_llama(seed=2)
    stage = {"type": "gptq", "format": "nvfp4", "group_size": 16, "activations": "fp4"}
    [summary] = compress_model(model, [stage], torch.randint(0, 320, (4, 32)), CPU, batch_size=4)
    attention = model.model.layers[0].self_attn
    q, k, o = attention.q_proj, attention.k_proj, attention.o_proj
    assert all(isinstance(m, Fp4Linear) and m.quantize_activations for m in (q, k, o))
    assert torch.equal(q.weight_global_scale, k.weight_global_scale)  # one fused qkv GEMM in vLLM
    assert torch.equal(q.input_global_scale, k.input_global_scale) and q.input_global_scale > 0
    assert summary["scheme"] == "nvfp4 e2m1 g16" and 0 < summary["mean_hessian_rel_error"] < 0.1


@pytest.mark.parametrize(
    ("stage", "hidden", "message"),
    [
        ({**FP4, "format": "nvfp4", "group_size": 16}, 72, "not a multiple of the nvfp4 group (16); add this layer"),
        ({**FP4, "format": "mxfp4", "group_size": 32}, 80, "not a multiple of the mxfp4 group (32); add this layer"),
        ({**FP4, "format": "nvfp4", "group_size": 128}, 64, "set bits=4, group_size=16, symmetric=true"),
        (
            {**FP4, "format": "fp6", "group_size": 16},
            64,
            "rtn writes format int | nvfp4 | mxfp4 weights, not format=fp6",
        ),
        ({"type": "awq", "format": "nvfp4", "group_size": 16}, 64, "awq writes format int weights, not format=nvfp4"),
        ({**FP4, "activations": "fp4"}, 64, "fp4 with format=nvfp4/mxfp4"),
        ({"type": "fp8", "strategy": "block", "activations": "static"}, 64, "use activations=dynamic"),
    ],
)
def test_bad_shapes_and_settings_are_refused_in_one_line(stage, hidden, message):
    model = build_tiny_llama(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(CompressError) as error:
        compress_model(model, [stage], torch.randint(0, 320, (2, 16)), CPU, batch_size=2)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4a16", "nvfp4", "mxfp4", "rotate_gptq_int4", "rotate_gptq_int3"])
def test_recipes_compose(recipe):
    stages = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())["stages"]
    chain = build_chain(stages)
    assert chain[-1].quantizes_weights
