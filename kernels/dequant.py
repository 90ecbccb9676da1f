"""Plain-torch dequantization of group-quantized weights: the reference every weight-only kernel must match."""

from __future__ import annotations

import torch

from compress.kernels.packing import unpack_int32


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None, device=None) -> torch.Tensor:
    """Group of every input column: ``g_idx`` when act-order stored one, else ``column // group_size``."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(in_features, device=device) // group_size


def dequantize_codes(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(q - z) * s`` per group. ``codes`` int8 ``[out, in]``; ``scale``/``zero_point`` ``[out, groups]``."""
    out_features, in_features = codes.shape
    if g_idx is None and in_features % group_size == 0:  # plain groups: broadcast, no [out, in] gather of scales
        values = codes.to(scale.dtype).view(out_features, -1, group_size)
        if zero_point is not None:
            values = values - zero_point.to(scale.dtype).unsqueeze(-1)
        return (values * scale.unsqueeze(-1)).view(out_features, in_features)
    groups = group_index(in_features, group_size, g_idx, codes.device)
    values = codes.to(scale.dtype)
    if zero_point is not None:
        values = values - zero_point.to(scale.dtype)[:, groups]
    return values * scale[:, groups]


def dequantize_packed(
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    num_bits: int,
    in_features: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense weight ``[out, in]`` from the ``pack-quantized`` tensors (zero points already unpacked, int8)."""
    codes = unpack_int32(weight_packed, num_bits, in_features, dim=1)
    return dequantize_codes(codes, scale, zero_point, group_size, g_idx)
