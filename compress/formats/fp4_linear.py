"""FP4 e2m1 weights, compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` (NVFP4A16 / MXFP4A16, and
the W4A4 presets with activation rounding). Runs on ``kernels/fp4.py``."""

from __future__ import annotations

import torch
from torch import nn

from compress.grids.fp4_grid import fake_quantize_fp4_activations
from compress.kernels import fp4, ops

NVFP4_FORMAT = "nvfp4-pack-quantized"  # uint8 `weight_packed`, fp8 `weight_scale`, fp32 `weight_global_scale`
MXFP4_FORMAT = "mxfp4-pack-quantized"  # uint8 `weight_packed`, uint8 e8m0 `weight_scale`


class Fp4Linear(nn.Module):
    """FP4 e2m1 weights (compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``): ``weight_packed``
    uint8 ``[out, in/2]`` with NVFP4 fp8 group-16 scales and an fp32 ``weight_global_scale``, or MXFP4 e8m0
    group-32 scales. With ``quantize_activations`` (W4A4: NVFP4, MXFP4 presets) the inputs are quantized per token
    and group too, NVFP4's against the calibrated ``input_global_scale``; the product itself runs on 16-bit
    activations (a GPU with FP4 tensor cores gets the same numbers from FP4 operands)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        quantize_activations: bool = False,
    ):
        super().__init__()
        groups = {"nvfp4": fp4.NVFP4_GROUP, "mxfp4": fp4.MXFP4_GROUP}
        if fmt not in groups:
            raise ValueError(f"unknown FP4 format {fmt!r}; use nvfp4 or mxfp4")
        if in_features % groups[fmt]:
            raise ValueError(f"in_features {in_features} is not a multiple of the {fmt} group {groups[fmt]}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.quantize_activations = quantize_activations
        nv = fmt == "nvfp4"
        scale_dtype = fp4.FP8_SCALE if nv else fp4.MX_SCALE
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // groups[fmt]).to(scale_dtype))
        self.register_buffer("weight_global_scale", torch.ones(1) if nv else None)
        self.register_buffer("input_global_scale", torch.ones(1) if nv and quantize_activations else None)
        zeros = torch.zeros(out_features, dtype=dtype)
        self.bias = nn.Parameter(zeros, requires_grad=False) if bias else None

    @classmethod
    def from_packed(
        cls,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        quantize_activations: bool = False,
        input_global_scale: torch.Tensor | None = None,
    ) -> Fp4Linear:
        """Build from checkpoint-layout tensors (see :class:`compress.grids.fp4_grid.Fp4Weight`)."""
        fmt = "mxfp4" if fp4.uses_mx_scales(scale, global_scale) else "nvfp4"
        out_features, in_features = packed.shape[0], packed.shape[1] * 2
        dtype = torch.float32 if bias is None else bias.dtype
        with torch.device(packed.device):
            module = cls(in_features, out_features, fmt, bias is not None, dtype, quantize_activations)
        module.weight_packed.copy_(packed)
        module.weight_scale.copy_(scale)
        if global_scale is not None:
            module.weight_global_scale.copy_(global_scale.reshape(1))
        if module.input_global_scale is not None:
            if input_global_scale is None:
                raise ValueError("NVFP4 with quantized activations needs the calibrated input_global_scale")
            module.input_global_scale.copy_(input_global_scale.reshape(1))
        if bias is not None:
            module.bias.data.copy_(bias)
        return module

    def stored_bits(self) -> int:
        """Bits the checkpoint stores for this weight: packed e2m1 pairs, group scales and NVFP4's global scale."""
        stored = [self.weight_packed, self.weight_scale]
        if self.weight_global_scale is not None:
            stored.append(self.weight_global_scale)
        return sum(t.numel() * t.element_size() * 8 for t in stored)

    def dequantized_weight(self) -> torch.Tensor:
        return fp4.dequantize_fp4_reference(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_activations:
            x = fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale)
        return ops.fp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias)

    def extra_repr(self) -> str:
        activations = f"{self.fmt} activations" if self.quantize_activations else "16-bit activations"
        return f"in={self.in_features}, out={self.out_features}, {self.fmt} weights, {activations}"


def config_group(module: Fp4Linear) -> dict:
    """``weights``, ``input_activations`` and format exactly as compressed-tensors 0.20 writes its ``NVFP4A16``,
    ``NVFP4``, ``MXFP4A16`` and ``MXFP4`` presets."""
    nv = module.fmt == "nvfp4"
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16 if nv else 32}
    args.update(strategy="tensor_group" if nv else "group", dynamic=False)
    args["scale_dtype"] = "torch.float8_e4m3fn" if nv else "torch.uint8"
    inputs = None
    if module.quantize_activations:
        inputs = {**args, "dynamic": "local", "observer": "static_minmax"} if nv else {**args, "dynamic": True}
    return {"weights": args, "input_activations": inputs, "format": NVFP4_FORMAT if nv else MXFP4_FORMAT}
