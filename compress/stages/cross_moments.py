"""Input correction for GPTQ (the idea of GPTAQ, Li et al. 2025, "GPTQ v2" in GPTQModel).

GPTQ makes the quantized linear reproduce the full-precision weight *on the inputs it now receives*, which come out
of the already-quantized layers: min ‖(Ŵ − W) X̃‖². What the model needs is the full-precision *output*,
computed from the full-precision inputs X: min ‖Ŵ X̃ − W X‖². With C = E[x x̃ᵀ] (full-precision input times
quantized input, per token) and H̃ = E[x̃ x̃ᵀ], that objective equals ‖(Ŵ − W′) X̃‖² plus a constant, where

    W′ = W C H̃⁻¹ = W + W (C − H̃) H̃⁻¹

(the least-squares weight that maps X̃ to W X; the residual is orthogonal to X̃'s span). So running GPTQ on W′
against H̃ solves the asymmetric objective exactly. GPTAQ folds the same correction into GPTQ's column loop; taking
it as one solve before the loop is equivalent and leaves the loop untouched. H̃ gets GPTQ's relative dampening,
and when the two inputs agree (the first layer's first group) C = H̃ and W′ = W.

C needs both inputs of the same tokens at once: the full-precision input of a group, per calibration batch, comes
from a copy of the layer taken before any of it was quantized, run on the full-precision stream up to that group.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.base import distributed
from compress.model.layer_walk import LayerInputs, observe_inputs


class CrossMoments:
    """Σ x x̃ᵀ per input group, accumulated as ``sequential_hessians`` hands over each batch's quantized input."""

    def __init__(self, reference_layer: nn.Module, inputs: LayerInputs, prefix: str):
        self.layer, self.inputs, self.prefix = reference_layer, inputs, prefix
        self.totals: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}

    @torch.no_grad()
    def add(self, leader: str, batch: int, quantized_input: torch.Tensor) -> None:
        """One batch of the group's input on the walk (``[tokens, in]`` fp32), paired with the full-precision one."""
        captured: list[torch.Tensor] = []
        one_batch = LayerInputs([self.inputs.hidden[batch]], [self.inputs.kwargs[batch]])
        observe_inputs(self.layer, one_batch, self.prefix, {leader: captured.append}, stop_after=leader)
        reference = captured[0]
        if reference.shape != quantized_input.shape:
            raise RuntimeError(f"{self.prefix}.{leader}: full-precision and walk inputs differ in shape")
        if leader not in self.totals:
            width = reference.shape[1]
            self.totals[leader] = torch.zeros(width, width, device=reference.device)
            self.tokens[leader] = 0
        self.totals[leader].addmm_(reference.T, quantized_input)
        self.tokens[leader] += reference.shape[0]

    @torch.no_grad()
    def corrected_weight(
        self, leader: str, weight: torch.Tensor, hessian: torch.Tensor, dampening: float
    ) -> torch.Tensor:
        """W′ = W + W (C − H̃)(H̃ + λ)⁻¹ for the group led by ``leader``; ``hessian`` is H̃ = E[x̃ x̃ᵀ]."""
        total = distributed.all_reduce_sum(self.totals.pop(leader))
        tokens = distributed.sum_count(self.tokens.pop(leader), total.device)
        cross = total / tokens
        h = hessian.float()
        damped = h + dampening * h.diagonal().mean().clamp(min=1e-12) * torch.eye(len(h), device=h.device)
        shift = weight.float() @ (cross - h)  # [out, in]
        correction = torch.linalg.solve(damped, shift.T).T  # shift · damped⁻¹ (damped is symmetric)
        return (weight.float() + correction).to(weight.dtype)
