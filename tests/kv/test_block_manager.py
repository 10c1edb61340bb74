"""Block manager tests: exact block ids, reference counts, hashes and eviction order (block_size 4 throughout)."""

import pytest

from inference_core.kv import block_manager as block_manager_module
from inference_core.kv.block_manager import BlockManager
from inference_core.sequence import Sequence

BLOCK_SIZE = 4


def make_sequence(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence(token_ids=list(token_ids), seq_id=seq_id)


def allocate_and_commit(manager: BlockManager, seq_id: int, token_ids: list[int]) -> Sequence:
    """Allocate a sequence and record its whole prompt as computed, as the engine does after a prefill."""
    sequence = make_sequence(seq_id, token_ids)
    manager.allocate(sequence)
    manager.commit(sequence, len(sequence.token_ids))
    return sequence


def ref_counts(manager: BlockManager) -> list[int]:
    return [block.ref_count for block in manager.blocks]


def cached_flags(manager: BlockManager) -> list[bool]:
    return [block["cached"] for block in manager.snapshot([])["blocks"]]


PROMPT = list(range(100, 109))  # 9 tokens: two full blocks and one token in a third


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4), (4, 2.5), (True, 4)])
def test_rejects_invalid_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockManager(num_blocks, block_size)


def test_fresh_allocation_takes_block_ids_in_order_with_partial_last_block():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_sequence(1, range(10))
    second = make_sequence(2, range(50, 53))
    manager.allocate(first)
    manager.allocate(second)
    assert manager.blocks_needed(10) == 3
    assert first.block_table == [0, 1, 2]
    assert second.block_table == [3]
    assert first.num_cached_tokens == 0
    assert ref_counts(manager) == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert manager.num_free_blocks == 6
    assert manager.num_used_blocks == 4
    assert list(manager.free_queue) == [4, 5, 6, 7, 8, 9]
    # Allocation registers nothing: the KV is not written yet.
    assert manager.hash_to_block_id == {}


def test_commit_registers_hashes_only_for_full_blocks():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    sequence = make_sequence(1, range(10))
    manager.allocate(sequence)
    manager.commit(sequence, 6)
    assert cached_flags(manager) == [True, False, False, False]
    assert [block.num_filled for block in manager.blocks] == [4, 2, 0, 0]
    manager.commit(sequence, 10)
    assert cached_flags(manager) == [True, True, False, False]
    assert [block.num_filled for block in manager.blocks] == [4, 4, 2, 0]
    first_hash = hash((None, (0, 1, 2, 3)))
    second_hash = hash((first_hash, (4, 5, 6, 7)))
    assert manager.hash_to_block_id == {first_hash: 0, second_hash: 1}
    with pytest.raises(ValueError, match="num_computed_tokens=11"):
        manager.commit(sequence, 11)


def test_shared_two_block_prefix_reuses_exact_block_ids():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    second = make_sequence(2, PROMPT[:8] + [7, 7, 7])
    assert manager.can_allocate(second)
    manager.allocate(second)
    assert second.block_table == first.block_table[:2] + [3] == [0, 1, 3]
    assert second.num_cached_tokens == 2 * BLOCK_SIZE
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    assert [sorted(manager.blocks[block_id].owners) for block_id in range(4)] == [[1, 2], [1, 2], [1], [2]]


def test_last_prompt_token_is_never_served_from_cache():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    # Exactly the two cached blocks: the second holds the last token, which must be computed, so only one is reused.
    second = make_sequence(2, PROMPT[:8])
    manager.allocate(second)
    assert second.block_table == first.block_table[:1] + [3] == [0, 3]
    assert second.num_cached_tokens == BLOCK_SIZE
    assert ref_counts(manager)[:4] == [2, 1, 1, 1]


def test_disabled_prefix_cache_never_reuses_or_registers():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_cache=False)
    first = allocate_and_commit(manager, 1, PROMPT)
    second = make_sequence(2, PROMPT)
    manager.allocate(second)
    assert second.block_table == [3, 4, 5]
    assert second.num_cached_tokens == 0
    assert manager.hash_to_block_id == {}
    manager.free(first)
    assert list(manager.evictable) == []
    assert list(manager.free_queue) == [6, 7, 8, 9, 2, 1, 0]


