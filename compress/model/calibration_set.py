"""The calibration windows a run compresses with: cut from the data source's calibration text and, for the share
``data.generated``, sampled from the model itself.

Why sample from the model: windows of one corpus teach the quantizer that corpus's activations, and the loss moves to
every other kind of text (pydoc calibration, measured on the default model: GPTQ int4 x1.126 on held-out pydoc but
x1.294 on Shakespeare). Text the model writes itself at temperature 1 covers what the model has learned, not one
domain (the self-calibration idea, Williams et al. 2024). Sampling costs a forward pass per token, so the windows are
cached per model, batch, length, seed and sampling path under ``artifacts/calibration``.

Sampling runs on the run's device (the model is moved there for it and back after, a lazily loaded model one layer
at a time), through one of two paths that draw from the same distribution (temperature 1, the model's full softmax):
``engine``, our engine's continuous batching over the paged KV cache (``compress.engine.LLM``), one generator per
window seeded ``batch seed + row``; or ``loop``, a KV-cached transformers forward per token for the whole batch, one
generator per batch (the windows cached before the engine path existed), its KV cache written into buffers sized once
(``compress.model.decode_cache``: the same windows without transformers' per-step copies). The two give different
windows for the same seed, so the engine's are cached under their own key. Each device type takes the path measured
faster there (``SAMPLING_PATH``): the loop on a CPU (benchmarks/results/sampling-speed.md), the engine on a GPU.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from compress.base.data import DataSpec, calibration_samples, tokenize, window_start_token
from compress.base.errors import CompressError, EnvironmentFailure
from compress.base.locks import file_lock, lock_beside
from compress.base.paths import artifacts_dir
from compress.base.staging import write_file_atomically
from compress.model.layer_walk import decoder_layers
from compress.model.lazy_weights import materialize_layer, release_layer

log = logging.getLogger(__name__)

SAMPLING_BATCH = 16  # windows per cached batch, each batch from its own seed (a smaller count reuses a larger one's)
# Consecutive batches not in the cache are decoded together, this many at a time: a decode step then reads the weights
# once for all of their windows, and each batch keeps its own generator (the loop) or per-row seeds (the engine), so
# its windows are the ones it would get alone (tests/compress/test_calibration_set.py). KV cache of the default model
# in fp32: ~46 KB a token, 0.75 GB for 2 x 16 windows of 512.
DECODE_BATCHES = 2
CACHE_VERSION = 1  # bump when the sampling changes, so old cached windows are not reused
SAMPLING_PATHS = ("engine", "loop")
# The default path per device type: on 2 CPU cores the loop measured faster (the engine 0.64x of its tokens/s at
# 16 x 256 tokens, benchmarks/results/sampling-speed.md) and keeps the windows cached before; a GPU decodes through the
# engine (continuous batching, CUDA graphs; not timed against the loop yet). Other device types take the loop.
SAMPLING_PATH = {"cpu": "loop", "cuda": "engine"}


def spec_for_chain(spec: DataSpec, stages: Iterable, recipe: str) -> DataSpec:
    """``spec`` without its sampled share when no stage of the chain reads calibration inputs (RTN, FP8 dynamic,
    rotations alone): sampling costs minutes on the default model, for windows nothing would read."""
    if not spec.generated or any(stage.needs_calibration for stage in stages):
        return spec
    log.info("data.generated=%s is not used: no stage of %s reads calibration inputs", spec.generated, recipe)
    return replace(spec, generated=0.0)


def calibration_set(
    model: nn.Module, tokenizer, text: str, spec: DataSpec, seed: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[spec.num_samples, spec.seq_len]`` token ids: ``round(num_samples x generated)`` windows sampled from
    ``model`` on ``device`` (default: where the model is), the rest cut from ``text``; every window opens as the
    model expects (a Gemma model's ``<bos>``)."""
    first_token = window_start_token(model.config)
    generated = generated_windows(spec)
    parts = []
    if generated < spec.num_samples:
        ids = tokenize(tokenizer, text)
        parts.append(calibration_samples(ids, spec.num_samples - generated, spec.seq_len, seed, first_token))
    if generated:
        parts.append(sampled_windows(model, generated, spec.seq_len, seed, start_token(model, first_token), device))
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


