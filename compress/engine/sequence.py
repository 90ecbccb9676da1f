"""A request as the engine tracks it: its tokens, how many have K/V in the cache, its blocks and its timings."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` switch those off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1:
            raise ValueError(f"invalid {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, max_tokens >= 1")


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    """Lower runs first (as in vLLM); equal priorities are served first come, first served."""
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache; the rest are computed by the next steps."""
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at the last admission."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the full blocks already registered in the prefix cache."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)
    """Wall-clock time each output token was produced."""
    generator: torch.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_time, self.seq_id)
