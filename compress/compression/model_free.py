"""Model-free quantization: a data-free chain (round-to-nearest weights) applied straight from a model folder's
safetensors files to a compressed-tensors checkpoint, one input group of linears at a time, with no model built.

Why: round to nearest needs no activations, so the layer walk's model (transformers classes, lazy layers, per-layer
fp32 copies) is overhead. Here host memory holds one input group (q/k/v, an expert's gate/up, ... : the sets that
:func:`compress.stages.hessian.input_groups` names and NVFP4 stacks for one global scale) and its quantized form,
and a family transformers cannot build still compresses if its files follow the decoder-stack layout.

The checkpoint is the layer walk's, tensor for tensor, because nothing is computed twice: each group is put in a
small module under its own names, widened to fp32 and narrowed back as the walk does (``calibration.upcast``), and
handed to the stage's own ``process_layer``; ``CheckpointWriter.write_layer`` stores it as the walk's writer does. A
meta-device skeleton of the model's modules (names, shapes and dtypes from the safetensors headers, no weights) stands
in for the model wherever the module tree is read: the stage's ``prepare`` checks, ``quantization_config``, the size
summary. Files are read and closed layer by layer, so mapped pages do not pile up either.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.base.memory import release_freed_memory
from compress.checkpoint import (
    CheckpointSummary,
    CheckpointWriter,
    load_tokenizer,
    read_quantization_config,
    source_dtype,
    torch_dtype,
)
from compress.compression.saving import checkpoint_writer, write_checkpoint
from compress.formats.moe_experts import model_name
from compress.model.layer_walk import restore_dtypes, upcast
from compress.model.lazy_weights import LazyWeights
from compress.stages import LayerContext, Stage, prepare_stages
from compress.stages.hessian import input_groups
from compress.stages.weights import target_linears

SUPPORTED = "rtn (not NVFP4 W4A4), fp8 (activations=dynamic) or w8a8 (weights=rtn)"
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
ROUTER = ".mlp.gate"  # MoE routers: transformers' TopKRouter modules (not linears), kept dense by every stage
INTEGER_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


@dataclass
class ModelFreeSummary:
    checkpoint: CheckpointSummary
    stages: list[dict]  # each stage's summary, as compress_model returns them


def model_free_eligible(stages: list[Stage]) -> str | None:
    """None when ``stages`` can run model-free, else the one-line reason why not."""
    names = ", ".join(stage.name for stage in stages)
    if len(stages) != 1:
        return f"model-free runs one round-to-nearest stage alone, not {len(stages)} ({names}); use {SUPPORTED}"
    stage = stages[0]
    if stage.needs_calibration:
        return f"stages.0 ({stage.name}) calibrates on layer inputs ({stage.algorithm()}); use {SUPPORTED}"
    if not stage.runs_model_free:
        return f"stages.0 ({stage.name}) is not a round-to-nearest weight quantizer; use {SUPPORTED}"
    return None


def goes_model_free(config, stages: list[Stage]) -> bool:
    """The run's route, which ``compress.app.pipeline`` takes and the plan predicts: a checked ``RunConfig`` whose chain
    is data-free (above) and that asks no perplexity pass, in one process, is quantized here from the weight files;
    every other run walks the layers (``compress.compression.in_memory``)."""
    return not config.eval.perplexity and not distributed.active() and model_free_eligible(stages) is None


def quantize_model_free(
    model_folder: Path,
    stages: list[Stage],
    target: Path,
    *,
    recipe: str = "model_free",
    stage_args: list[dict] | None = None,
    dtype: str = "auto",
    save_dtype: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> ModelFreeSummary:
    """Quantize the model in ``model_folder`` with ``stages`` into the compressed-tensors folder ``target`` (staged
    beside it, flushed and renamed last), the checkpoint the layer walk writes for the same chain. ``dtype``: the
    model's storage dtype, as ``model.dtype`` (``auto``: config.json's); ``save_dtype``: ``output.save_dtype``;
    ``recipe``, ``stage_args`` (default: the stages' configs) and ``extra_files``: what ``write_checkpoint`` adds."""
    from transformers import AutoConfig

    reason = model_free_eligible(stages)
    if reason is not None:
        raise CompressError(reason)
    folder = Path(model_folder)
    if read_quantization_config(folder):
        raise CompressError(f"{folder} is already quantized (config.json has a quantization_config)")
    config = AutoConfig.from_pretrained(folder)  # config.json only
    storage = source_dtype(config) if dtype == "auto" else torch_dtype(dtype)
    files = Files(folder, storage)
    skeleton = Skeleton.from_headers(config, files)
    prepare_stages(skeleton, stages)
    [stage] = stages
    with checkpoint_writer(target, save_dtype) as writer:
        start = time.perf_counter()
        written: set[str] = set()
        for index in range(len(skeleton.model.layers)):
            with files.opened(f"model.layers.{index}."):
                written |= _quantize_layer(skeleton, index, stage, files, writer)
            release_freed_memory()  # as the walk does: freed heap piles up otherwise (~half a layer per layer)
        with files.opened(""):
            for owner in skeleton.owners:
                if owner not in written:
                    writer.write_layer(files.module(skeleton.config, owner), owner)
        stage.seconds += time.perf_counter() - start
        summaries = [{"algorithm": stage.algorithm(), **stage.finalize(skeleton), "seconds": stage.seconds}]
        args = stage_args if stage_args is not None else [{"type": stage.name, **asdict(stage.config)}]
        checkpoint = write_checkpoint(
            writer, skeleton, load_tokenizer(folder), stages, summaries, recipe, args, extra_files
        )
    return ModelFreeSummary(checkpoint, summaries)


def _quantize_layer(skeleton: Skeleton, index: int, stage: Stage, files: Files, writer: CheckpointWriter) -> set[str]:
    """Decoder layer ``index``: each input group of its target linears quantized by the stage and written, then its
    other tensors (norms, routers, ignored linears) as they are; returns the owners written."""
    prefix = f"model.layers.{index}"
    layer = skeleton.get_submodule(prefix)
    written = set()
    for group in input_groups(target_linears(layer, prefix, stage.config.ignore)):
        root = files.module(skeleton.config, *(f"{prefix}.{name}" for name in group))
        part = root.get_submodule(prefix)
        widened = upcast(part)  # the walk's fp32 layer, narrowed back after (calibration.walk_layers)
        stage.process_layer(LayerContext(index, prefix, part, skeleton.config, None, torch.device("cpu"), files.dtype))
        restore_dtypes(part, widened)
        writer.write_layer(root, prefix)  # and to the meta device: the skeleton keeps the quantized modules' shells
        for name in group:
            skeleton.place(f"{prefix}.{name}", part.get_submodule(name))
            written.add(f"{prefix}.{name}")
    for owner in skeleton.owners:
        if owner.startswith(f"{prefix}.") and owner not in written:
            writer.write_layer(files.module(skeleton.config, owner), owner)
            written.add(owner)
    return written


class Files:
    """The folder's safetensors tensors by model name (``compress.formats.moe_experts.model_name``: Mixtral's
    ``block_sparse_moe`` is ``mlp``), read one at a time and cast to the storage dtype as ``LazyWeights.read`` does;
    files stay open only inside :meth:`opened`."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.folder, self.dtype = folder, dtype
        self.weight_map = LazyWeights(folder, dtype).weight_map
        if not self.weight_map:
            raise CompressError(f"{folder} holds no *.safetensors weights; model-free reads safetensors only")
        self.handles: dict[str, object] = {}
        self.keys: dict[str, str] = {}  # model name -> file key
        self.headers: dict[str, tuple[list[int], torch.dtype]] = {}  # model name -> (shape, dtype as loaded)
        self.leaves: dict[str, dict[str, str]] = {}  # owner module -> {leaf: model name}

    def read_headers(self, model_type: str | None) -> None:
        with self.opened(""):
            for key, file in self.weight_map.items():
                view = self.handles[file].get_slice(key)
                kind = view.get_dtype()
                floating = kind.startswith(("F", "BF"))
                if not floating and kind not in INTEGER_DTYPES:
                    raise CompressError(f"{key}: safetensors dtype {kind} is not a model weight model-free reads")
                name = model_name(model_type, key)
                self.keys[name] = key
                self.headers[name] = (view.get_shape(), self.dtype if floating else INTEGER_DTYPES[kind])
                owner, _, leaf = name.rpartition(".")
                self.leaves.setdefault(owner, {})[leaf] = name

    @contextmanager
    def opened(self, prefix: str) -> Iterator[None]:
        """The files holding tensors under ``prefix`` open (memory-mapped) inside, closed after."""
        with ExitStack() as stack:
            for file in sorted({file for key, file in self.weight_map.items() if key.startswith(prefix)}):
                self.handles[file] = stack.enter_context(safe_open(str(self.folder / file), framework="pt"))
            try:
                yield
            finally:
                self.handles.clear()

    def read(self, name: str) -> torch.Tensor:
        key = self.keys[name]
        tensor = self.handles[self.weight_map[key]].get_tensor(key)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def module(self, config, *owners: str) -> Tree:
        """A :class:`Tree` holding only ``owners``, with their tensors read: what one ``write_layer`` call stores."""
        tree = Tree(config)
        for owner in owners:
            tree.place(owner, build_owner(owner, {leaf: self.read(name) for leaf, name in self.leaves[owner].items()}))
        return tree


class Tree(nn.Module):
    """A module tree addressed by dotted names, with the ``config`` the checkpoint writer reads."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def place(self, name: str, module: nn.Module) -> None:
        """Put ``module`` at ``name``, making plain parents on the way (or replacing what was there)."""
        parent = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        if isinstance(parent, nn.ModuleList):
            parent[int(leaf)] = module
        else:
            parent.add_module(leaf, module)


class Skeleton(Tree):
    """The model's modules on the meta device, from the safetensors headers: what ``prepare``, the
    ``quantization_config`` and the size summary read of a model. Linears are the 2-D weights of the decoder layers
    (and ``lm_head``, tied to the embedding when the config says so), routers excepted; every other tensor lives on a
    plain module under its own name."""

    owners: list[str]  # every module holding tensors in the files, in file order

    @classmethod
    def from_headers(cls, config, files: Files) -> Skeleton:
        from transformers import GenerationConfig

        files.read_headers(getattr(config, "model_type", None))
        skeleton = cls(config)
        generation = files.folder / "generation_config.json"
        skeleton.generation_config = (
            GenerationConfig.from_pretrained(files.folder)
            if generation.is_file()
            else GenerationConfig.from_model_config(config)
        )  # what the loaded model carries into the checkpoint
        indices = [int(match[1]) for name in files.headers if (match := LAYER.match(name))]
        if not indices:
            raise CompressError(f"{files.folder}: no model.layers.N tensors; model-free needs the decoder-stack layout")
        skeleton.place("model.layers", nn.ModuleList(nn.Module() for _ in range(max(indices) + 1)))
        by_owner: dict[str, dict[str, torch.Tensor]] = {}
        for name, (shape, dtype) in files.headers.items():
            owner, _, leaf = name.rpartition(".")
            if LAYER.match(name) and len(shape) > 2:
                raise CompressError(
                    f"{files.keys[name]} {shape}: fused {len(shape)}-D weights (experts) are not read model-free; "
                    "use the layer walk, which unfuses known MoE layouts"
                )
            by_owner.setdefault(owner, {})[leaf] = torch.empty(shape, dtype=dtype, device="meta")
        skeleton.owners = list(by_owner)
        for owner, tensors in by_owner.items():
            skeleton.place(owner, build_owner(owner, tensors))
        if getattr(config, "tie_word_embeddings", False) and "lm_head" not in by_owner:
            embedding = skeleton.get_submodule("model.embed_tokens").weight
            skeleton.place("lm_head", build_owner("lm_head", {"weight": embedding}))
        return skeleton

    def get_output_embeddings(self) -> nn.Module | None:
        """The head, which the size summary counts apart from the other linears (as transformers models name it)."""
        return getattr(self, "lm_head", None)


def build_owner(owner: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The module holding ``tensors`` (by leaf name): an ``nn.Linear`` for a decoder layer's or the head's 2-D
    ``weight`` (and bias), a plain module otherwise; the tensors are its parameters, as in the loaded model."""
    weight = tensors.get("weight")
    linear = owner == "lm_head" or (LAYER.match(f"{owner}.") is not None and not owner.endswith(ROUTER))
    if linear and weight is not None and weight.dim() == 2 and set(tensors) <= {"weight", "bias"}:
        module = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in tensors, device="meta", dtype=weight.dtype)
    else:
        module = nn.Module()
    for leaf, tensor in tensors.items():
        parameter = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
        module.register_parameter(leaf, parameter)
    return module
