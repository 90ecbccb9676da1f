"""Mixed precision: a weight scheme per linear (``compress search`` writes these recipes).

A recipe names each linear's scheme by pattern (``ignore`` semantics: exact name, dotted suffix or ``re:<regex>``);
linears no pattern names get the stage's own ``bits``/``group_size``/``symmetric``. Scheme names:

- ``int<b>_g<G>``: b-bit symmetric integer codes, one scale per G inputs (``int4_g64``), GPTQ or round-to-nearest;
- ``int<b>``: b-bit symmetric, one scale per output channel (``int8`` is W8A16);
- ``fp8``: e4m3 weights per channel with dynamic per-token fp8 activations (the ``fp8`` stage's FP8_DYNAMIC; our
  modules have no weight-only fp8 form);
- ``bf16``: left unquantized, in the model's own dtype.

The checkpoint gets one compressed-tensors config group per distinct scheme, each listing its modules.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import Fp8Linear, w4a16_linear, w8a8_linear
from compress.grids.int_grid import WeightScheme, all_finite, check_group_size, matches, validate_scheme
from compress.model.layer_walk import decoder_layers
from compress.stages.base import LayerContext
from compress.stages.gptq import GPTQConfig, GPTQStage
from compress.stages.hessian import collect_hessians, input_groups
from compress.stages.weights import replace_module, target_linears

INT_SCHEME = re.compile(r"int(?P<bits>[2-8])(?:_g(?P<group>\d+))?")


@dataclass(frozen=True)
class Candidate:
    """One scheme a linear can get, and what it costs to store."""

    name: str
    kind: str  # int | fp8 | dense
    bits: int  # bits per code (the dense dtype's width is the model's, not this)
    group_size: int | None = None  # int only; None: one scale per output channel

    @property
    def weight_scheme(self) -> WeightScheme:
        return WeightScheme(self.bits, self.group_size, True)

    def stored_bits(self, out_features: int, in_features: int, dtype_bits: int) -> int:
        """Bits the checkpoint stores for this linear's weight (codes + scales), as ``checkpoint.summarize``
        counts them; ``dtype_bits``: the model's storage width (scales of integer schemes, unquantized weights)."""
        if self.kind == "dense":
            return out_features * in_features * dtype_bits
        if self.kind == "fp8":
            return w8a8_linear.stored_bits(out_features, in_features)
        group_size = self.weight_scheme.group_for(in_features)
        return w4a16_linear.stored_bits(out_features, in_features, self.bits, group_size, dtype_bits)


def candidate(name: str) -> Candidate:
    """The scheme a name stands for; one line naming the forms on a typo."""
    if name == "fp8":
        return Candidate(name, "fp8", 8)
    if name == "bf16":
        return Candidate(name, "dense", 16)
    found = INT_SCHEME.fullmatch(name)
    if found is None:
        raise CompressError(
            f"unknown scheme {name!r}; use int<bits>_g<group> (int4_g64), int<bits> (per channel, e.g. int8), "
            "fp8 or bf16"
        )
    group = found["group"]
    return Candidate(name, "int", int(found["bits"]), int(group) if group else None)


@dataclass
class MixedConfig(GPTQConfig):
    method: str = "gptq"  # gptq | rtn: how integer schemes are rounded
    schemes: dict[str, str] = field(default_factory=dict)  # module pattern → scheme name; first match wins

    def __post_init__(self):
        super().__post_init__()
        if self.method not in ("gptq", "rtn"):
            raise ValueError(f"method={self.method!r} must be 'gptq' or 'rtn'")


