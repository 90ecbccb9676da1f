"""Block accounting under random arrivals, chunked prefills, finishes and preemptions (a seeded random loop in
place of a property-testing library): no block is ever leaked, double-freed or miscounted."""

import random

import pytest

from compress.engine.block_manager import BlockManager
from compress.engine.engine_config import EngineConfig
from compress.engine.scheduler import Scheduler
from compress.engine.sequence import SamplingParams, Sequence, SequenceStatus

BLOCK_SIZE = 4


def random_prompt(rng: random.Random, prefixes: list[list[int]], longest: int) -> list[int]:
    """Often a shared prefix plus a tail, so prefix-cache hits (and block-aligned full hits) happen."""
    prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
    tail = [rng.randrange(50) for _ in range(rng.randint(0 if prefix else 1, 10))]
    return (prefix + tail)[:longest]


def run_trial(rng: random.Random) -> tuple[int, int]:
    num_blocks = rng.randint(6, 24)
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(2, 24),
        num_kv_blocks=num_blocks,
    )
    manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=rng.random() < 0.8)
    scheduler = Scheduler(config, manager)
    capacity = num_blocks * BLOCK_SIZE
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    live: list[Sequence] = []
    for step in range(3000):
        if step >= 100 and not scheduler.has_unfinished():
            break
        if step < 100 and rng.random() < 0.3:
            max_tokens = rng.randint(1, 8)
            prompt = random_prompt(rng, prefixes, capacity - max_tokens)
            seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), float(step), priority=rng.randint(0, 2))
            scheduler.add(seq)
            live.append(seq)
        batch = scheduler.schedule()
        for source, destination in batch.block_copies:
            assert manager.blocks[source].ref_count >= 1 and manager.blocks[destination].ref_count == 1
        for seq in scheduler.update(batch):
            seq.token_ids.append(rng.randrange(50))
            if len(seq.output_token_ids) >= seq.params.max_tokens or rng.random() < 0.05:
                scheduler.finish(seq, "length")
        if scheduler.running and rng.random() < 0.05:
            scheduler.preempt(rng.choice(scheduler.running))
        manager.check_invariants(scheduler.running)
        assert all(not seq.block_table for seq in scheduler.waiting)
        assert len(scheduler.running) <= config.max_num_seqs
    assert not scheduler.has_unfinished(), "the engine stopped making progress"
    assert all(seq.status is SequenceStatus.FINISHED for seq in live)
    manager.check_invariants([])
    assert manager.num_free_blocks == num_blocks
    return manager.prompt_tokens_hit, scheduler.num_preemptions


def test_block_accounting_never_leaks():
    rng = random.Random(1234)
    results = [run_trial(rng) for _ in range(60)]
    assert sum(hits for hits, _ in results) > 0  # the loop did exercise the prefix cache ...
    assert sum(preempted for _, preempted in results) > 0  # ... and preemption


def test_eviction_takes_least_recently_freed_blocks_first():
    manager = BlockManager(4, BLOCK_SIZE)
    first = Sequence(list(range(8)), SamplingParams(), 0.0)
    second = Sequence(list(range(10, 18)), SamplingParams(), 1.0)
    tables = []
    for seq in (first, second):
        manager.allocate(seq)
        seq.num_computed_tokens = 8
        manager.commit(seq)
        tables.append(list(seq.block_table))
    manager.free(first)
    manager.free(second)
    # Freed last block first, so a prefix outlives its continuation.
    assert list(manager.evictable) == [tables[0][1], tables[0][0], tables[1][1], tables[1][0]]
    newcomer = Sequence(list(range(20, 24)), SamplingParams(), 2.0)
    manager.allocate(newcomer)
    assert newcomer.block_table == [tables[0][1]]
    again = Sequence(list(range(10, 18)), SamplingParams(), 3.0)
    manager.allocate(again)
    assert again.block_table == tables[1] and again.num_cached_tokens == 7
    manager.check_invariants([newcomer, again])


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_caching_switch(enable):
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=enable)
    seq = Sequence(list(range(9)), SamplingParams(), 0.0)
    manager.allocate(seq)
    seq.num_computed_tokens = 9
    manager.commit(seq)
    manager.free(seq)
    twin = Sequence(list(range(9)), SamplingParams(), 1.0)
    manager.allocate(twin)
    assert twin.num_cached_tokens == (8 if enable else 0)