def sampled_windows(
    model: nn.Module,
    count: int,
    seq_len: int,
    seed: int,
    start: int,
    device: torch.device | str | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """``[count, seq_len]`` token ids the model samples at temperature 1 from ``start`` on ``device`` (default: where
    the model is), in batches of ``SAMPLING_BATCH`` seeded ``seed + first row``: each batch is cached, so a smaller
    count reuses a larger one's, and up to ``DECODE_BATCHES`` of them not cached yet are decoded together. Seeds
    ``s`` and ``s + SAMPLING_BATCH`` therefore share batches: draws meant to be independent use seeds < 16.
    ``path``: ``engine`` or ``loop`` (default :func:`sampling_path`)."""
    path = path or sampling_path(model, device)
    if path not in SAMPLING_PATHS:
        raise CompressError(f"sampling path {path!r} is unknown; use one of {', '.join(SAMPLING_PATHS)}")
    identity = _model_identity(model)  # hashed once: the embedding table is the largest input
    target = model.get_input_embeddings().weight.device if device is None else torch.device(device)
    # the engine draws an accelerator's rows there, from other random streams (compress.engine.sampler): its own key
    label = path if path == "loop" or target.type == "cpu" else f"{path} {target.type}"
    batches = seeded_batches(count, seed)
    with ExitStack() as stack:
        moved = []

        def sample(group: list[tuple[int, int]]) -> list[torch.Tensor]:
            """Consecutive batches ``(size, seed)``, decoded together."""
            if not moved:  # the first batch not in the cache: the model goes to the device, once
                moved.append(stack.enter_context(on_device(model, device)))
            sampler = _sample_engine if path == "engine" else _sample
            sizes = [size for size, _ in group]
            return list(_timed(sampler, model, sum(sizes), seq_len, group[0][1], start).split(sizes))

        windows = _cached_batches(sample, identity, batches, seq_len, start, label)
    for index in range(len(decoder_layers(model))):  # a lazily loaded model goes back to holding no layer
        release_layer(model, index)
    return torch.cat(windows)


def seeded_batches(count: int, seed: int) -> list[tuple[int, int]]:
    """How ``count`` windows at ``seed`` split into cached batches: ``(size, seed + first row)``, ``SAMPLING_BATCH``
    rows each but the last."""
    return [(min(SAMPLING_BATCH, count - done), seed + done) for done in range(0, count, SAMPLING_BATCH)]


def sampling_path(model: nn.Module, device: torch.device | str | None = None) -> str:
    """The faster path on ``device`` (default: where the model is), ``SAMPLING_PATH``; the transformers loop for a
    family the engine does not run."""
    from compress.engine.model_runner import SUPPORTED_MODEL_TYPES

    device = model.get_input_embeddings().weight.device if device is None else torch.device(device)
    path = SAMPLING_PATH.get(device.type, "loop")
    return "loop" if model.config.model_type not in SUPPORTED_MODEL_TYPES else path


@contextmanager
def on_device(model: nn.Module, device: torch.device | str | None) -> Iterator[None]:
    """``model`` on ``device`` for the block, then back where it was: a lazily loaded model reads each decoder layer
    straight to the device (the host never holds them all) and drops them again after."""
    home = model.get_input_embeddings().weight.device
    target = home if device is None else torch.device(device)
    if target == home:
        yield
        return
    log.info("calibration: sampling on %s (the model moves there for it, then back to %s)", target, home)
    lazy = getattr(model, "lazy_weights", None) is not None
    layers = decoder_layers(model)
    try:
        if lazy:
            for index, layer in enumerate(layers):
                materialize_layer(model, index)
                layer.to(target)
        model.to(target)
        yield
    finally:
        if lazy:
            for index in range(len(layers)):  # back to meta: nothing of them is copied to the host
                release_layer(model, index)
        _move_resident(model, home)
        if target.type == "cuda":
            torch.cuda.empty_cache()


def _move_resident(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)`` for the tensors that hold data: ``Module.to`` refuses a model whose released layers are on
    meta (it cannot copy out of them), and they must stay there."""
    for submodule in model.modules():
        for param in submodule.parameters(recurse=False):
            if not param.is_meta:
                param.data = param.data.to(device)
        for name, buffer in submodule.named_buffers(recurse=False):
            if not buffer.is_meta:
                setattr(submodule, name, buffer.to(device))


def _cache_entry(identity: str, count: int, seq_len: int, seed: int, start: int, path: str) -> Path:
    suffix = "" if path == "loop" else f" {path}"  # the loop keeps the key its windows were cached under before
    key = f"{CACHE_VERSION} {identity} {count} {seq_len} {seed} {start}{suffix}"
    return artifacts_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _cached_batches(
    sample, identity: str, batches: list[tuple[int, int]], seq_len: int, start: int, path: str
) -> list[torch.Tensor]:
    """Each batch ``(size, seed)`` read from its cache entry, or sampled (runs of consecutive missing batches,
    ``DECODE_BATCHES`` at a time) and written to it. Every entry's lock is held throughout, taken in order: a second
    run of the same windows waits, then reads what this one sampled."""
    entries = [_cache_entry(identity, size, seq_len, seed, start, path) for size, seed in batches]
    with ExitStack() as locks:
        for cache in entries:
            locks.enter_context(file_lock(lock_beside(cache), f"the calibration cache entry {cache}"))
        windows: list[torch.Tensor | None] = []
        for cache, (size, _) in zip(entries, batches, strict=True):
            found = cache.is_file()
            if found:
                log.info("calibration: %d sampled windows from %s", size, cache)
            windows.append(_read_cached(cache, size, seq_len) if found else None)
        for run in _runs([index for index, found in enumerate(windows) if found is None], DECODE_BATCHES):
            group = [batches[index] for index in run]
            log.info(
                "calibration: sampling %d windows of %d tokens from the model (seeds %s, %s)",
                sum(size for size, _ in group), seq_len, ", ".join(str(seed) for _, seed in group), path,
            )  # fmt: skip
            for index, sampled in zip(run, sample(group), strict=True):
                entries[index].parent.mkdir(parents=True, exist_ok=True)
                # a temporary per process: the ranks of one torchrun sample alike
                write_file_atomically(entries[index], lambda temporary, data=sampled: torch.save(data, temporary))
                windows[index] = sampled
    return windows


def _runs(indices: list[int], longest: int) -> list[list[int]]:
    """``indices`` (ascending) cut into runs of consecutive ones, each at most ``longest`` long."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1 and len(runs[-1]) < longest:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _read_cached(cache: Path, count: int, seq_len: int) -> torch.Tensor:
    """A cached batch, checked: a damaged entry is named with its fix instead of a traceback, or of calibrating on
    windows of another shape."""
    try:
        windows = torch.load(cache)
        shape = tuple(getattr(windows, "shape", ()))
        reason = f"holds {type(windows).__name__} {shape}, not {count}x{seq_len} token ids"
    except Exception as error:  # noqa: BLE001 - unpickling a damaged file raises anything
        windows, reason = None, " ".join(f"{type(error).__name__}: {error}".split())[:200]
    if isinstance(windows, torch.Tensor) and windows.dtype == torch.long and tuple(windows.shape) == (count, seq_len):
        return windows
    raise EnvironmentFailure(
        f"calibration cache entry {cache} is damaged ({reason}): delete it and run again (its windows are sampled anew)"
    )


def _timed(sampler, model: nn.Module, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    began = time.perf_counter()
    windows = sampler(model, count, seq_len, seed, start)
    tokens = count * (seq_len - 1)
    seconds = time.perf_counter() - began
    log.info("calibration: sampled %d tokens in %.1f s (%.0f tokens/s)", tokens, seconds, tokens / max(seconds, 1e-9))
    return windows


@torch.no_grad()
def _sample(
    model: nn.Module, count: int, seq_len: int, seed: int, start: int, preallocate: bool = True
) -> torch.Tensor:
    """``count`` windows, rows ``[k, k + SAMPLING_BATCH)`` drawn by their own generator seeded ``seed + k``: the
    windows of batches sampled alone, decoded together. ``preallocate``: decode over buffers sized once
    (``compress.model.decode_cache``, the same windows without transformers' per-step copies); False keeps
    transformers' growing cache, the baseline benchmarks time it against."""
    from tqdm.auto import tqdm

    from compress.model.decode_cache import preallocated_cache  # imports transformers: only when sampling

    device = model.get_input_embeddings().weight.device
    generators = [torch.Generator().manual_seed(batch_seed) for _, batch_seed in seeded_batches(count, seed)]
    ids = torch.full((count, 1), start, dtype=torch.long)
    past = preallocated_cache(model.config, seq_len) if preallocate else None
    step_ids = ids
    bar = tqdm(total=count * (seq_len - 1), desc=f"sampling {count} calibration windows", unit="token", leave=False)
    for _ in range(seq_len - 1):
        output = model(input_ids=step_ids.to(device), past_key_values=past, use_cache=True)
        past = output.past_key_values
        probabilities = torch.softmax(output.logits[:, -1].float().cpu(), dim=-1)
        rows = probabilities.split(SAMPLING_BATCH)
        step_ids = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(rows, generators, strict=True)])
        ids = torch.cat([ids, step_ids], dim=1)
        bar.update(count)
    bar.close()
    return ids


@torch.no_grad()
def _sample_engine(model: nn.Module, count: int, seq_len: int, seed: int, start: int) -> torch.Tensor:
    """The engine's continuous batching over the paged KV cache, every window one request at temperature 1 (the
    full softmax, no top-k/top-p), seeded ``seed + row`` so a window does not depend on its batch mates."""
    from tqdm.auto import tqdm

    from compress.engine import LLM, SamplingParams

    block = 16
    blocks = count * -(-seq_len // block)
    engine = LLM(
        model, max_num_seqs=count, max_num_batched_tokens=max(count, 256), max_model_len=seq_len, block_size=block,
        num_kv_blocks=blocks, enable_prefix_caching=False,
    )  # fmt: skip
    requests = [
        engine.add_request(
            [start], SamplingParams(temperature=1.0, max_tokens=seq_len - 1, seed=seed + row, ignore_eos=True)
        )
        for row in range(count)
    ]
    bar = tqdm(total=count * (seq_len - 1), desc=f"sampling {count} calibration windows", unit="token", leave=False)
    while engine.has_unfinished():
        bar.update(len(engine.step()))
    bar.close()
    rows = [[start, *engine.output(request).token_ids] for request in requests]
    del engine
    return torch.tensor(rows, dtype=torch.long)


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
