"""Quantized linear modules: what stages produce, what the checkpoint stores and what the engine runs.

Imports only torch and ``kernels`` so that a GPU box without the pipeline's dependencies can run them.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.dequant import dequantize_packed
from kernels.packing import pack_int32, packed_width


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is group-quantized to ``num_bits`` and stored packed (compressed-tensors
    ``pack-quantized``): ``W[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``; symmetric layers have no ``z``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_bits: int,
        group_size: int,
        symmetric: bool,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        act_order: bool = False,
    ):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.num_bits, self.group_size, self.symmetric = num_bits, group_size, symmetric
        groups = in_features // group_size
        self.register_buffer(
            "weight_packed", torch.zeros(out_features, packed_width(in_features, num_bits), dtype=torch.int32)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=dtype))
        self.register_buffer(
            "weight_zero_point", None if symmetric else torch.zeros(out_features, groups, dtype=torch.int8)
        )
        self.register_buffer("weight_g_idx", torch.arange(in_features) // group_size if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
        num_bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
        g_idx: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Build from int8 codes ``[out, in]`` and per-group ``scale``/``zero_point`` ``[out, groups]``."""
        out_features, in_features = codes.shape
        module = cls(
            in_features, out_features, num_bits, group_size, symmetric=zero_point is None,
            bias=bias is not None, dtype=scale.dtype, act_order=g_idx is not None,
        )
        module.weight_packed.copy_(pack_int32(codes.to(torch.int8).cpu(), num_bits))
        module.weight_scale.copy_(scale)
        if zero_point is not None:
            module.weight_zero_point.copy_(zero_point.to(torch.int8))
        if g_idx is not None:
            module.weight_g_idx.copy_(g_idx)
        if bias is not None:
            module.bias.data.copy_(bias)
        return module.to(scale.device)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_packed(
            self.weight_packed, self.weight_scale, self.weight_zero_point, self.num_bits,
            self.in_features, self.group_size, self.weight_g_idx,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.weight_only_linear(
            x, self.weight_packed, self.weight_scale, self.weight_zero_point, self.num_bits,
            self.in_features, self.group_size, self.weight_g_idx, self.bias,
        )

    def extra_repr(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        return (
            f"in={self.in_features}, out={self.out_features}, int{self.num_bits} {kind} g{self.group_size}"
            f"{', act_order' if self.weight_g_idx is not None else ''}"
        )
