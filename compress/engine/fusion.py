"""Sibling projections that read the same input run as one weight-only GEMM.

A decoder layer calls q/k/v (and gate/up) one after another on the same hidden states. At decode each call is a
skinny GEMM of a few microseconds whose programs cannot fill the GPU (an H100 streamed a 4096x4096 int4 weight at
23 % of its copy bandwidth and a 14336x4096 one at 47 %, ``benchmarks/results/gemv-sweep-*``), so one launch over
the stacked weight moves the same bytes in fewer, fuller waves. transformers' modules still call each projection:
the first call of a group computes every member's output from one launch, and the others return their slice when
they are handed the very same input tensor, unmodified; any other input is computed on its own, so a module that
calls its projections differently still gets the right numbers.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from compress.formats import QuantizedLinear
from compress.formats.w4a16_linear import scheme_key, tensor_version
from compress.kernels import ops
from compress.kernels.w4a16 import KERNEL_BITS, repack_n_contiguous

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """One stacked weight for ``members`` (same input width and quantization scheme, no act-order), in the layout
    the kernels read: words ``[K/8, sum N]`` and scales/zero points ``[sum N, groups]`` with N-contiguous strides."""

    def __init__(self, members: list[QuantizedLinear]):
        first = members[0]
        self.members = members
        self.num_bits, self.group_size, self.in_features = first.num_bits, first.group_size, first.in_features
        self.packed_kn = repack_n_contiguous(torch.cat([m.weight_packed for m in members]))
        self.weight_packed = self.packed_kn.t()  # the on-disk layout as a view, for the reference path: no copy
        self.scale = torch.cat([m.weight_scale for m in members]).t().contiguous().t()
        zeros = [m.weight_zero_point for m in members]
        self.zero = None if zeros[0] is None else torch.cat(zeros).t().contiguous().t()
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.cat(biases)
        bounds = list(accumulate((m.out_features for m in members), initial=0))
        self.slices = list(zip(bounds[:-1], bounds[1:], strict=True))
        self._input: torch.Tensor | None = None
        self._input_version = 0
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x``: from the group's last launch if that launch read this very tensor
        and this member has not taken its slice yet, else from a new launch that serves the others too."""
        if x is self._input and tensor_version(x) == self._input_version and index in self._pending:
            out = self._pending.pop(index)
            if not self._pending:
                self._input = None  # every member served: hold no activations between layers
            return out
        stacked = ops.weight_only_linear(
            x,
            self.weight_packed,
            self.scale,
            self.zero,
            self.num_bits,
            self.in_features,
            self.group_size,
            None,
            self.bias,
            self.packed_kn,
        )
        outputs = {i: stacked[..., start:stop] for i, (start, stop) in enumerate(self.slices)}
        out = outputs.pop(index)
        self._input, self._input_version, self._pending = x, tensor_version(x), outputs
        return out


def _fusable(members: list[nn.Module | None]) -> bool:
    if not all(isinstance(m, QuantizedLinear) and "forward" not in vars(m) for m in members):
        return False  # not W4A16, or already routed through a stacked launch (a second engine on the same model)
    first = members[0]
    return all(
        m.in_features == first.in_features
        and scheme_key(m) == scheme_key(first)
        and m.weight_g_idx is None
        and m.num_bits in KERNEL_BITS
        and (m.bias is None) == (first.bias is None)
        and m.weight_scale.dtype == first.weight_scale.dtype
        and m.weight_packed.device == first.weight_packed.device
        for m in members
    )


def fuse_sibling_projections(model: nn.Module) -> int:
    """Route every q/k/v and gate/up group of W4A16 projections through one stacked launch; returns how many groups
    were fused. The members keep their own buffers (the checkpoint is unchanged); the stacked copy replaces the
    per-member kernel layout they would otherwise build, so the GPU memory stays what it was."""
    fused = 0
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if not _fusable(members):
                continue
            group = FusedProjections(members)
            for index, member in enumerate(members):
                member.forward = lambda x, group=group, index=index: group.output(index, x)
            fused += 1
    return fused
