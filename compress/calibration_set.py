"""The calibration windows a run compresses with: cut from the data source's calibration text and, for the share
``data.generated``, sampled from the model itself.

Why sample from the model: windows of one corpus teach the quantizer that corpus's activations, and the loss moves to
every other kind of text (pydoc calibration, measured on the default model: GPTQ int4 x1.126 on held-out pydoc but
x1.294 on Shakespeare). Text the model writes itself at temperature 1 covers what the model has learned, not one
domain (the self-calibration idea, Williams et al. 2024). Sampling costs a forward pass per token, so the windows are
cached per model, batch, length and seed under ``artifacts/calibration``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from compress.data import DataSpec, calibration_samples, tokenize, window_start_token
from compress.errors import CompressError
from compress.locks import file_lock, lock_beside
from compress.models import decoder_layers, release_layer
from compress.paths import artifacts_dir

log = logging.getLogger(__name__)

SAMPLING_BATCH = 16  # sequences sampled together: a 135M model's cache for 16 x 512 tokens is ~100 MB
CACHE_VERSION = 1  # bump when the sampling changes, so old cached windows are not reused


def spec_for_chain(spec: DataSpec, stages: Iterable, recipe: str) -> DataSpec:
    """``spec`` without its sampled share when no stage of the chain reads calibration inputs (RTN, FP8 dynamic,
    rotations alone): sampling costs minutes on the default model, for windows nothing would read."""
    if not spec.generated or any(stage.needs_calibration for stage in stages):
        return spec
    log.info("data.generated=%s is not used: no stage of %s reads calibration inputs", spec.generated, recipe)
    return replace(spec, generated=0.0)


def calibration_set(model: nn.Module, tokenizer, text: str, spec: DataSpec, seed: int) -> torch.Tensor:
    """``[spec.num_samples, spec.seq_len]`` token ids: ``round(num_samples x generated)`` windows sampled from
    ``model``, the rest cut from ``text``; every window opens as the model expects (a Gemma model's ``<bos>``)."""
    first_token = window_start_token(model.config)
    generated = generated_windows(spec)
    parts = []
    if generated < spec.num_samples:
        ids = tokenize(tokenizer, text)
        parts.append(calibration_samples(ids, spec.num_samples - generated, spec.seq_len, seed, first_token))
    if generated:
        parts.append(sampled_windows(model, generated, spec.seq_len, seed, start_token(model, first_token)))
    return torch.cat(parts)


def generated_windows(spec: DataSpec) -> int:
    """How many of the calibration windows the model samples itself."""
    return round(spec.num_samples * spec.generated)


def start_token(model: nn.Module, first_token: int | None) -> int:
    """What a sampled window opens with: the window start of text windows, else the model's ``<bos>``, else its end
    of text (GPT-2-style vocabularies open documents with it)."""
    config = model.config
    for token in (first_token, config.bos_token_id, config.eos_token_id):
        if isinstance(token, int):
            return token
    raise CompressError(
        "data.generated: the model's config names no bos_token_id or eos_token_id to start sampling from; "
        "set data.generated=0 to calibrate on text only"
    )


def sampled_windows(model: nn.Module, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    """``[count, seq_len]`` token ids the model samples at temperature 1 from ``start``, in batches of
    ``SAMPLING_BATCH`` seeded ``seed + first row``: each batch is cached, so a smaller count reuses a larger one's.
    Seeds ``s`` and ``s + SAMPLING_BATCH`` therefore share batches: draws meant to be independent use seeds < 16."""
    identity = _model_identity(model)  # hashed once: the embedding table is the largest input
    windows = [
        _cached_batch(model, identity, min(SAMPLING_BATCH, count - done), seq_len, seed + done, start)
        for done in range(0, count, SAMPLING_BATCH)
    ]
    for index in range(len(decoder_layers(model))):  # a lazily loaded model goes back to holding no layer
        release_layer(model, index)
    return torch.cat(windows)


def _cached_batch(model: nn.Module, identity: str, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    key = hashlib.sha256(f"{CACHE_VERSION} {identity} {count} {seq_len} {seed} {start}".encode()).hexdigest()[:24]
    cache = artifacts_dir() / "calibration" / f"{key}.pt"
    with file_lock(lock_beside(cache), f"the calibration cache entry {cache}"):  # a second run reads what one samples
        if cache.is_file():
            log.info("calibration: %d sampled windows from %s", count, cache)
            return torch.load(cache)
        log.info("calibration: sampling %d windows of %d tokens from the model (seed %d)", count, seq_len, seed)
        windows = _sample(model, count, seq_len, seed, start)
        cache.parent.mkdir(parents=True, exist_ok=True)
        staged = cache.with_suffix(f".{os.getpid()}.partial")  # ranks of one torchrun sample alike
        torch.save(windows, staged)
        staged.replace(cache)
        return windows


@torch.no_grad()
def _sample(model: nn.Module, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    from tqdm.auto import tqdm

    device = model.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((count, 1), start, dtype=torch.long)
    past, step_ids = None, ids
    bar = tqdm(total=count * (seq_len - 1), desc=f"sampling {count} calibration windows", unit="token", leave=False)
    for _ in range(seq_len - 1):
        output = model(input_ids=step_ids.to(device), past_key_values=past, use_cache=True)
        past = output.past_key_values
        probabilities = torch.softmax(output.logits[:, -1].float().cpu(), dim=-1)
        step_ids = torch.multinomial(probabilities, 1, generator=generator)
        ids = torch.cat([ids, step_ids], dim=1)
        bar.update(count)
    bar.close()
    return ids


def _model_identity(model: nn.Module) -> str:
    """A digest of the model: its config, its embedding table and the weight files it came from."""
    digest = hashlib.sha256(model.config.to_json_string().encode())
    digest.update(model.get_input_embeddings().weight.detach().float().cpu().numpy().tobytes())
    folder = Path(str(getattr(model.config, "_name_or_path", "")))
    if folder.is_dir():
        for file in sorted(folder.glob("*.safetensors")):
            stat = file.stat()
            digest.update(f"{file.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()
