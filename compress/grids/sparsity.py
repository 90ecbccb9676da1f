"""N:M semi-structured sparsity: masks, how they follow a linear through later stages, and the checkpoint record.

A pruner attaches the boolean *keep* mask to each pruned linear as a non-persistent buffer (``sparsity_mask``; it
moves with the module, is never saved). Every later stage must leave the pruned weights at zero: quantizers re-apply
the mask to their integer codes when they swap the linear for its quantized form (``replace_module`` in
``compress.stages.weights``), distillation multiplies it back after every optimizer step, and the pruner's
``finalize`` checks the final model with :func:`check_masks_held`, so a stage that refills a pruned weight fails the
run instead of silently shipping a dense model labelled sparse.

The checkpoint records the pattern in ``sparsity.json`` beside config.json (:func:`sparsity_record`), not as
compressed-tensors' ``sparsity_config``: current vLLM refuses any checkpoint whose quantization_config carries one.
Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.base.errors import CompressError

MASK = "sparsity_mask"
SPARSITY_FILE = "sparsity.json"
STRUCTURE = "sparsity_structure"


@dataclass(frozen=True)
class NMPattern:
    """At most ``n`` non-zero weights in every run of ``m`` consecutive input columns of a row."""

    n: int
    m: int

    @classmethod
    def parse(cls, text: str) -> NMPattern:
        try:
            n, m = (int(part) for part in str(text).split(":"))
        except ValueError:
            raise ValueError(f"sparsity={text!r} is not an N:M pattern; use e.g. '2:4' or '4:8'") from None
        if not 0 < n < m:
            raise ValueError(f"sparsity={text!r} must keep 0 < N < M weights per group of M")
        return cls(n, m)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    def check(self, name: str, in_features: int) -> None:
        if in_features % self.m:
            raise CompressError(
                f"{name}: input width {in_features} is not a multiple of M={self.m} for {self} sparsity; "
                f"ignore this linear or choose an M that divides {in_features}"
            )


def nm_keep_mask(scores: torch.Tensor, pattern: NMPattern) -> torch.Tensor:
    """Boolean ``[out, in]`` mask keeping the ``n`` highest-scoring weights of every ``m`` consecutive columns."""
    out_features, in_features = scores.shape
    groups = scores.reshape(out_features, in_features // pattern.m, pattern.m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(pattern.n, dim=-1).indices, True)
    return keep.reshape(out_features, in_features)


def attach_mask(module: nn.Module, keep: torch.Tensor, pattern: NMPattern) -> None:
    """Record the mask on the module (non-persistent: checkpoints carry zeros, not masks)."""
    module.register_buffer(MASK, keep.to(torch.bool), persistent=False)
    setattr(module, STRUCTURE, str(pattern))


def mask_of(module: nn.Module) -> torch.Tensor | None:
    return getattr(module, MASK, None)


def carry_mask(old: nn.Module, new: nn.Module, enforce: bool = True) -> None:
    """``new`` replaces ``old`` in the model: keep its mask, and zero what the mask prunes in ``new``'s weights
    (``enforce=False``: ``new`` computes with weights that already hold it, e.g. ``old``'s frozen codes)."""
    keep = mask_of(old)
    if keep is None:
        return
    if enforce:
        enforce_mask(new, keep)
    new.register_buffer(MASK, keep.to(_device(new)), persistent=False)
    setattr(new, STRUCTURE, getattr(old, STRUCTURE))


def _device(module: nn.Module) -> torch.device:
    tensor = next(iter(module.buffers()), None)
    if tensor is None:
        tensor = next(module.parameters())
    return tensor.device


@torch.no_grad()
def enforce_mask(module: nn.Module, keep: torch.Tensor) -> None:
    """Zero the pruned weights of a dense, 8-bit or packed-quantized linear. A packed weight is zero where its code
    is the zero point (0 when symmetric), so that is what pruned codes are set to: exact, no rounding."""
    if hasattr(module, "weight_packed"):
        from compress.kernels.dequant import group_index
        from compress.kernels.packing import pack_int32, unpack_int32

        codes = unpack_int32(module.weight_packed.cpu(), module.num_bits, module.in_features).to(torch.int8)
        zero = torch.zeros_like(codes)
        if module.weight_zero_point is not None:
            group_of = group_index(module.in_features, module.group_size, module.weight_g_idx, "cpu")
            zero = module.weight_zero_point.cpu()[:, group_of]
        codes = torch.where(keep.cpu(), codes, zero)
        module.weight_packed.copy_(pack_int32(codes, module.num_bits).to(module.weight_packed.device))
        return
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape == keep.shape:  # dense, int8 or fp8 weights
        fp8 = weight.is_floating_point() and weight.element_size() == 1  # +0.0 is the all-zero byte
        (weight.data.view(torch.uint8) if fp8 else weight.data).masked_fill_(~keep.to(weight.device), 0)
        return
    raise CompressError(
        f"{type(module).__name__} cannot keep an N:M mask; prune before this stage or leave the pruned linears out"
    )


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight the module computes with (dequantized for packed modules)."""
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight()
    return module.weight.data


def check_masks_held(model: nn.Module) -> dict[str, float]:
    """Sparsity achieved per masked linear; raises if any later stage made a pruned weight non-zero."""
    achieved = {}
    for name, module in model.named_modules():
        keep = mask_of(module)
        if keep is None:
            continue
        weight = effective_weight(module)
        refilled = int(((weight != 0) & ~keep.to(weight.device)).sum())
        if refilled:
            raise CompressError(
                f"{name}: {refilled} weights pruned to {getattr(module, STRUCTURE)} sparsity are non-zero again; "
                "a stage after the pruner ignored the mask (stages must keep `sparsity_mask`)"
            )
        achieved[name] = float((weight == 0).float().mean())
    return achieved


def sparsity_record(model: nn.Module) -> dict | None:
    """What ``sparsity.json`` says of a pruned model, in the fields of compressed-tensors' sparsity config (stored
    dense: zeros are written out, so any loader reads the weights)."""
    masked = {name: module for name, module in model.named_modules() if mask_of(module) is not None}
    if not masked:
        return None
    structures = {getattr(module, STRUCTURE) for module in masked.values()}
    if len(structures) > 1:
        raise CompressError(f"one checkpoint holds several sparsity structures {sorted(structures)}; use one")
    linears = {name for name, module in model.named_modules() if type(module) is nn.Linear or name in masked}
    pruned = sum(int((~mask_of(module)).sum()) for module in masked.values())
    total = sum(model.get_submodule(name).in_features * model.get_submodule(name).out_features for name in linears)
    return {
        "format": "dense",
        "sparsity_structure": structures.pop(),
        "targets": sorted(masked),
        "ignore": sorted(linears - set(masked)),
        "global_sparsity": pruned / total if total else 0.0,
    }
