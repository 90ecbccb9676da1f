"""The engine's front door: ``LLM(model).generate(prompts, params)``, a streaming iterator, and the step loop.

One step = schedule (which sequences, how many tokens) -> run the model on the packed batch -> sample -> update.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compress.checkpoint import load_checkpoint
from compress.engine.block_manager import BlockManager, blocks_for
from compress.engine.engine_config import EngineConfig
from compress.engine.model_runner import ModelRunner
from compress.engine.sampler import sample
from compress.engine.scheduler import ScheduledBatch, Scheduler
from compress.engine.sequence import SamplingParams, Sequence
from compress.grids.kv_quant import calibrated_kv_cache_dtype, resolve_kv_cache_dtype

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    arrival_time: float
    token_times: list[float]
    num_cached_tokens: int
    num_preemptions: int


@dataclass
class StreamEvent:
    request_id: int
    token_id: int
    text: str | None
    """New text since the previous event of this request (None without a tokenizer)."""
    finished: bool


class LLM:
    def __init__(self, model: nn.Module | str | Path, tokenizer=None, **engine_options):
        if isinstance(model, str | Path):
            model, loaded_tokenizer = load_checkpoint(model)
            tokenizer = tokenizer or loaded_tokenizer
        self.config = EngineConfig(**engine_options)
        self.config.kv_cache_dtype = resolve_kv_cache_dtype(
            self.config.kv_cache_dtype, model.get_input_embeddings().weight.dtype, calibrated_kv_cache_dtype(model)
        )
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, self.config)
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.eos_token_ids = _eos_token_ids(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.requests: dict[int, Sequence] = {}

    # --- requests and steps ---------------------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0, arrival_time: float | None = None
    ) -> int:
        params = params or SamplingParams()
        return self._enqueue(self._checked_token_ids(prompt, params), params, priority, arrival_time)

    def abort_request(self, request_id: int) -> None:
        """Stop a request now and free its blocks (``finish_reason="abort"``); a finished one is left as it is."""
        self.scheduler.finish(self.requests[request_id], "abort")

    def _checked_token_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ValueError saying why the engine cannot run it; nothing is queued here, so
        a whole batch is checked before any of it is added."""
        token_ids = self._encode(prompt)
        if not token_ids:
            raise ValueError("empty prompt: give at least one token")
        total = len(token_ids) + params.max_tokens
        if total > self.runner.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.runner.max_model_len}; shorten one or raise max_model_len"
            )
        if blocks_for(total, self.config.block_size) > self.block_manager.num_blocks:
            raise ValueError(
                f"the KV pool ({self.block_manager.num_blocks} blocks) cannot hold one request of "
                f"{total} tokens; enlarge the pool (kv_cache_memory_gb / num_kv_blocks)"
            )
        return token_ids

    def _enqueue(
        self, token_ids: list[int], params: SamplingParams, priority: int = 0, arrival_time: float | None = None
    ) -> int:
        seq = Sequence(token_ids, params, time.perf_counter() if arrival_time is None else arrival_time, priority)
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[tuple[Sequence, int]]:
        """Run one iteration; returns ``(sequence, new token)`` for every sequence that produced one. A step that
        raises finishes the requests it ran with ``finish_reason="error"`` before the error propagates, so none of
        them stays scheduled to fail again in every later step."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        try:
            logits = self.runner.execute(batch)
            sampled = self.scheduler.update(batch)
            tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        except BaseException:
            for seq in batch.seqs:
                self.scheduler.finish(seq, "error")
            raise
        now = time.perf_counter()
        produced = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.token_ids.append(token)
            seq.token_times.append(now)
            produced.append((seq, token))
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
        return produced

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.runner.max_model_len:
            return "length"
        return None

    # --- user-facing loops ----------------------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        ids = self._add_all(prompts, params)
        with self._owned(ids):
            while self.has_unfinished():
                self.step()
            return [self.output(i) for i in ids]

    def stream(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[StreamEvent]:
        """Yield every token as it is produced, with the text it adds."""
        ids = set(self._add_all(prompts, params))
        emitted = {i: "" for i in ids}
        with self._owned(ids):
            while self.has_unfinished():
                for seq, token in self.step():
                    if seq.seq_id not in ids:
                        continue
                    text = None
                    if self.tokenizer is not None:
                        full = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                        text, emitted[seq.seq_id] = full[len(emitted[seq.seq_id]) :], full
                    yield StreamEvent(seq.seq_id, token, text, seq.finish_reason is not None)

    @contextmanager
    def _owned(self, request_ids: Iterable[int]) -> Iterator[None]:
        """The requests of one ``generate``/``stream`` call: however the call ends (a step that raised, a stream
        closed early), the unfinished ones are aborted and all are forgotten, so the next call starts clean."""
        try:
            yield
        finally:
            for request_id in request_ids:
                self.abort_request(request_id)
                del self.requests[request_id]

    def output(self, request_id: int) -> RequestOutput:
        seq = self.requests[request_id]
        text = None if self.tokenizer is None else self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            seq.seq_id,
            seq.prompt_token_ids,
            seq.output_token_ids,
            text,
            seq.finish_reason,
            seq.arrival_time,
            seq.token_times,
            seq.num_cached_tokens,
            seq.num_preemptions,
        )

    @torch.inference_mode()
    def perplexity(self, prompt: Prompt) -> float:
        """Perplexity of a text under the engine itself: chunked prefill through the (possibly quantized) KV
        cache, scoring every next token. Needs an idle engine."""
        if self.has_unfinished():
            raise RuntimeError("perplexity() needs an idle engine; finish the running requests first")
        token_ids = self._encode(prompt)
        seq = Sequence(token_ids, SamplingParams(max_tokens=1), time.perf_counter())
        if not self.block_manager.can_allocate(seq):
            raise ValueError(f"{len(token_ids)} tokens do not fit in the KV pool")
        self.block_manager.allocate(seq)
        seq.num_computed_tokens = 0  # score every token, even cached ones
        nll, chunk = 0.0, self.config.max_num_batched_tokens
        try:
            while seq.num_computed_tokens < seq.num_tokens - 1:
                size = min(chunk, seq.num_tokens - 1 - seq.num_computed_tokens)
                logits = self.runner.execute(
                    ScheduledBatch([seq], [size], self.block_manager.take_pending_copies()), True
                )
                start = seq.num_computed_tokens
                targets = torch.tensor(token_ids[start + 1 : start + size + 1], device=logits.device)
                nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                seq.num_computed_tokens += size
        finally:
            self.block_manager.free(seq)
        return math.exp(nll / (len(token_ids) - 1))

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        checked = []
        for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            prompt_params = prompt_params or SamplingParams()
            try:
                checked.append((self._checked_token_ids(prompt, prompt_params), prompt_params))
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        return [self._enqueue(token_ids, prompt_params) for token_ids, prompt_params in checked]

    def _encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, each checked to be a row of the embedding (an out-of-range id would fail deep in
        the forward pass, or fault the GPU)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt without a tokenizer: pass token ids or LLM(model, tokenizer)")
            token_ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            try:
                token_ids = [operator.index(token) for token in prompt]
            except TypeError:
                raise ValueError(f"a prompt is a text or a list of integer token ids, not {prompt!r:.80}") from None
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary of {self.vocab_size} (ids 0 to "
                f"{self.vocab_size - 1}); encode prompts with this model's tokenizer"
            )
        return token_ids


def _eos_token_ids(model: nn.Module) -> set[int]:
    ids = set()
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids
