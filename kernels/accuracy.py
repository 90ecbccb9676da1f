"""Accuracy helpers shared by the tests and the GPU benchmark: errors measured in float64 so the yardstick
itself adds no rounding."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` (Frobenius, float64); 0 when both are zero."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    actual64, expected64 = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    denominator = expected64.norm().item()
    difference = (actual64 - expected64).norm().item()
    if denominator == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / denominator


def float64_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Ground truth ``x @ weight.T + bias`` in float64 (runs on the tensors' device, CPU or GPU)."""
    out = x.to(torch.float64) @ weight.to(torch.float64).T
    return out if bias is None else out + bias.to(torch.float64)
