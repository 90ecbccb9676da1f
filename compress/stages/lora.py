"""Merge PEFT LoRA adapters into the base weights before anything is pruned or quantized.

A LoRA adapter adds ``s · B · A`` to a linear's weight (``A [r, in]``, ``B [out, r]``, ``s = α / r``, or
``α / √r`` with rsLoRA). Merging makes that permanent, ``W += w · s · B · A`` per adapter with a user weight ``w``,
so later stages compress the fine-tuned model rather than the base. Adapters are read straight from a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``) with json and safetensors: no peft dependency.

Everything is checked before any weight changes: an adapter trained on another base (a target module the model
lacks, a shape that differs) fails with the adapter, the module and both shapes named.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from compress.base.errors import CompressError
from compress.stages.base import Stage

KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
UNSUPPORTED = {"use_dora": "DoRA magnitude vectors", "modules_to_save": "modules_to_save (fully trained copies)"}


@dataclass
class AdapterSpec:
    path: str
    weight: float = 1.0


@dataclass
class LoRAMergeConfig:
    adapters: list = field(default_factory=list)  # folder paths, or {path, weight} mappings

    def __post_init__(self):
        if not self.adapters:
            raise ValueError(
                "adapters is empty; list PEFT adapter folders (command line: stages.<i>.adapters=[path/to/adapter])"
            )
        specs = []
        for entry in self.adapters:
            if isinstance(entry, str):
                specs.append(AdapterSpec(entry))
            elif isinstance(entry, dict) and set(entry) <= {"path", "weight"} and "path" in entry:
                specs.append(AdapterSpec(str(entry["path"]), float(entry.get("weight", 1.0))))
            else:
                raise ValueError(f"adapter entry {entry!r} must be a folder path or a mapping with `path` and `weight`")
        self.adapters = specs


@dataclass
class LoRAAdapter:
    """One PEFT adapter: per target module name, the scaled low-rank factors."""

    path: Path
    base_model: str | None
    scale: dict[str, float]  # α/r per module (rank_pattern/alpha_pattern respected)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module → (A [r, in], B [out, r])

    def delta(self, module: str) -> torch.Tensor:
        a, b = self.factors[module]
        return self.scale[module] * (b.float() @ a.float())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern: a key matches a module whose name ends with it."""
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(f"(.*\\.)?{key}", module):
            return value
    return default


def read_adapter(folder: str | Path) -> LoRAAdapter:
    folder = Path(folder)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        missing = [f.name for f in (config_file, weights_file) if not f.is_file()]
        raise CompressError(f"LoRA adapter {folder}: missing {', '.join(missing)}; expected a PEFT adapter folder")
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except (json.JSONDecodeError, SafetensorError, OSError) as error:
        raise CompressError(f"LoRA adapter {folder}: unreadable ({error})") from error
    if config.get("peft_type", "LORA") != "LORA":
        raise CompressError(f"LoRA adapter {folder}: peft_type {config['peft_type']!r} is not LORA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise CompressError(f"LoRA adapter {folder}: {what} cannot be merged here; export a plain LoRA adapter")
    if config.get("fan_in_fan_out"):
        raise CompressError(f"LoRA adapter {folder}: fan_in_fan_out (Conv1D bases) is not supported")
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if match is None:
            raise CompressError(f"LoRA adapter {folder}: tensor {key!r} is not a lora_A/lora_B weight")
        sides.setdefault(match["module"], {})[match["side"]] = tensor
    factors, scale = {}, {}
    for module, pair in sides.items():
        if set(pair) != {"A", "B"}:
            raise CompressError(f"LoRA adapter {folder}: {module} has lora_{''.join(pair)} but not both A and B")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise CompressError(f"LoRA adapter {folder}: {module} factors {tuple(a.shape)}, {tuple(b.shape)} disagree")
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", a.shape[0]))
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        factors[module] = (a, b)
        scale[module] = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    if not factors:
        raise CompressError(f"LoRA adapter {folder}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(folder, config.get("base_model_name_or_path"), scale, factors)


def check_adapter(adapter: LoRAAdapter, model: nn.Module) -> None:
    """Every adapted module exists in the model as a dense linear of the adapter's shape."""
    base = f" (trained on {adapter.base_model!r})" if adapter.base_model else ""
    for module, (a, b) in adapter.factors.items():
        try:
            linear = model.get_submodule(module)
        except AttributeError:
            raise CompressError(
                f"LoRA adapter {adapter.path}{base} targets {module}, which this model does not have; "
                "use an adapter trained for this base model"
            ) from None
        if type(linear) is not nn.Linear:
            raise CompressError(
                f"LoRA adapter {adapter.path}: {module} is a {type(linear).__name__}, not a dense Linear; merge "
                "adapters before any pruning or quantization stage"
            )
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None and linear.weight is embeddings.weight:
            raise CompressError(
                f"LoRA adapter {adapter.path}: {module} shares its weight with the input embeddings (tied); merging "
                "would change both. Untie them in the model config or train the adapter without that module"
            )
        expected = (linear.out_features, linear.in_features)
        if (b.shape[0], a.shape[1]) != expected:
            raise CompressError(
                f"LoRA adapter {adapter.path}{base}: {module} adapts a {b.shape[0]}x{a.shape[1]} weight but the "
                f"model's is {expected[0]}x{expected[1]}; the adapter was trained for a different base model"
            )


class LoRAMergeStage(Stage):
    name = "lora_merge"
    Config = LoRAMergeConfig
    needs_calibration = False
    layerwise = False
    merges_adapters = True

    def prepare(self, model: nn.Module) -> None:
        self.adapters = [read_adapter(spec.path) for spec in self.config.adapters]
        for adapter in self.adapters:
            check_adapter(adapter, model)
        self.merged: dict[str, dict] = {}

    @torch.no_grad()
    def process_model(self, model: nn.Module, samples: torch.Tensor, device: torch.device) -> None:
        for spec, adapter in zip(self.config.adapters, self.adapters, strict=True):
            check_adapter(adapter, model)  # an earlier whole-model stage may have changed the model since prepare
            norms = []
            for module in adapter.factors:
                weight = model.get_submodule(module).weight
                delta = spec.weight * adapter.delta(module)
                norms.append(float(delta.norm() / weight.float().norm().clamp(min=1e-12)))
                weight.add_(delta.to(weight.dtype))
            self.merged[str(adapter.path)] = {
                "weight": spec.weight,
                "modules": len(adapter.factors),
                "mean_relative_update": sum(norms) / len(norms),
            }

    def finalize(self, model: nn.Module) -> dict:
        return {"adapters": self.merged}


def save_adapter(
    folder: str | Path,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    alpha: float,
    base_model: str | None = None,
) -> Path:
    """Write ``{module: (A, B)}`` as a PEFT LoRA folder (the layout :func:`read_adapter` reads and peft writes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({module.rpartition(".")[2] for module in factors})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "base_model_name_or_path": base_model,
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
