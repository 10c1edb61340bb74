"""Block manager of the paged KV cache: owns the free list, the reference counts and the prefix-hash map.

The KV pool is `num_blocks` physical blocks of `block_size` token slots each. The manager decides which physical block
holds which part of which sequence; it never touches the KV tensors themselves (pure Python, no torch). Sequences own
their block tables: the manager writes `seq.block_table` and `seq.num_cached_tokens`, and keeps no other per-request
state. A full block whose KV has been written is registered under a hash of its tokens and of every token before it,
so a later request with the same prefix can reuse it. When the last owner frees such a block it becomes *evictable*:
still in the prefix cache, but reclaimed (least recently freed first) once the plain free queue runs dry.

With a sliding window, a sequence's leading blocks that fall wholly out of the window are released early
(`release_before`); their table entries become FREED, so logical block i still holds positions [i * block_size,
(i + 1) * block_size). A released full block stays in the prefix cache like any freed one: its KV is still the right
KV for its prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from inference_core.sequence import Sequence

FREED = -1  # a block-table entry whose block fell out of the sequence's sliding window and went back to the pool


def compute_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block, chained to the hash of the block before it (`root_hash(salt)` for a sequence's first
    block)."""
    return hash((parent_hash, token_ids))


def root_hash(cache_salt: str | None) -> int | None:
    """The parent hash of a sequence's first block: None without a salt, else one that only the same salt gives, so
    block chains of different salts never meet."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Hash under which this block is registered in the prefix cache, or None.
    block_hash: int | None = None
    # The tokens the hash was computed from: a hash hit must match these too, so a collision never reuses wrong KV.
    token_ids: tuple[int, ...] | None = None
    num_filled: int = 0
    owners: set[int] = field(default_factory=set)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # ref_count 0 but still registered; insertion order is LRU order (next to evict first).
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return sum(1 for block in self.blocks if block.ref_count > 0)

    def _find_prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, never covering its last token (which must be computed)."""
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        parent_hash = root_hash(seq.cache_salt)
        num_shareable_blocks = (len(seq.token_ids) - 1) // self.block_size
        for index in range(num_shareable_blocks):
            token_ids = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            parent_hash = compute_block_hash(parent_hash, token_ids)
            block_id = self.hash_to_block_id.get(parent_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def _blocks_to_take(self, seq: Sequence, hits: list[int]) -> int:
        # Evictable hits leave the evictable set, so they cost availability just like fresh blocks.
        num_evictable_hits = sum(1 for block_id in hits if block_id in self.evictable)
        return self.blocks_needed(len(seq.token_ids)) - len(hits) + num_evictable_hits

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_to_take(seq, self._find_prefix_hits(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks {seq.block_table}; free it before allocating")
        if not seq.token_ids:
            raise ValueError(f"sequence {seq.seq_id} has no tokens; a prompt needs at least one token")
        hits = self._find_prefix_hits(seq)
        num_to_take = self._blocks_to_take(seq, hits)
        if num_to_take > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {num_to_take} free KV blocks but only {self.num_free_blocks} are free; "
                f"use a larger KV pool (more blocks) or a shorter prompt"
            )
        # 1. Reuse the cached prefix first, so taking fresh blocks below can never evict it.
        for block_id in hits:
            block = self.blocks[block_id]
            block.ref_count += 1
            block.owners.add(seq.seq_id)
            self.evictable.pop(block_id, None)
        # 2. Fresh blocks for the rest. Their hashes are registered only by commit(), once the KV is written.
        num_fresh = self.blocks_needed(len(seq.token_ids)) - len(hits)
        seq.block_table = hits + [self._take_fresh_block(seq) for _ in range(num_fresh)]
        seq.num_cached_tokens = len(hits) * self.block_size

    def _take_fresh_block(self, seq: Sequence) -> int:
        if self.free_queue:
            block_id = self.free_queue.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            self._unregister(self.blocks[block_id])
        block = self.blocks[block_id]
        block.ref_count = 1
        block.owners = {seq.seq_id}
        block.num_filled = 0
        return block_id

    def _unregister(self, block: Block) -> None:
        if self.hash_to_block_id.get(block.block_hash) == block.block_id:
            del self.hash_to_block_id[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Record that KV for `seq.token_ids[:num_computed_tokens]` is written; register its new full blocks."""
        capacity = len(seq.block_table) * self.block_size
        if not 0 <= num_computed_tokens <= min(len(seq.token_ids), capacity):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must lie in [0, {min(len(seq.token_ids), capacity)}] "
                f"for sequence {seq.seq_id} ({len(seq.token_ids)} tokens, {len(seq.block_table)} blocks)"
            )
        for index in range(self.blocks_needed(num_computed_tokens)):
            if seq.block_table[index] == FREED:
                continue
            block = self.blocks[seq.block_table[index]]
            # max(): a shared block may already be full from another owner's pass.
            num_written = min(self.block_size, num_computed_tokens - index * self.block_size)
            block.num_filled = max(block.num_filled, num_written)
        if not self.enable_prefix_cache:
            return
        parent_hash = root_hash(seq.cache_salt)
        for index in range(num_computed_tokens // self.block_size):
            block = None if seq.block_table[index] == FREED else self.blocks[seq.block_table[index]]
            if block is not None and block.block_hash is not None:
                parent_hash = block.block_hash
                continue
            token_ids = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            parent_hash = compute_block_hash(parent_hash, token_ids)
            if block is None:  # released from the window: only its hash is needed, to chain the blocks after it
                continue
            # Same content computed twice: keep the first registration; this block stays a private copy.
            if parent_hash not in self.hash_to_block_id:
                self.hash_to_block_id[parent_hash] = block.block_id
                block.block_hash = parent_hash
                block.token_ids = token_ids

    def _num_missing_blocks(self, seq: Sequence, num_tokens: int | None = None) -> int:
        num_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        return self._num_missing_blocks(seq) <= self.num_free_blocks

    def ensure_capacity(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow the block table to cover `num_tokens` tokens of `seq` (default: every token; call after appending
        the new token)."""
        num_missing = self._num_missing_blocks(seq, num_tokens)
        if num_missing > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {num_missing} more KV blocks but only {self.num_free_blocks} are free; "
                f"use a larger KV pool (more blocks) or preempt a sequence first"
            )
        for _ in range(num_missing):
            seq.block_table.append(self._take_fresh_block(seq))

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Cut the KV placement of `seq` back to its first `num_tokens` tokens; the caller truncates the tokens."""
        capacity = len(seq.block_table) * self.block_size
        if not 0 <= num_tokens <= capacity:
            raise ValueError(f"num_tokens={num_tokens} must lie in [0, {capacity}] for sequence {seq.seq_id}")
        num_kept_blocks = self.blocks_needed(num_tokens)
        num_in_last_block = num_tokens - (num_kept_blocks - 1) * self.block_size
        last_id = seq.block_table[num_kept_blocks - 1] if num_kept_blocks else FREED
        last_block = None if last_id == FREED else self.blocks[last_id]
        if last_block is not None and num_in_last_block < self.block_size and len(last_block.owners) > 1:
            # The next token would be written into a block other sequences read: their KV would be corrupted.
            raise RuntimeError(
                f"cannot roll sequence {seq.seq_id} back to {num_tokens} tokens: block {last_block.block_id} is shared "
                f"with sequences {sorted(last_block.owners - {seq.seq_id})}; roll back only tokens this sequence wrote"
            )
        self._release(seq.seq_id, seq.block_table[num_kept_blocks:])
        del seq.block_table[num_kept_blocks:]
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)
        if last_block is not None and num_in_last_block < self.block_size:
            # The block's content no longer matches its hash: no other request may hit it.
            if last_block.block_hash is not None:
                self._unregister(last_block)
            last_block.num_filled = min(last_block.num_filled, num_in_last_block)

    def release_before(self, seq: Sequence, position: int, keep: int = 0) -> None:
        """Sliding window: give back `seq`'s blocks that lie wholly before token `position` (no query will read
        them again) but for those holding any of its first `keep` tokens (attention sinks); their entries become
        FREED."""
        table = seq.block_table
        for index in range(self.blocks_needed(keep), min(max(position, 0) // self.block_size, len(table))):
            if table[index] != FREED:
                self._release(seq.seq_id, [table[index]])
                table[index] = FREED

    def _release(self, seq_id: int, block_ids: list[int]) -> None:
        # Reverse order: a chain's tail enters the LRU before its head, so it is evicted first.
        for block_id in reversed(block_ids):
            if block_id == FREED:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            block.owners.discard(seq_id)
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self.evictable[block_id] = None
            else:
                block.num_filled = 0
                self.free_queue.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; freeing twice or freeing an empty table does nothing."""
        self._release(seq.seq_id, seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; evictable blocks become plain free blocks."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.hash_to_block_id.clear()
        for block_id in self.evictable:
            self.blocks[block_id].num_filled = 0
            self.free_queue.append(block_id)
        self.evictable.clear()

    def snapshot(self, seqs: list[Sequence]) -> dict:
        """Plain Python picture of the pool, for a UI that draws it."""

        def state(block: Block) -> str:
            if block.ref_count > 0:
                return "used"
            return "cached" if block.block_id in self.evictable else "free"

        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "sequences": {seq.seq_id: list(seq.block_table) for seq in seqs},
            "blocks": [
                {
                    "id": block.block_id,
                    "ref_count": block.ref_count,
                    "num_filled": block.num_filled,
                    "owners": sorted(block.owners),
                    "cached": block.block_hash is not None,
                    "state": state(block),
                }
                for block in self.blocks
            ],
            "free_queue": list(self.free_queue),
            "evictable": list(self.evictable),
        }
