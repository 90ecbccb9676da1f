"""Entry points the quantized modules call; each picks the fastest implementation available for its inputs.

Today every op runs its plain-torch reference; Triton kernels register behind the same signatures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dequant import dequantize_packed


def weight_only_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    in_features: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` group-quantized in the pack-quantized layout (W4A16 and friends)."""
    weight = dequantize_packed(weight_packed, scale, zero_point, num_bits, in_features, group_size, g_idx)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