def test_free_releases_in_reverse_order_into_evictable_and_free_queue():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    full_blocks = allocate_and_commit(manager, 1, range(12))
    partial = allocate_and_commit(manager, 2, range(50, 55))
    manager.free(full_blocks)
    manager.free(partial)
    # Chain tails first, so the tail is evicted before the head.
    assert list(manager.evictable) == [2, 1, 0, 3]
    assert list(manager.free_queue) == [5, 4]
    assert manager.num_free_blocks == 6
    assert full_blocks.block_table == [] and full_blocks.num_cached_tokens == 0


def test_eviction_takes_least_recently_freed_first_and_evicted_prefix_no_longer_hits():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    manager.free(first)
    assert list(manager.free_queue) == [3, 2]
    assert list(manager.evictable) == [1, 0]
    unrelated = make_sequence(2, range(500, 512))
    manager.allocate(unrelated)
    # Free queue first, then the LRU evictable block: block 1 (the chain's tail) goes, block 0 stays cached.
    assert unrelated.block_table == [3, 2, 1]
    assert list(manager.evictable) == [0]
    assert manager.blocks[1].block_hash is None
    assert len(manager.hash_to_block_id) == 1
    manager.free(unrelated)
    again = make_sequence(3, PROMPT)
    manager.allocate(again)
    assert again.block_table == [0, 1, 2]
    assert again.num_cached_tokens == BLOCK_SIZE


def test_freed_cached_prefix_is_reused_from_the_evictable_set():
    manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    manager.free(first)
    assert list(manager.evictable) == [1, 0]
    assert list(manager.free_queue) == [3, 4, 5, 6, 7, 8, 9, 2]
    second = make_sequence(2, PROMPT)
    manager.allocate(second)
    assert second.block_table == [0, 1, 3]
    assert second.num_cached_tokens == 8
    assert list(manager.evictable) == []
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]


def test_not_enough_blocks_raises_and_leaves_state_unchanged():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    holder = make_sequence(1, range(8))
    manager.allocate(holder)
    too_long = make_sequence(2, range(50, 59))
    before = manager.snapshot([holder, too_long])
    assert not manager.can_allocate(too_long)
    with pytest.raises(RuntimeError, match="needs 3 free KV blocks but only 1 are free; use a larger KV pool"):
        manager.allocate(too_long)
    assert manager.snapshot([holder, too_long]) == before
    assert too_long.block_table == []


def test_evictable_prefix_hits_count_against_availability():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    manager.free(first)
    holder = make_sequence(2, range(50, 54))
    manager.allocate(holder)
    assert holder.block_table == [2]
    # Two evictable hits plus one fresh block need three free blocks; only two (the evictable ones) are free.
    again = make_sequence(3, PROMPT)
    assert not manager.can_allocate(again)
    with pytest.raises(RuntimeError, match="needs 3 free KV blocks but only 2 are free"):
        manager.allocate(again)


def test_prefix_hits_in_use_by_others_cost_nothing():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    second = make_sequence(2, PROMPT[:8] + [7])
    assert manager.num_free_blocks == 1
    assert manager.can_allocate(second)
    manager.allocate(second)
    assert second.block_table == first.block_table[:2] + [3] == [0, 1, 3]
    assert manager.num_free_blocks == 0


def test_ensure_capacity_adds_a_block_exactly_at_block_boundaries():
    manager = BlockManager(num_blocks=3, block_size=BLOCK_SIZE)
    sequence = make_sequence(1, range(4))
    manager.allocate(sequence)
    table_lengths = []
    for token in range(4, 12):
        sequence.append(token)
        assert manager.can_append(sequence)
        manager.ensure_capacity(sequence)
        table_lengths.append(len(sequence.block_table))
    # Tokens 5..12: a new block when the 5th and the 9th token arrive.
    assert table_lengths == [2, 2, 2, 2, 3, 3, 3, 3]
    assert sequence.block_table == [0, 1, 2]
    sequence.append(12)
    assert not manager.can_append(sequence)
    with pytest.raises(RuntimeError, match="needs 1 more KV blocks but only 0 are free"):
        manager.ensure_capacity(sequence)
    assert sequence.block_table == [0, 1, 2]


def test_rollback_frees_tail_blocks_and_unregisters_a_partially_cut_block():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    sequence = allocate_and_commit(manager, 1, range(14))
    assert cached_flags(manager) == [True, True, True, False, False, False]
    manager.rollback(sequence, 10)
    assert sequence.block_table == [0, 1, 2]
    assert cached_flags(manager) == [True, True, False, False, False, False]
    assert [block.num_filled for block in manager.blocks] == [4, 4, 2, 0, 0, 0]
    assert len(manager.hash_to_block_id) == 2
    assert list(manager.free_queue) == [4, 5, 3]
    assert ref_counts(manager) == [1, 1, 1, 0, 0, 0]
    # Cutting exactly at a block boundary keeps the last kept block's hash: its content is intact.
    manager.rollback(sequence, 8)
    assert sequence.block_table == [0, 1]
    assert cached_flags(manager) == [True, True, False, False, False, False]
    assert list(manager.free_queue) == [4, 5, 3, 2]


