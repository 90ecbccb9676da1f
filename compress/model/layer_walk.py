"""Layer-by-layer calibration: capture the first decoder layer's inputs, then walk the stack one layer at a time.

Only one layer's activations are alive at once (the inputs of layer ``i``, replaced by its outputs once the layer is
processed), so peak memory is the model plus one layer's activations. Each processed layer's *quantized* outputs
feed the next layer, so later layers calibrate against the errors earlier layers really make.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.formats.moe_experts import all_tokens_through_experts
from compress.grids.int_grid import all_finite


@dataclass
class LayerInputs:
    """Per calibration batch: the hidden states entering a decoder layer and the keyword arguments the model's
    forward passed to it (rotary position embeddings, masks, positions)."""

    hidden: list[torch.Tensor]
    kwargs: list[dict] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


class _StopForward(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack (``model.model.layers``) of a causal LM: every family we support keeps it there (llama,
    mistral, qwen2, qwen3, gemma2, gemma3 text, phi3); which stages support which family is in docs/quantization.md."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise CompressError(
            f"{type(model).__name__} has no `model.layers` decoder stack; supported: causal LMs of the llama, mistral, "
            "qwen2, qwen3, gemma2, gemma3 (text-only) and phi3 families"
        )
    return layers


@torch.no_grad()
def capture_first_layer_inputs(
    model: nn.Module, samples: torch.Tensor, batch_size: int, device: torch.device
) -> LayerInputs:
    """Run the model up to its first decoder layer for every batch of ``samples`` and keep what enters it, in fp32
    (the walk calibrates each layer in fp32 whatever dtype the model is stored in)."""
    layers = decoder_layers(model)
    captured = LayerInputs(hidden=[])

    def catch(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in {"hidden_states", "past_key_values", "past_key_value"}}
        kwargs["use_cache"] = False
        captured.hidden.append(to_fp32(hidden))
        captured.kwargs.append(to_fp32(kwargs))
        raise _StopForward

    inner = model.model
    moved = [m for m in (inner.embed_tokens, getattr(inner, "rotary_emb", None)) if m is not None]
    for module in moved:
        module.to(device)
    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for start in range(0, len(samples), batch_size):
            try:
                model(input_ids=samples[start : start + batch_size].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
        for module in moved:
            module.to("cpu")
    return captured


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, name: str) -> LayerInputs:
    """The layer's outputs for every batch, which become the next layer's inputs."""
    outputs = []
    for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
        out = layer(hidden, **kwargs)
        outputs.append(checked_output(out[0] if isinstance(out, tuple) else out, name))
    return LayerInputs(hidden=outputs, kwargs=inputs.kwargs)


class FullPrecisionStream:
    """The full-precision model's inputs to the layer being processed, carried beside the walk's (which come out of
    the already-compressed layers before it): for stages whose target is what the uncompressed model computes."""

    def __init__(self):
        self.inputs: LayerInputs | None = None

    def advance(self, layer: nn.Module, walk_inputs: LayerInputs, index: int, name: str) -> tuple:
        """``(this layer's full-precision inputs, its outputs on them)`` from ``layer`` as it is now (call before
        changing it); the outputs become the next layer's inputs. Layer 0's inputs are the walk's own."""
        inputs = walk_inputs if index == 0 or self.inputs is None else self.inputs
        self.inputs = run_layer(layer, inputs, name)
        return inputs, self.inputs


def checked_output(out: torch.Tensor, name: str) -> torch.Tensor:
    """``out``, a layer's output on calibration inputs, refused if it holds NaN/inf."""
    if not all_finite(out):
        raise CompressError(
            f"{name}: non-finite values (NaN/inf) in the layer's calibration outputs; check the model weights "
            "and the previous stages (a diverged scale or a corrupt checkpoint)"
        )
    return out


