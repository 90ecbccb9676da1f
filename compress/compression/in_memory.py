"""Compress a model in memory: prepare → layer walk → finalize for a list of stages.

This is the one entry point beneath ``compress.oneshot`` and the ``run`` pipeline; tests and benchmarks call it
directly. It knows nothing of recipes, run folders, evaluation or tracking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from compress.base import distributed
from compress.base.errors import CompressError
from compress.base.memory import release_freed_memory
from compress.formats.moe_experts import expert_token_report, moe_family, unfuse_experts
from compress.model.layer_walk import capture_first_layer_inputs, decoder_layers, restore_dtypes, run_layer, upcast
from compress.model.lazy_weights import mark_materialized, materialize_all, materialize_layer
from compress.model.resume import WalkProgress
from compress.stages import LayerContext, Stage, build_chain, check_chain, prepare_stages


def compress_model(
    model: torch.nn.Module,
    stages: Sequence[Stage | dict],
    samples: torch.Tensor,
    device: torch.device | str = "cpu",
    batch_size: int = 8,
    layer_done: Callable[[str], None] | None = None,
    progress: WalkProgress | None = None,
) -> list[dict]:
    """Apply ``stages`` (Stage objects, or recipe-style ``{"type": ..., ...}`` mappings checked as a chain) to
    ``model`` in place, calibrating on the token ids ``samples`` ([n, seq_len]); returns each stage's summary, in
    order, with its own wall time under ``seconds``. Every stage's ``prepare`` runs before any work, so a model a
    stage cannot handle fails before anything is changed. Under torchrun each rank calibrates on its own shard of
    ``samples`` (``compress.base.distributed``) and every rank ends with the same compressed model.

    ``layer_done(name)`` hears each decoder layer's module name as soon as nothing will change or read its weights
    again, so the caller can write the layer out and drop it (``CheckpointWriter.write_layer``): the chain ends in
    a layer walk and no stage reads every weight back in ``finalize`` (a pruner checks its masks there). For any
    other chain it is never called and the model stays whole.

    ``progress`` keeps the first layer walk's state after every layer and continues from it
    (``compress.model.resume``)."""
    if all(isinstance(s, dict) for s in stages):
        chain = build_chain([dict(s) for s in stages])
    else:
        chain = list(stages)
        check_chain(chain)  # the same order rules as a recipe
    device = distributed.device_for(torch.device(device))
    unfuse_experts(model)  # MoE: one linear per expert, so every stage sees (and the checkpoint names) each one
    if distributed.active():
        _check_data_parallel(model, chain)
        samples = distributed.shard(samples, batch_size)
    prepare_stages(model, chain)
    streamable = chain[-1].layerwise and not any(stage.prunes_weights for stage in chain)
    apply_stages(model, chain, samples, device, batch_size, layer_done if streamable else None, progress)
    distributed.barrier()  # every rank holds the same compressed model
    summaries = [{"algorithm": stage.algorithm(), **stage.finalize(model), "seconds": stage.seconds} for stage in chain]
    experts = expert_token_report(model)
    for stage, summary in zip(chain, summaries, strict=True):
        if experts and stage.needs_calibration:
            summary["expert_tokens"] = experts
    return summaries


def _check_data_parallel(model: torch.nn.Module, chain: list[Stage]) -> None:
    """What data-parallel calibration does not cover yet, refused in one line before any work."""
    trained = [stage.name for stage in chain if not stage.layerwise and stage.needs_calibration]
    if trained:
        raise CompressError(
            f"{trained[0]} trains on the whole model and cannot run data-parallel yet; run it in one process"
        )
    if moe_family(model) is not None and any(stage.needs_calibration for stage in chain):
        raise CompressError(
            "calibrating a mixture-of-experts model data-parallel is not supported yet (each rank routes its own "
            "tokens to different experts); run it in one process"
        )


def apply_stages(
    model: torch.nn.Module,
    stages: list[Stage],
    samples: torch.Tensor,
    device: torch.device,
    batch_size: int,
    layer_done: Callable[[str], None] | None = None,
    progress: WalkProgress | None = None,
) -> None:
    """Run the chain in order: whole-model stages one by one, each run of consecutive layerwise stages in one walk.
    Every stage hears ``before_stage`` for each position as its turn comes (all of a walk's stages before it starts).
    A whole-model stage (or a teacher copy) needs every layer, so a lazily loaded model is read in full first.
    ``layer_done`` is handed to the last walk, when the chain ends in one; ``progress`` to the first.
    """
    if not all(stage.layerwise for stage in stages):
        materialize_all(model)
    run: list[int] = []
    for position, stage in enumerate([*stages, None]):
        if stage is not None and stage.layerwise:
            run.append(position)
            continue
        if run:
            _announce(stages, model, run)
            last = stage is None
            walk = [stages[p] for p in run]
            try:
                walk_layers(model, walk, samples, device, batch_size, layer_done if last else None, progress)
            finally:  # ended or failed, the walk lets go of its progress folder
                if progress is not None:
                    progress.release()
            run, progress = [], None
        if stage is not None:
            _announce(stages, model, [position])
            start = time.perf_counter()
            stage.process_model(model, samples, device)
            stage.seconds += time.perf_counter() - start


def _announce(stages: list[Stage], model: torch.nn.Module, positions: list[int]) -> None:
    for position in positions:
        for stage in stages:
            stage.before_stage(model, position)


def walk_layers(
    model: torch.nn.Module,
    stages: list[Stage],
    samples: torch.Tensor,
    device: torch.device,
    batch_size: int,
    layer_done: Callable[[str], None] | None = None,
    progress: WalkProgress | None = None,
) -> None:
    """One walk over the decoder layers. Each layer is read from disk if it was loaded lazily, goes to ``device``,
    is widened to fp32 there, gets every stage, computes the next layer's fp32 inputs, and goes back to the model's
    dtype and to the CPU: only one layer and its activations are ever on the device or in fp32. ``progress`` keeps
    it with what the next layer needs, and ``layer_done`` then hears its name. A walk that ``progress`` has seen
    before starts after its last kept layer, whose successors' inputs it kept."""
    calibrate = any(stage.needs_calibration for stage in stages)
    layers = decoder_layers(model)
    storage_dtype = getattr(model, "dtype", torch.float32)  # what quantization scales are rounded to
    layers_name = next(module_name for module_name, module in model.named_modules() if module is layers)
    done, inputs = progress.restore(layers, stages, device) if progress is not None else (0, None)
    for index in range(done):
        mark_materialized(model, index)
        if layer_done is not None:
            layer_done(f"{layers_name}.{index}")
    if calibrate and done == 0:
        inputs = capture_first_layer_inputs(model, samples, batch_size, device)
    for index in tqdm(
        range(done, len(layers)),
        initial=done,
        total=len(layers),
        desc=f"compress [{'+'.join(s.name for s in stages)}]",
        unit="layer",
        disable=not distributed.is_main(),
    ):
        materialize_layer(model, index)
        layer = layers[index].to(device)
        stored_dtypes = upcast(layer)
        name = f"model.layers.{index}"
        outputs = None
        for stage in stages:
            start = time.perf_counter()
            ctx = LayerContext(index, name, layer, model.config, inputs, device, storage_dtype)
            stage.process_layer(ctx)
            outputs = ctx.outputs  # a later stage that changes the layer without computing them resets them
            stage.seconds += time.perf_counter() - start
        if calibrate:
            inputs = outputs if outputs is not None else run_layer(layer, inputs, name)
        restore_dtypes(layer, stored_dtypes)
        layers[index] = layer.to("cpu")
        if progress is not None:
            progress.save(index, layers[index], inputs if index + 1 < len(layers) else None, stages)
        if layer_done is not None:
            layer_done(f"{layers_name}.{index}")
        release_freed_memory()