def test_rollback_into_a_shared_block_is_refused():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    second = make_sequence(2, PROMPT)
    manager.allocate(second)
    with pytest.raises(RuntimeError, match="block 1 is shared with sequences \\[2\\]"):
        manager.rollback(first, 6)
    assert first.block_table == [0, 1, 2]


def test_double_free_and_empty_free_are_no_ops():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    sequence = make_sequence(1, range(6))
    manager.allocate(sequence)
    manager.free(sequence)
    after_first_free = manager.snapshot([sequence])
    manager.free(sequence)
    manager.free(make_sequence(2, range(3)))
    assert manager.snapshot([sequence]) == after_first_free
    assert ref_counts(manager) == [0, 0, 0, 0]
    assert list(manager.free_queue) == [2, 3, 1, 0]


def test_snapshot_after_every_sequence_is_freed():
    manager = BlockManager(num_blocks=5, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    second = allocate_and_commit(manager, 2, PROMPT[:8] + [7, 7])
    in_use = manager.snapshot([first, second])
    assert in_use["sequences"] == {1: [0, 1, 2], 2: [0, 1, 3]}
    assert [(b["ref_count"], b["owners"], b["state"]) for b in in_use["blocks"]] == [
        (2, [1, 2], "used"), (2, [1, 2], "used"), (1, [1], "used"), (1, [2], "used"), (0, [], "free"),
    ]
    manager.free(first)
    manager.free(second)
    assert manager.num_used_blocks == 0
    assert manager.snapshot([first, second]) == {
        "block_size": 4,
        "num_blocks": 5,
        "sequences": {1: [], 2: []},
        "blocks": [
            {"id": 0, "ref_count": 0, "num_filled": 4, "owners": [], "cached": True, "state": "cached"},
            {"id": 1, "ref_count": 0, "num_filled": 4, "owners": [], "cached": True, "state": "cached"},
            {"id": 2, "ref_count": 0, "num_filled": 0, "owners": [], "cached": False, "state": "free"},
            {"id": 3, "ref_count": 0, "num_filled": 0, "owners": [], "cached": False, "state": "free"},
            {"id": 4, "ref_count": 0, "num_filled": 0, "owners": [], "cached": False, "state": "free"},
        ],
        "free_queue": [4, 2, 3],
        "evictable": [1, 0],
    }


def test_hash_collision_with_different_tokens_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "compute_block_hash", lambda parent_hash, token_ids: 42)
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    allocate_and_commit(manager, 1, PROMPT)
    # Block 1 collides with block 0's registered hash: the first registration wins, block 1 stays unhashed.
    assert manager.hash_to_block_id == {42: 0}
    assert cached_flags(manager) == [True, False, False, False, False, False]
    other = make_sequence(2, [9, 9, 9, 9, 9])
    manager.allocate(other)
    assert other.block_table == [3, 4]
    assert other.num_cached_tokens == 0
    assert ref_counts(manager) == [1, 1, 1, 1, 1, 0]


def test_reset_prefix_cache_moves_evictable_blocks_to_the_free_queue():
    manager = BlockManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = allocate_and_commit(manager, 1, PROMPT)
    manager.free(first)
    manager.reset_prefix_cache()
    assert manager.hash_to_block_id == {}
    assert list(manager.evictable) == []
    assert list(manager.free_queue) == [3, 2, 1, 0]
    again = make_sequence(2, PROMPT)
    manager.allocate(again)
    assert again.block_table == [3, 2, 1]
    assert again.num_cached_tokens == 0


def test_cache_salt_separates_prefix_caches():
    """Block hashes are chained from a root that only the same salt gives: the same tokens under another salt (another
    visitor) never hit, under the same salt they do."""
    manager = BlockManager(num_blocks=8, block_size=4)
    first = Sequence(list(range(9)), cache_salt="visitor-1")
    manager.allocate(first)
    manager.commit(first, 9)
    manager.free(first)
    other, same = Sequence(list(range(9)), cache_salt="visitor-2"), Sequence(list(range(9)), cache_salt="visitor-1")
    manager.allocate(other)
    manager.allocate(same)
    assert (other.num_cached_tokens, same.num_cached_tokens) == (0, 8)

