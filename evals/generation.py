"""Greedy generation for the gate's generation layers, behind a small ``Generator`` protocol.

Two backends: the compress engine (``compress.engine.LLM``) when it is installed, otherwise a plain greedy loop
over the transformers model's forward with a KV cache. gate.json records which one ran. Both run the candidate with
its checkpoint's KV-cache dtype, every key and value rounded exactly once, as the engine stores it: with the
checkpoint's calibrated scales when it has them (the loaded model's attention applies them,
``compress.grids.kv_quant``), else per token and KV head as it enters the cache (the engine's scheme when it has no
calibrated scale). KV quantization is what hurts long-context retrieval first, so the needle layer must see it.
"""

from __future__ import annotations

import importlib
import time
from contextlib import nullcontext
from typing import Protocol

import torch

from compress.base.errors import CompressError
from compress.grids.kv_quant import (
    calibrated_kv_cache_dtype,
    calibrated_kv_unused,
    fake_quantize_kv,
    resolve_kv_cache_dtype,
)
from compress.kernels.dtypes import KV_CACHE_DTYPES


class TokenConstraint(Protocol):
    """Restricts which token may come next (e.g. only tokens that keep the output valid JSON)."""

    def allowed(self, tokens_left: int) -> torch.Tensor:
        """Boolean mask over the vocabulary; ``tokens_left`` counts this token too."""
        ...

    def advance(self, token_id: int) -> None: ...


