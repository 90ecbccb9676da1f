"""Iteration-level scheduling: every step picks which sequences run and how many tokens each brings.

Budget per step: ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences. Running decodes go first (one
token each), then running prefills continue in chunks, then waiting requests are admitted in (priority, arrival)
order while blocks last, their prompts chunked to fill the remaining budget. When a decode needs a block and the pool
is empty, the lowest-priority latest-arrived running sequence is preempted: its blocks are freed and it goes back to
the queue, to be recomputed (often from the prefix cache) when there is room again.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from compress.engine.block_manager import BlockManager
from compress.engine.engine_config import EngineConfig
from compress.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key; the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):  # decodes
            if seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            if budget == 0:
                break
            if self._make_room(seq):
                self.block_manager.append_slot(seq)
                batch.add(seq, 1)
                budget -= 1
        for seq in self.running:  # prefills in progress
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and budget > 0:
                batch.add(seq, min(remaining, budget))
                budget -= batch.num_new_tokens[-1]
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break  # strict order: a large request is not starved by smaller ones behind it
            self.waiting.pop(0)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            batch.add(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            budget -= batch.num_new_tokens[-1]
        batch.block_copies = self.block_manager.take_pending_copies()
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt from the back of the running list until ``seq`` can grow; False if ``seq`` itself went."""
        while not self.block_manager.can_append(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free everything and requeue: the sequence's tokens so far are recomputed when it is readmitted."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a waiting or running sequence out of the schedule for good and give its blocks back."""
        if seq.status is SequenceStatus.FINISHED:
            return
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def update(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed counts after a step; returns the sequences whose next token was just sampled."""
        sampled = []
        for seq, num_tokens in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_tokens
            self.block_manager.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        return sampled
