"""``compress.oneshot`` (defined here): compression as a library call, the CLI's ``run`` without evaluation,
gate or tracking.

    from compress import oneshot
    checkpoint = oneshot(model="org/name", recipe="gptq_int4", output_dir="out/gptq",
                         overrides=["stages.0.group_size=128", "data.num_samples=128"])

The recipe is composed exactly as ``python -m compress run`` composes it (same files, same checks, same one-line
errors); the checkpoint is the same compressed-tensors folder, written to a temporary sibling and renamed when
complete.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from compress.app.recipe import RecipeLike, compose
from compress.base import distributed
from compress.base.data import DataSpec, load_corpus
from compress.base.errors import CompressError
from compress.base.paths import artifacts_dir
from compress.compression.in_memory import compress_model
from compress.compression.saving import checkpoint_writer, write_checkpoint
from compress.model.calibration_set import calibration_set, spec_for_chain
from compress.model.sources import load, resolve_model_path
from compress.stages import build_chain

DataLike = str | Path | torch.Tensor | Sequence[str] | None


def oneshot(
    model: str | Path | nn.Module,
    recipe: RecipeLike,
    data: DataLike = None,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    tokenizer=None,
    device: str | None = None,
) -> Path:
    """Compress ``model`` with ``recipe`` and return the checkpoint folder.

    - ``model``: a local folder, a hub id, the default model's name (``smollm2-135m``) or an ``nn.Module`` (pass its
      ``tokenizer`` to save one with the checkpoint and to calibrate on text).
    - ``recipe``: a recipe name from ``recipes/``, a path to a recipe YAML file, or a list of stage mappings
      (``[{"type": "gptq", "bits": 4, "group_size": 64}]``).
    - ``data``: None for the recipe's calibration text; a ``.txt``/``.jsonl`` file; a ``datasets`` name; a list of
      strings; or token ids ``[num_samples, seq_len]`` used as they are. Text you give is what the recipe calibrates
      on: a recipe that samples its windows from the model (``data: sampled``) samples none unless
      ``data.generated=...`` is among the overrides, as ``data=...`` on the command line.
    - ``overrides``: the CLI's ``key=value`` overrides (``stages.0.group_size=128``, ``data.num_samples=128``).
    - ``output_dir``: where the checkpoint goes (must not exist); default ``<artifacts>/oneshot/<recipe>-<time>``.
    - ``device``: where each layer is calibrated (default: the recipe's ``device``, ``auto`` = CUDA when visible).

    A model loaded here is written to the checkpoint layer by layer during the compression (host memory never holds
    the whole compressed model); an ``nn.Module`` passed in is compressed in place and stays usable.

    Under ``torchrun --nproc-per-node N`` every rank calls ``oneshot`` alike: each calibrates on its shard of the
    samples, rank 0 writes the checkpoint, and every rank returns its path once it is complete.
    """
    distributed.init()
    source = None if isinstance(model, nn.Module) else str(model)
    config = compose(recipe, overrides, source)  # a bad recipe fails here, before anything is loaded
    stages = build_chain(config.stages)
    default = artifacts_dir() / "oneshot" / f"{config.recipe}-{_stamp()}"
    target = Path(output_dir) if output_dir else distributed.broadcast_object(default)  # rank 0's clock names it
    if target.exists():
        raise CompressError(f"output_dir {target} already exists; choose another folder or remove it")
    distributed.barrier()  # every rank has checked before rank 0 can write it
    if source is not None:
        distributed.main_first(lambda: resolve_model_path(config.model))  # convert the default model once
    loaded, tokenizer = (model, tokenizer) if source is None else load(config.model)
    compute = distributed.select_device(device or config.device)
    spec = spec_for_chain(user_text_spec(config.data, data, overrides), stages, config.recipe)
    samples = calibration_ids(data, spec, loaded, tokenizer, config.seed, compute)
    save_dtype = config.output.save_dtype
    writer = checkpoint_writer(target, save_dtype) if distributed.is_main() else None
    with writer or nullcontext():
        # a model we loaded is written layer by layer as the walk finishes each; a module you pass stays whole
        sink = writer.layer_sink(loaded) if writer is not None and source is not None else None
        summaries = compress_model(loaded, stages, samples, compute, config.calibration_batch_size, sink)
        if writer is not None:
            write_checkpoint(
                writer, loaded, tokenizer, stages, summaries, config.recipe, config.stages, calibration=samples
            )
    distributed.barrier()
    return target


def user_text_spec(spec: DataSpec, data: DataLike, overrides: Sequence[str]) -> DataSpec:
    """``spec`` with no sampled share when the caller names a text and no ``data.generated=`` override: the user's
    text wins over a recipe's ``data: sampled`` (the command line's ``data=...`` replaces that group alike)."""
    asked = any(override.split("=", 1)[0].lstrip("+~") == "data.generated" for override in overrides)
    if data is None or isinstance(data, torch.Tensor) or asked or not spec.generated:
        return spec
    return replace(spec, generated=0.0)


def calibration_ids(
    data: DataLike, spec: DataSpec, model: nn.Module, tokenizer, seed: int, device: torch.device | None = None
) -> torch.Tensor:
    """Token ids ``[num_samples, seq_len]`` from whatever ``data`` is (see :func:`oneshot`): token ids are used as they
    are; text gives windows (opening with a Gemma model's ``<bos>``), with the share ``spec.generated`` sampled from
    ``model`` itself (:mod:`compress.model.calibration_set`) on ``device`` (default: where the model is)."""
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype != torch.long:
            raise CompressError(
                f"data: token ids must be a [num_samples, seq_len] long tensor, not {data.dtype} "
                f"of shape {list(data.shape)}"
            )
        return data
    if tokenizer is None:
        raise CompressError("data: text calibration needs a tokenizer; pass tokenizer=... or token ids as data")
    if isinstance(data, Sequence) and not isinstance(data, str):
        text = "\n\n".join(data)
    else:
        if data is not None:
            path = Path(data).expanduser()
            spec = DataSpec(
                **{
                    **vars(spec),
                    **(
                        {"source": "file", "path": str(path)} if path.is_file() else {"source": "hf", "name": str(data)}
                    ),
                }
            )
        text = load_corpus(spec).calibration_text
    return calibration_set(model, tokenizer, text, spec, seed, device)


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