class MixedStage(GPTQStage):
    """Each linear quantized with its own scheme; linears sharing an input (q/k/v, gate/up) that share a scheme are
    quantized as one stacked matrix, as in GPTQ."""

    name = "mixed"
    Config = MixedConfig

    def __init__(self, config: MixedConfig):
        super().__init__(config)
        self.needs_calibration = config.method == "gptq"
        self.chosen = {pattern: candidate(name) for pattern, name in config.schemes.items()}  # typos fail here

    def module_patterns(self) -> dict[str, list[str]]:
        return {**super().module_patterns(), "schemes": list(self.config.schemes)}

    def scheme_of(self, full_name: str) -> Candidate:
        for pattern, chosen in self.chosen.items():
            if matches(full_name, [pattern]):
                return chosen
        c = self.config
        if not c.symmetric:
            raise CompressError(f"mixed: {full_name} gets the stage's scheme, which must be symmetric")
        return Candidate(f"int{c.bits}" + (f"_g{c.group_size}" if c.group_size else ""), "int", c.bits, c.group_size)

    def prepare(self, model: nn.Module) -> None:
        self.stats, self.retries, self.assigned = {}, {}, {}
        for index, layer in enumerate(decoder_layers(model)):
            prefix = f"model.layers.{index}"
            for name, linear in target_linears(layer, prefix, self.config.ignore).items():
                chosen = self.scheme_of(f"{prefix}.{name}")
                if chosen.kind == "int":
                    validate_scheme(chosen.weight_scheme)
                    check_group_size(f"{prefix}.{name}", linear.in_features, chosen.weight_scheme)
                self.assigned[f"{prefix}.{name}"] = chosen.name

    def process_layer(self, ctx: LayerContext) -> None:
        if self.needs_calibration and ctx.inputs is None:
            raise CompressError("mixed with method=gptq needs calibration inputs")
        groups = input_groups(target_linears(ctx.layer, ctx.name, self.config.ignore))
        gptq = self.config.method == "gptq"
        if gptq and not self.config.true_sequential:
            hessians = collect_hessians(ctx, [group[0] for group in groups], stop_at=None)
        for group in groups:
            by_scheme: dict[Candidate, list[str]] = {}
            for name in group:
                by_scheme.setdefault(self.scheme_of(f"{ctx.name}.{name}"), []).append(name)
            if gptq and self.config.true_sequential and any(c.kind == "int" for c in by_scheme):
                hessians = collect_hessians(ctx, [group[0]], stop_at=group[0])
            for chosen, names in by_scheme.items():
                if chosen.kind == "fp8":
                    for name in names:
                        self._to_fp8(ctx, name)
                elif chosen.kind == "int" and gptq:
                    self._quantize_group(ctx, names, hessians[group[0]], chosen.weight_scheme)
                elif chosen.kind == "int":
                    for name in names:
                        self.quantize_linear(
                            ctx.layer, name, f"{ctx.name}.{name}", scale_dtype=ctx.dtype, scheme=chosen.weight_scheme
                        )

    @torch.no_grad()
    def _to_fp8(self, ctx: LayerContext, name: str) -> None:
        linear = ctx.layer.get_submodule(name)
        if not all_finite(linear.weight):
            raise CompressError(f"{ctx.name}.{name}: weight holds NaN/inf; the model or an earlier stage is broken")
        module = Fp8Linear.from_float(linear)
        dense = linear.weight.data.float()
        error = (module.dequantized_weight() - dense).pow(2).mean() / dense.pow(2).mean()
        self.stats[f"{ctx.name}.{name}"] = {"weight_rel_mse": float(error)}
        replace_module(ctx.layer, name, module)

    def finalize(self, model: nn.Module) -> dict:
        errors = [s["weight_rel_mse"] for s in self.stats.values()]
        counts = Counter(self.assigned.values())
        return {
            "scheme": "mixed: " + ", ".join(f"{name} ×{count}" for name, count in sorted(counts.items())),
            "method": self.config.method,
            "quantized_linears": len(self.stats),
            "mean_weight_rel_mse": sum(errors) / max(len(errors), 1),
            "schemes": dict(self.assigned),
            "cholesky_retries": self.retries,
            "per_layer": self.stats,
        }
