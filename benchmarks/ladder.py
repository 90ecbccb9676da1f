"""Ladder rungs: the default model moved a chosen fraction of the way from its own weights to their round-to-nearest
grid, a real model whose loss grows smoothly with the fraction, to place checkpoints at chosen distances from a gate
limit. ``gate_calibration.py`` (windows) and ``accuracy_task.py`` (ARC items) move weights with this one function, so
a rung of the same name, fraction and bits is the same model in both."""

from __future__ import annotations

import torch

RUNG_KEYS = ("ladder_fraction", "ladder_bits")


@torch.no_grad()
def move_towards_rtn(layer: torch.nn.Module, fraction: float, bits: int, group_size: int | None = 64) -> None:
    """Every linear weight of ``layer`` moved ``fraction`` of the way to its symmetric round-to-nearest at ``bits``
    (groups of ``group_size``; None: per output row), in place."""
    from compress.grids.int_grid import WeightScheme, fake_quantize

    scheme = WeightScheme(bits=bits, group_size=group_size, symmetric=True)
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            weight.add_(fraction * (fake_quantize(weight, scheme) - weight.float()).to(weight.dtype))


def parse_rung(item: str) -> tuple[str, tuple[float, int]]:
    """``name=fraction[:bits]`` → ``(name, (fraction, bits))``; bits default to 4."""
    name, _, spec = item.partition("=")
    fraction, _, bits = spec.partition(":")
    return name, (float(fraction), int(bits or 4))
