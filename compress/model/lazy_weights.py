"""Lazily loaded models: decoder layers stay on the meta device until the layer walk (or a forward pass) reaches
them, so peak host memory is one layer plus what is kept, not the whole model."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from compress.checkpoint import parameters_on_meta, source_dtype
from compress.model.layer_walk import decoder_layers

log = logging.getLogger(__name__)


class LazyWeights:
    """Which safetensors file holds each tensor of a local checkpoint, so one decoder layer can be read on its own.

    A lazily loaded model keeps its decoder layers on the meta device until :func:`materialize_layer` reads them:
    peak host memory during compression is the embeddings and head, the layers processed so far (small once
    quantized), one layer being processed and its calibration activations, instead of the whole model.
    """

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.folder, self.dtype = folder, dtype
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            self.weight_map = {}
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    self.weight_map.update(dict.fromkeys(handle.keys(), file.name))
        self.layers_prefix = ""
        self.loaded: set[int] = set()

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, floating ones cast to the model's dtype; each file is opened once."""
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.weight_map[key], []).append(key)
        tensors = {}
        for filename, names in by_file.items():
            with safe_open(str(self.folder / filename), framework="pt") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    tensors[name] = tensor.to(self.dtype) if tensor.is_floating_point() else tensor
        return tensors

    def layer_keys(self, index: int) -> list[str]:
        prefix = f"{self.layers_prefix}.{index}."
        return [key for key in self.weight_map if key.startswith(prefix)]


def load_lazy(folder: Path, trust_remote_code: bool, dtype: torch.dtype | str):
    """The model with embeddings, final norm and head loaded and every decoder layer still on the meta device;
    None when the checkpoint's tensor names are not exactly the model's (transformers renames some legacy
    checkpoints while loading them), so the caller falls back to the eager load."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    dtype = source_dtype(config) if dtype == "auto" else dtype
    weights = LazyWeights(folder, dtype)
    with parameters_on_meta():  # buffers (rotary frequencies) are computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    stored = set(weights.weight_map)
    expected = set(model.state_dict())
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {tied name: name it shares its tensor with}
    missing = {key for key in expected - stored if tied.get(key) not in stored}
    if missing or stored - expected:
        log.info(
            "%s: tensor names differ from the model's (%d missing, %d extra); loading eagerly",
            folder,
            len(missing),
            len(stored - expected),
        )
        return None
    layers = decoder_layers(model)
    weights.layers_prefix = next(name for name, module in model.named_modules() if module is layers)
    eager = [key for key in stored if not key.startswith(f"{weights.layers_prefix}.")]
    model.load_state_dict(weights.read(eager), strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the input embedding; the tied head must follow it
    if (folder / "generation_config.json").is_file():  # from_config derived one from config.json alone
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.lazy_weights = weights
    owner = weakref.ref(model)  # a strong reference here would make a cycle: the model freed only by a GC pass
    for index, layer in enumerate(layers):  # a plain forward pass reads each layer as it reaches it
        layer.register_forward_pre_hook(lambda module, args, index=index: materialize_layer(owner(), index))
    return model


def materialize_layer(model: torch.nn.Module, index: int) -> None:
    """Read decoder layer ``index`` from disk if the model was loaded lazily and the layer is still on meta."""
    weights: LazyWeights | None = getattr(model, "lazy_weights", None)
    if weights is None or index in weights.loaded:
        return
    prefix = f"{weights.layers_prefix}.{index}."
    tensors = weights.read(weights.layer_keys(index))
    decoder_layers(model)[index].load_state_dict(
        {key.removeprefix(prefix): value for key, value in tensors.items()}, strict=True, assign=True
    )
    weights.loaded.add(index)


def mark_materialized(model: torch.nn.Module, index: int) -> None:
    """Decoder layer ``index`` was put in place by other means (a resumed walk): never read it from disk again."""
    weights: LazyWeights | None = getattr(model, "lazy_weights", None)
    if weights is not None:
        weights.loaded.add(index)


def release_layer(model: torch.nn.Module, index: int) -> None:
    """Send a lazily loaded model's decoder layer ``index`` back to the meta device (the next
    :func:`materialize_layer` reads it from disk again): a streamed evaluation leaves the model as lean as it was."""
    weights: LazyWeights | None = getattr(model, "lazy_weights", None)
    if weights is None or index not in weights.loaded:
        return
    for module in decoder_layers(model)[index].modules():
        for name, param in module.named_parameters(recurse=False):
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)
    weights.loaded.discard(index)


def materialize_all(model: torch.nn.Module) -> None:
    """Every decoder layer in memory: whole-model stages and perplexity need them all."""
    if getattr(model, "lazy_weights", None) is not None:
        for index in range(len(decoder_layers(model))):
            materialize_layer(model, index)
