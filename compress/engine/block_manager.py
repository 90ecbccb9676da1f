"""KV block accounting: a fixed pool, reference counts, prefix caching by content hash, copy-on-write and LRU
eviction. Pure bookkeeping on the host; the model runner owns the memory the block ids point into.

A full block is identified by a hash chained over every token before it, so equal hashes mean equal prefixes: a
request whose prompt starts with a cached prefix (a shared system prompt) reuses those blocks instead of recomputing
them. Blocks nobody references keep their contents and hash until the pool needs them back, oldest first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from compress.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    """Contents of a hashed block, checked on every hit so a hash collision can never serve wrong K/V."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self.hash_to_block: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) for the runner, copy-on-write
        self.prompt_tokens_looked_up = 0
        self.prompt_tokens_hit = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prompt_tokens_hit / self.prompt_tokens_looked_up if self.prompt_tokens_looked_up else 0.0

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached run of ``seq``'s full blocks."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], b""
        for start in range(0, seq.num_tokens - self.block_size + 1, self.block_size):
            tokens = seq.token_ids[start : start + self.block_size]
            parent = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def _plan(self, seq: Sequence) -> tuple[list[int], int, bool]:
        """(cached blocks, tokens they serve, whether the last of them must be copied before it is written)."""
        hits = self._cached_prefix(seq)
        cached = len(hits) * self.block_size
        # The last token is always computed, to get the logits that pick the next token; if it sits in a shared
        # cached block, that block is copied first so the other readers never see the rewrite.
        rewrite_last = cached == seq.num_tokens
        copy_last = rewrite_last and self.blocks[hits[-1]].ref_count > 0
        return hits, cached - rewrite_last, copy_last

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _, copy_last = self._plan(seq)
        revived = sum(1 for block_id in hits if self.blocks[block_id].ref_count == 0)
        needed = blocks_for(seq.num_tokens, self.block_size) - len(hits) + revived + copy_last
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits, cached, copy_last = self._plan(seq)
        for block_id in hits:
            self._reference(block_id)
        seq.block_table = hits + [
            self._take_free_block() for _ in range(blocks_for(seq.num_tokens, self.block_size) - len(hits))
        ]
        seq.block_hashes = [self.blocks[block_id].hash for block_id in hits]
        if copy_last:
            source, destination = hits[-1], self._take_free_block()
            self.pending_copies.append((source, destination))
            self.blocks[source].ref_count -= 1
            seq.block_table[len(hits) - 1] = destination
            seq.block_hashes.pop()
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self.prompt_tokens_looked_up += seq.num_tokens
        self.prompt_tokens_hit += cached

    def can_append(self, seq: Sequence) -> bool:
        return seq.num_tokens <= len(seq.block_table) * self.block_size or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the sequence's newest token, taking a block when the last one is full."""
        if seq.num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            block_hash = chain_hash(seq.block_hashes[-1] if seq.block_hashes else b"", tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block_hash not in self.hash_to_block:  # else an identical block is cached already: keep that one
                block.hash, block.token_ids = block_hash, tuple(tokens)
                self.hash_to_block[block_hash] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; last blocks first, so they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table, seq.block_hashes = [], []

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        else:
            raise RuntimeError("KV block pool exhausted; the scheduler should have preempted first")
        self.blocks[block_id].ref_count = 1
        return block_id

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is exactly one of free, evictable or referenced, with ref counts matching the tables."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        free, evictable = set(self.free_block_ids), set(self.evictable)
        assert len(free) == len(self.free_block_ids) and not free & evictable, "block listed twice"
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], f"block {block.block_id} ref count is off"
            in_pool = block.block_id in free or block.block_id in evictable
            assert in_pool == (block.ref_count == 0), f"block {block.block_id} leaked or double-freed"
            assert (block.block_id in evictable) <= (block.hash is not None), "evictable block without hash"
        for block_hash, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == block_hash, "hash table points at a reused block"