@torch.no_grad()
def observe_inputs(
    layer: nn.Module,
    inputs: LayerInputs,
    prefix: str,
    observers: dict[str, Callable[[torch.Tensor], None]],
    stop_after: str | None = None,
) -> None:
    """Run ``layer`` over every calibration batch and hand each named submodule's input, flattened to
    ``[tokens, in]`` in fp32, to its observer. With ``stop_after``, each batch's forward ends once that submodule has
    run (nothing after it is needed). NaN/inf inputs are refused, naming the submodule. Every MoE expert sees every
    token here (its statistics never starve on a router that rarely picks it); the layer's output stays routed."""

    def hook_for(name: str, observe: Callable[[torch.Tensor], None]):
        def hook(_module, args, _output):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            if not all_finite(x):
                raise CompressError(
                    f"{prefix}.{name}: calibration activations hold NaN/inf; check the model weights, the calibration "
                    "text and earlier stages"
                )
            observe(x)

        return hook

    def stop(_module, _args, _output):
        raise _StopForward

    handles = [layer.get_submodule(n).register_forward_hook(hook_for(n, fn)) for n, fn in observers.items()]
    if stop_after is not None:
        handles.append(layer.get_submodule(stop_after).register_forward_hook(stop))
    try:
        with all_tokens_through_experts(layer):
            for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
                try:
                    layer(hidden, **kwargs)
                except _StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def input_absmax(layer: nn.Module, inputs: LayerInputs, prefix: str, names: list[str]) -> dict[str, torch.Tensor]:
    """max |x| over every calibration token at each named submodule's input (a static per-tensor range), over
    every rank's shard when calibration is data-parallel."""
    maxima: dict[str, torch.Tensor] = {}

    def observer(name: str) -> Callable[[torch.Tensor], None]:
        def observe(x: torch.Tensor) -> None:
            peak = x.abs().amax()
            maxima[name] = torch.maximum(maxima.get(name, peak), peak)

        return observe

    observe_inputs(layer, inputs, prefix, {name: observer(name) for name in names})
    return {name: distributed.all_reduce_max(peak) for name, peak in maxima.items()}


HALF_DTYPES = (torch.bfloat16, torch.float16)


def to_fp32(value):
    """``value`` with every 16-bit float tensor in it (nested in tuples, lists, dicts) cast to fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in HALF_DTYPES else value
    if isinstance(value, tuple | list):
        return type(value)(to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: to_fp32(v) for k, v in value.items()}
    return value


def _named_tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _replace_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Parameters keep their identity (tied weights stay tied); buffers are swapped in their owner."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf].data = value
    else:
        owner._buffers[leaf] = value


@torch.no_grad()
def upcast(module: nn.Module) -> dict[str, torch.dtype]:
    """Cast ``module``'s 16-bit float parameters and buffers to fp32 in place, where they already are (on the
    compute device, the fp32 copy exists only there). Returns their dtypes by name for :func:`restore_dtypes`."""
    stored = {}
    for name, tensor in list(_named_tensors(module)):
        if tensor.dtype in HALF_DTYPES:
            stored[name] = tensor.dtype
            _replace_tensor(module, name, tensor.float())
    return stored


@torch.no_grad()
def restore_dtypes(module: nn.Module, stored: dict[str, torch.dtype]) -> None:
    """Cast back what :func:`upcast` widened and is still fp32 (possibly changed by a stage: folded scales, pruned
    weights). Tensors the stages created (packed codes, fp8 weights, their scales) keep the dtype they were made in."""
    for name, tensor in list(_named_tensors(module)):
        if name in stored and tensor.dtype == torch.float32:
            _replace_tensor(module, name, tensor.to(stored[name]))


@contextmanager
def fp32_compute(model: nn.Module):
    """Inside, ``model``'s 16-bit tensors compute in fp32 as if the whole model had been widened, but only one
    decoder layer is fp32 at a time (widened when its forward starts, narrowed back when it ends); the parts outside
    the decoder stack (embeddings, final norm, head) stay widened throughout. Widening the whole model held an fp32
    copy of every layer: twice a bf16 model's size on top of it."""
    outside = [module for name, module in model.named_children() if name != "model"]
    outside += [module for name, module in model.model.named_children() if name != "layers"]
    stored = [(module, upcast(module)) for module in outside]
    widened: dict[int, dict[str, torch.dtype]] = {}

    def widen(layer, _args):
        widened[id(layer)] = upcast(layer)

    def narrow(layer, _args, _output):
        restore_dtypes(layer, widened.pop(id(layer)))

    handles = []
    for layer in decoder_layers(model):
        handles += [layer.register_forward_pre_hook(widen), layer.register_forward_hook(narrow)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer in decoder_layers(model):
            if id(layer) in widened:  # a forward that raised inside the layer
                restore_dtypes(layer, widened.pop(id(layer)))
        for module, dtypes in reversed(stored):
            restore_dtypes(module, dtypes)
