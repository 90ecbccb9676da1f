"""FP4 checkpoints (NVFP4, MXFP4; weight-only and W4A4) read by our loader and by transformers + compressed-tensors
give the same logits when both run the same dtype: the weight each side multiplies by is the dequantized FP4 weight
rounded to the activations' dtype (compressed-tensors decompresses to bf16; our Triton kernel casts each tile), and
W4A4's activation rounding turns any difference left into whole FP4 steps, so nothing but the same arithmetic
passes these bounds."""

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from helpers import build_tiny_llama
from transformers import AutoModelForCausalLM

from compress.checkpoint import load_checkpoint, save_checkpoint
from compress.compression.in_memory import compress_model
from compress.grids.fp4_grid import quantize_mxfp4, quantize_nvfp4
from compress.kernels.fp4 import fp4_linear_reference

CPU = torch.device("cpu")
STAGES = {  # compressed-tensors preset -> our stage
    "NVFP4A16": {"format": "nvfp4", "group_size": 16},
    "NVFP4": {"format": "nvfp4", "group_size": 16, "activations": "fp4"},
    "MXFP4A16": {"format": "mxfp4", "group_size": 32},
    "MXFP4": {"format": "mxfp4", "group_size": 32, "activations": "fp4"},
}


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4"])
def test_reference_linear_is_compressed_tensors_decompressed_weight_times_bf16_input(preset):
    """The product our CPU path computes is ``F.linear`` on the weight compressed-tensors decompresses, bit for bit."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    quantized = (quantize_nvfp4 if preset == "NVFP4" else quantize_mxfp4)(weight)
    state = {"weight_packed": quantized.packed, "weight_scale": quantized.scale}
    if quantized.global_scale is not None:
        state["weight_global_scale"] = quantized.global_scale
    compressor = NVFP4PackedCompressor if preset == "NVFP4" else MXFP4PackedCompressor
    theirs = compressor.decompress(state, preset_name_to_scheme(preset, ["Linear"]))["weight"]
    x = torch.randn(5, 64).mul(2).to(torch.bfloat16)
    ours = fp4_linear_reference(x, quantized.packed, quantized.scale, quantized.global_scale)
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(ours, F.linear(x, theirs))


@pytest.mark.parametrize("preset", sorted(STAGES))
def test_transformers_logits_equal_our_readers_in_bf16(tmp_path, preset):
    model = build_tiny_llama(seed=3, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    frequencies = model.model.rotary_emb.inv_freq.clone()  # a loaded bf16 model keeps them fp32
    model.to(torch.bfloat16).model.rotary_emb.inv_freq = frequencies
    model.config.dtype = torch.bfloat16
    stage = {"type": "rtn", "bits": 4, "symmetric": True, **STAGES[preset]}
    compress_model(model, [stage], torch.randint(0, 320, (4, 32)), CPU, batch_size=4)
    save_checkpoint(model, None, tmp_path / "ckpt")
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, yours = ours(tokens).logits.float(), theirs(tokens).logits.float()
    assert float((mine - yours).norm() / mine.norm()) < 1e-2
    assert torch.equal(mine.argmax(-1), yours.argmax(-1))
