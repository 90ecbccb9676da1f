"""FP8 block-wise weights, compressed-tensors ``float-quantized`` with ``strategy: block`` (DeepSeek-V3 style 128x128
weight blocks, activations per token and group of 128). Runs on ``kernels/fp8_block.py``."""

from __future__ import annotations

import torch
from torch import nn

from compress.kernels import fp8_block, ops

FORMAT = "float-quantized"  # with `strategy: block` in its weights


class Fp8BlockLinear(nn.Module):
    """FP8 block-wise W8A8 (compressed-tensors ``float-quantized``, ``strategy: block``): e4m3 ``weight [out, in]``
    with one scale per 128x128 block, ``weight_scale [ceil(out/128), ceil(in/128)]`` (edge blocks partial);
    activations quantized per token and group of 128 input channels at run time."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        scale_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (-(-out_features // fp8_block.BLOCK[0]), -(-in_features // fp8_block.BLOCK[1]))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(blocks, dtype=scale_dtype))
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, scale_dtype: torch.dtype = torch.float32) -> Fp8BlockLinear:
        """Round to nearest per block; ``scale_dtype`` is what the checkpoint stores (the model's dtype there)."""
        codes, scale = fp8_block.quantize_weight_fp8_blocks(linear.weight.detach(), scale_dtype=scale_dtype)
        with torch.device(linear.weight.device):
            bias = linear.bias is not None
            module = cls(linear.in_features, linear.out_features, bias, linear.weight.dtype, scale.dtype)
        module.weight.copy_(codes)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def stored_bits(self) -> int:
        """Bits the checkpoint stores for this weight: e4m3 codes and one scale per block."""
        return sum(t.numel() * t.element_size() * 8 for t in (self.weight, self.weight_scale))

    def dequantized_weight(self) -> torch.Tensor:
        return fp8_block.dequantize_fp8_blocks(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_block_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 128x128 blocks, dynamic per-token-group 128"


def config_group(module: Fp8BlockLinear) -> dict:
    """``weights``, ``input_activations`` and format exactly as compressed-tensors writes its ``FP8_BLOCK`` preset."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block"}
    weights.update(block_structure=list(fp8_block.BLOCK), dynamic=False)
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 128, "strategy": "group"}
    return {"weights": weights, "input_activations": {**inputs, "dynamic": True}, "format": FORMAT}