class Generator(Protocol):
    backend: str
    kv_cache_dtype: str
    """The KV-cache dtype it runs, ``auto`` resolved (``compress.grids.kv_quant.resolve_kv_cache_dtype``)."""

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, constraint: TokenConstraint | None = None
    ) -> list[int]:
        """Greedy continuation of ``prompt_ids``, stopping at end-of-sequence."""
        ...

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        """Greedy continuations of many prompts, in prompt order: the engine schedules them together (on the
        2-core CPU, 12 prompts of 512 tokens batched take 0.75x the time of one after another:
        benchmarks/results/gate-generation-cpu.md)."""
        ...

    def time_generation(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
        """``(time to first token, mean time per later token)`` in seconds for exactly ``new_tokens`` tokens."""
        ...


def _quantized_cache_class():
    from transformers import DynamicCache

    class QuantizedKVCache(DynamicCache):
        """A DynamicCache whose stored keys and values went through the checkpoint's KV-cache dtype."""

        def __init__(self, config, kv_dtype: torch.dtype):
            super().__init__(config=config)
            self.kv_dtype = kv_dtype

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            key_states = fake_quantize_kv(key_states, self.kv_dtype)
            value_states = fake_quantize_kv(value_states, self.kv_dtype)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return QuantizedKVCache


class TransformersGenerator:
    """Greedy decoding with the model's own forward pass; one sequence at a time, so timings are per request."""

    backend = "transformers"

    def __init__(self, model: torch.nn.Module, tokenizer, kv_cache_dtype: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        model_dtype = model.get_input_embeddings().weight.dtype
        calibrated = calibrated_kv_cache_dtype(model)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype, calibrated)
        storage = KV_CACHE_DTYPES[self.kv_cache_dtype]
        # The calibrated dtype: the model's attention (compress.grids.kv_quant) rounds each key and value it attends to
        # with the scales, from the values as computed, so the cache keeps them unrounded; rounding on the way in
        # too would round every value twice. Any other dtype leaves the scales unused and rounds on the way in.
        self.uses_calibrated_scales = calibrated is not None and self.kv_cache_dtype == calibrated
        self.cache_rounding = None if self.uses_calibrated_scales or storage == model_dtype else storage
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.device = next(model.parameters()).device

    def _new_cache(self):
        from transformers import DynamicCache

        if self.cache_rounding is None:
            return DynamicCache(config=self.model.config)
        return _quantized_cache_class()(self.model.config, self.cache_rounding)

    def _decode(self, prompt_ids, max_new_tokens, constraint=None, stop_at_eos=True, clock=None) -> list[int]:
        scales_off = nullcontext() if self.uses_calibrated_scales else calibrated_kv_unused(self.model)
        with torch.no_grad(), scales_off:
            return self._greedy(prompt_ids, max_new_tokens, constraint, stop_at_eos, clock)

    def _greedy(self, prompt_ids, max_new_tokens, constraint, stop_at_eos, clock) -> list[int]:
        cache = self._new_cache()
        input_ids = torch.tensor([prompt_ids], device=self.device)
        generated: list[int] = []
        for step in range(max_new_tokens):
            logits = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            logits = logits[0, -1].float()
            if constraint is not None:
                mask = constraint.allowed(max_new_tokens - step).to(logits.device)
                logits[: mask.numel()].masked_fill_(~mask, float("-inf"))
                logits[mask.numel() :] = float("-inf")
            token = int(logits.argmax())
            if clock is not None:
                clock.append(time.perf_counter())
            generated.append(token)
            if constraint is not None:
                constraint.advance(token)
            if stop_at_eos and token in self.eos_ids:
                break
            input_ids = torch.tensor([[token]], device=self.device)
        return generated

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        return self._decode(prompt_ids, max_new_tokens, constraint)

    def generate_batch(self, prompts, max_new_tokens):
        return [self.generate(prompt, tokens) for prompt, tokens in zip(prompts, max_new_tokens, strict=True)]

    def time_generation(self, prompt_ids, new_tokens):
        if new_tokens < 2:
            raise CompressError("gate.latency.new_tokens must be ≥ 2 to measure time per output token")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        clock = [time.perf_counter()]
        self._decode(prompt_ids, new_tokens, stop_at_eos=False, clock=clock)
        ttft = clock[1] - clock[0]
        tpot = (clock[-1] - clock[1]) / (len(clock) - 2)
        return ttft, tpot


class EngineGenerator:
    """The compress engine (paged KV cache in the checkpoint's KV dtype, our kernels) behind the same protocol.

    Constrained decoding needs per-step logits, which the engine does not expose; the JSON layer's constrained mode
    therefore always runs on the transformers backend.
    """

    backend = "engine"

    def __init__(self, model, tokenizer, kv_cache_dtype: str | None, engine_options: dict):
        from compress.engine import LLM, SamplingParams

        self.sampling_params = SamplingParams
        self.llm = LLM(model, tokenizer, **{**engine_options, "kv_cache_dtype": kv_cache_dtype or "auto"})
        self.kv_cache_dtype = self.llm.config.kv_cache_dtype

    def _run(self, prompt_ids, max_new_tokens, ignore_eos=False):
        params = self.sampling_params(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos)
        (output,) = self.llm.generate([list(prompt_ids)], params)
        return output

    def generate(self, prompt_ids, max_new_tokens, constraint=None):
        if constraint is not None:
            raise CompressError("the engine backend cannot constrain decoding; the gate uses transformers for that")
        return list(self._run(prompt_ids, max_new_tokens).token_ids)

    def generate_batch(self, prompts, max_new_tokens):
        params = [self.sampling_params(temperature=0.0, max_tokens=tokens) for tokens in max_new_tokens]
        return [list(output.token_ids) for output in self.llm.generate([list(p) for p in prompts], params)]

    def time_generation(self, prompt_ids, new_tokens):
        if new_tokens < 2:
            raise CompressError("gate.latency.new_tokens must be ≥ 2 to measure time per output token")
        output = self._run(prompt_ids, new_tokens, ignore_eos=True)
        times = output.token_times
        return times[0] - output.arrival_time, (times[-1] - times[0]) / (len(times) - 1)


def engine_available() -> bool:
    try:
        return hasattr(importlib.import_module("compress.engine"), "LLM")
    except ModuleNotFoundError:
        return False


def choose_backend(requested: str) -> str:
    """``auto`` means the engine when it is installed, else transformers."""
    if requested not in {"auto", "engine", "transformers"}:
        raise CompressError(f"gate.backend={requested!r} is unknown; use auto, engine or transformers")
    if requested == "auto":
        return "engine" if engine_available() else "transformers"
    if requested == "engine" and not engine_available():
        raise CompressError("gate.backend=engine, but compress.engine is not installed; use gate.backend=transformers")
    return requested


def make_generator(backend: str, model, tokenizer, kv_cache_dtype: str | None, engine_options: dict) -> Generator:
    if backend == "engine":
        return EngineGenerator(model, tokenizer, kv_cache_dtype, engine_options)
    return TransformersGenerator(model, tokenizer, kv_cache_dtype)
