"""KV cache storage: where the keys and values of past tokens live between forward passes.

Every KV mode is an object with the same small protocol (`KVCache`), so neither the runner, the model nor the
scheduler asks which mode it has:

- placement (the scheduler's side): `can_allocate` / `allocate` a sequence's room, `can_append` / `ensure_capacity`
  as it grows, `commit` what a forward wrote, `rollback` rejected speculative tokens, `free` at the end, `usage`;
- tensors (the model's side): `prepare` a forward batch's index tensors, `store` this step's k/v, `load` one
  sequence's whole context (prefill chunks) and `load_decodes` the padded contexts of all single-token decodes at
  once ([decodes, kv_heads, longest context, head_dim], masked by length).

The modes:
- `RecomputeKVCache` (mode `none`): stores nothing; every step forwards each sequence's whole text, and attention
  reads this step's own k/v. `commit` leaves `num_computed_tokens` at 0, which is what makes the runner recompute.
- `ContiguousKVCache`: `num_slots` preallocated buffers of `max_seq_len` positions, one per running sequence,
  written in place (never grown by concatenation). Reading one context is a view, no copy.
- `PagedKVCache`: one pool of fixed-size blocks shared by all sequences. A sequence's block table (kept by the
  `BlockManager`) maps its logical blocks to physical ones; reads gather the blocks through the batch's padded
  int32 block tables. Memory is held per block actually used, and full blocks with the same token prefix (and the
  same cache salt) are shared across requests (prefix caching).

Three storage options apply to both caching modes:
- `kv_dtype="int8"`: each token's k (and v) of each KV head is stored as head_dim int8 values followed by its fp32
  scale (max |x| / 127) in 4 more int8 bytes, so a [..., head_dim] tensor becomes an int8 [..., head_dim + 4] one
  and every write and read path indexes it exactly as before; `store` quantizes, the reads dequantize to the model
  dtype. It saves memory (SmolLM2: 68 bytes per token and head against 128 in bf16 and 256 in fp32), not time: on
  a CPU the dequantization costs about what the smaller read saves.
- `kv_dtype="int4"` (`kv.int4`): KIVI's 4 bits, keys per channel over a block of tokens and values per token in
  groups, each sequence's newest block kept in the model dtype until it fills; the pool is an `Int4Blocks`, which
  the paged cache indexes by physical block and the contiguous cache by the fixed blocks of its slots.
- a sliding window (`sliding_window`, tokens each token attends to, itself included): the runner's masks hide what
  lies before it, and the paged cache gives back the blocks that fall wholly out of it (`BlockManager.release_before`),
  so a long generation holds a constant number of blocks. With `attention_sinks` S (StreamingLLM), every token also
  attends to its sequence's first S tokens, at the positions they were computed at, and the blocks holding them stay.

The paged cache reads in one of two ways (`attention`): "gather" (`load` / `load_decodes`, a contiguous copy that SDPA
reads, the reference) or "flex": `prepare` builds FlexAttention block masks from the block tables (`kv.flex`) and
`attend` runs attention over the pool itself, with no copy.
"""

from __future__ import annotations

from typing import Protocol

import torch

from inference_core.config import ModelConfig
from inference_core.kv import flex
from inference_core.kv.block_manager import FREED, BlockManager
from inference_core.kv.int4 import FREE, FULL, PARTIAL, Int4Blocks
from inference_core.sequence import Sequence


class KVCache(Protocol):
    kv_mode: str
    bytes_per_token: int
    sliding_window: int | None

    def can_allocate(self, seq: Sequence) -> bool: ...
    def allocate(self, seq: Sequence) -> None: ...
    def can_append(self, seq: Sequence, num_tokens: int) -> bool: ...
    def ensure_capacity(self, seq: Sequence, num_tokens: int | None = None) -> None: ...
    def commit(self, seq: Sequence, num_computed_tokens: int) -> None: ...
    def rollback(self, seq: Sequence, num_tokens: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def usage(self, seq: Sequence) -> tuple[int, int]: ...
    def blocks_in_use(self) -> int: ...
    def prepare(self, seqs: list[Sequence], batch) -> None: ...
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None: ...
    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def load_decodes(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]: ...
    def load_chunks(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]: ...


SCALE_BYTES = 4  # an int8 row's fp32 scale, stored as 4 int8 bytes after the head_dim values
INT4_BLOCK = 16  # tokens of a contiguous slot's int4 block (a key channel's scale spans them)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> int8 [..., head_dim + 4]: round(x / scale) and the fp32 scale max|x| / 127."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127  # [..., 1]
    values = torch.round(x.float() / scale).to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), -1)


def dequantize_int8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim + 4] -> [..., head_dim] in `dtype`."""
    return (x[..., :-SCALE_BYTES].float() * x[..., -SCALE_BYTES:].view(torch.float32)).to(dtype)


class _Storage:
    """What the contiguous and paged caches share: the element layout (model dtype, or int8 with a scale; int4 is
    held apart, in `self.int4`) and the sliding window."""

    int4: Int4Blocks | None = None

    def _init_storage(self, config: ModelConfig, dtype, kv_dtype: str, sliding_window: int | None,
                      block_size: int = 16, sinks: int = 0):
        self.dtype, self.kv_dtype, self.sliding_window, self.attention_sinks = dtype, kv_dtype, sliding_window, sinks
        self.bytes_per_token = config.kv_bytes_per_token(dtype, kv_dtype, block_size)
        if kv_dtype == "int8":
            return torch.int8, config.head_dim + SCALE_BYTES  # storage dtype, last dimension
        return dtype, config.head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_int8(x) if self.kv_dtype == "int8" else x

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(x, self.dtype) if self.kv_dtype == "int8" else x

    def settle(self) -> None:
        """int4, before a forward: the tail blocks whose blocks have filled are quantized, those of freed blocks
        dropped (`Int4Blocks.sweep`). `prepare` does it for an eager forward; the compiled steps call it."""
        if self.int4 is not None:
            self.int4.sweep(self._block_state)


class RecomputeKVCache:
    """Mode `none`: no memory between steps. Attention reads the k/v this very forward computed."""

    kv_mode = "none"
    bytes_per_token = 0
    kv_dtype = "auto"
    int4 = None

    def __init__(self, sliding_window: int | None = None, sinks: int = 0):
        self.sliding_window, self.attention_sinks = sliding_window, sinks
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def can_allocate(self, seq: Sequence) -> bool:
        return True

    def allocate(self, seq: Sequence) -> None:
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return True

    def ensure_capacity(self, seq: Sequence, num_tokens: int | None = None) -> None:
        pass

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        seq.num_computed_tokens = 0  # nothing kept: the next step forwards the whole text again

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def copy_token(self, seq: Sequence, source: int, target: int) -> None:
        pass  # nothing kept to move

    def free(self, seq: Sequence) -> None:
        pass

    def usage(self, seq: Sequence) -> tuple[int, int]:
        return 0, 0

    def blocks_in_use(self) -> int:
        return 0

    def prepare(self, seqs: list[Sequence], batch) -> None:
        pass

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        self._k, self._v = k, v  # [tokens, kv_heads, head_dim]; read back by load() in the same layer

    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = batch.query_ranges[index]
        return self._k[start:end].transpose(0, 1), self._v[start:end].transpose(0, 1)

    def load_decodes(self, layer: int, batch):
        raise AssertionError("mode none has no cached decodes: every sequence is forwarded whole")

    def load_chunks(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[chunks, kv_heads, longest, head_dim]: each batched sequence's own k/v (its keys are its queries)."""
        chunks = batch.chunks
        shape = (chunks.count, chunks.longest) + self._k.shape[1:]
        return (self._k.index_select(0, chunks.query_index).view(shape).transpose(1, 2),
                self._v.index_select(0, chunks.query_index).view(shape).transpose(1, 2))


class ContiguousKVCache(_Storage):
    kv_mode = "contiguous"

    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int, dtype, device, kv_dtype: str = "auto",
                 sliding_window: int | None = None, sinks: int = 0):
        self.max_seq_len = max_seq_len
        storage, last = self._init_storage(config, dtype, kv_dtype, sliding_window, INT4_BLOCK, sinks)
        if kv_dtype == "int4":
            # Each slot is a row of fixed blocks: slot s's positions [i * INT4_BLOCK, (i + 1) * INT4_BLOCK) are block
            # s * blocks_per_slot + i of the int4 pool.
            self.blocks_per_slot = -(-max_seq_len // INT4_BLOCK)
            self.int4 = Int4Blocks(config, num_slots * self.blocks_per_slot, INT4_BLOCK, dtype, device)
            self.slot_tokens = [-1] * num_slots  # tokens each slot's sequence has committed; -1: a free slot
            self.k = self.v = None
        else:
            shape = (config.num_layers, num_slots, config.num_kv_heads, max_seq_len, last)
            # k, v: [layers, slots, kv_heads, max_seq_len, head_dim]; head-major so one slot's context is a plain
            # view. torch.empty: pages of slots never used are never touched, so they take no resident memory. A
            # slot is zeroed on its first use (see `allocate`).
            self.k = torch.empty(shape, dtype=storage, device=device)
            self.v = torch.empty(shape, dtype=storage, device=device)
            self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # views, so a step indexes less
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots))
        self.zeroed_slots: set[int] = set()
        self.device = device

    def can_allocate(self, seq: Sequence) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        if not self.free_slots:
            raise RuntimeError("all contiguous KV slots are in use; finish or cancel a running request first.")
        seq.cache_slot = self.free_slots.pop(0)
        seq.num_computed_tokens = 0
        if self.int4 is not None:
            self.int4.sweep(self._block_state)  # the slot's blocks from its last sequence leave the tail
            self.slot_tokens[seq.cache_slot] = 0
        elif seq.cache_slot not in self.zeroed_slots:
            # Batched decodes read every slot up to the longest context and mask the rest; masked positions must
            # hold finite numbers (never-written memory can hold NaN, and 0 x NaN is NaN in the attention sum).
            self.k[:, seq.cache_slot].zero_()
            self.v[:, seq.cache_slot].zero_()
            self.zeroed_slots.add(seq.cache_slot)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_len

    def ensure_capacity(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """The slot was sized for max_seq_len up front; the engine never lets a sequence grow past that."""

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        seq.num_computed_tokens = num_computed_tokens
        if self.int4 is not None:
            self.slot_tokens[seq.cache_slot] = num_computed_tokens

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens only (later positions are simply overwritten next time)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        if self.int4 is not None:
            self.slot_tokens[seq.cache_slot] = seq.num_computed_tokens

    def _block_state(self, block: int) -> str:
        """int4: whether a slot's fixed block is wholly committed, partly, or its slot free."""
        slot, index = divmod(block, self.blocks_per_slot)
        tokens = self.slot_tokens[slot]
        if tokens < 0:
            return FREE
        return FULL if (index + 1) * INT4_BLOCK <= tokens else PARTIAL

    def _int4_block(self, slot: int, position: int) -> tuple[int, int]:
        """(int4 block, offset) of a slot's position."""
        return slot * self.blocks_per_slot + position // INT4_BLOCK, position % INT4_BLOCK

    def copy_token(self, seq: Sequence, source: int, target: int) -> None:
        """Every layer's KV at slot position `source` written to `target` too (a tree's accepted leaf moving next to
        its parent)."""
        if self.int4 is not None:
            self.int4.copy_token(self._int4_block(seq.cache_slot, source), self._int4_block(seq.cache_slot, target))
            return
        for cache in (self.k, self.v):
            cache[:, seq.cache_slot, :, target] = cache[:, seq.cache_slot, :, source]

    def free(self, seq: Sequence) -> None:
        if seq.cache_slot >= 0:
            if self.int4 is not None:
                self.slot_tokens[seq.cache_slot] = -1
            self.free_slots.append(seq.cache_slot)
            self.free_slots.sort()
            seq.cache_slot = -1

    def usage(self, seq: Sequence) -> tuple[int, int]:
        """(bytes holding this sequence's tokens, bytes reserved for it)."""
        return seq.num_computed_tokens * self.bytes_per_token, self.max_seq_len * self.bytes_per_token

    def blocks_in_use(self) -> int:
        """Slots in use (a contiguous cache's unit of memory)."""
        return self.num_slots - len(self.free_slots)

    def prepare(self, seqs: list[Sequence], batch) -> None:
        batch.cache_slots = [seq.cache_slot for seq in seqs]
        if batch.num_decodes > 1:
            batch.decode_slots = torch.tensor(batch.cache_slots[:batch.num_decodes], dtype=torch.long,
                                              device=self.device)
        if batch.chunks is not None:
            batch.chunks.slots = torch.tensor(batch.cache_slots[batch.chunks.first:], dtype=torch.long,
                                              device=self.device)
        if self.int4 is not None:
            self.settle()
            batch.tail_slots = self.int4.write_slots(
                self._int4_block(slot, position) for slot, (first, last) in zip(batch.cache_slots,
                                                                                batch.position_ranges)
                for position in range(first, last))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        # k, v: [tokens, kv_heads, head_dim] for all sequences of the batch, in batch.query_ranges order.
        if self.int4 is not None:
            self.int4.write(layer, k, v, batch.tail_slots)
            return
        k, v = self.encode(k), self.encode(v)
        k_layer, v_layer = self.k_layers[layer], self.v_layers[layer]
        num_decodes = batch.num_decodes
        if num_decodes > 1:  # every decode writes one position: one scatter for all of them
            slots, positions = batch.decode_slots, batch.positions[:num_decodes]
            k_layer[slots, :, positions] = k[:num_decodes]
            v_layer[slots, :, positions] = v[:num_decodes]
        first = num_decodes if num_decodes > 1 else 0
        for slot, (start, end), (first_pos, last_pos) in zip(batch.cache_slots[first:], batch.query_ranges[first:],
                                                            batch.position_ranges[first:]):
            k_layer[slot, :, first_pos:last_pos] = k[start:end].transpose(0, 1)
            v_layer[slot, :, first_pos:last_pos] = v[start:end].transpose(0, 1)

    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        slot, context = batch.cache_slots[index], batch.context_lens[index]
        if self.int4 is not None:
            k, v = self._read_int4(layer, torch.tensor([slot], device=self.device), context)
            return k[0], v[0]
        k, v = self.k_layers[layer][slot, :, :context], self.v_layers[layer][slot, :, :context]
        return self.decode(k), self.decode(v)

    def load_decodes(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[decodes, kv_heads, longest context, head_dim]: the decoding slots' buffers up to the longest context."""
        return self._gather(layer, batch.decode_slots, batch.max_decode_context)

    def load_chunks(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """[chunks, kv_heads, longest context, head_dim]: the batched sequences' slots up to the longest context."""
        return self._gather(layer, batch.chunks.slots, batch.chunks.longest)

    def _gather(self, layer: int, slots: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.int4 is not None:
            return self._read_int4(layer, slots, longest)
        return (self.decode(self.k_layers[layer][:, :, :longest].index_select(0, slots)),
                self.decode(self.v_layers[layer][:, :, :longest].index_select(0, slots)))

    def _read_int4(self, layer: int, slots: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, kv_heads, longest, head_dim] each: the slots' first blocks dequantized (those written through
        the tail read from it)."""
        count = -(-longest // INT4_BLOCK)
        blocks = (slots.long()[:, None] * self.blocks_per_slot + torch.arange(count, device=self.device)).flatten()
        k, v = self.int4.read(layer, blocks)  # [rows * count, block, kv_heads, head_dim]
        shape = (slots.shape[0], count * INT4_BLOCK) + k.shape[2:]
        return k.view(shape)[:, :longest].transpose(1, 2), v.view(shape)[:, :longest].transpose(1, 2)


class PagedKVCache(_Storage):
    kv_mode = "paged"

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, prefix_cache: bool, dtype, device,
                 kv_dtype: str = "auto", sliding_window: int | None = None, attention: str = "gather", sinks: int = 0):
        self.block_size = block_size
        storage, last = self._init_storage(config, dtype, kv_dtype, sliding_window, block_size, sinks)
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix_cache)
        self.device, self.attention = device, attention
        if kv_dtype == "int4":  # the config refuses flex attention with it
            self.int4 = Int4Blocks(config, num_blocks, block_size, dtype, device)
            self.flex_layout, self.k, self.v = None, None, None
            return
        # flex: the pool as FlexAttention sees it; it holds a few spare blocks the manager never hands out (`kv.flex`)
        self.flex_layout = flex.PoolLayout.for_pool(num_blocks, block_size, torch.device(device)) \
            if attention == "flex" else None
        pool_blocks = self.flex_layout.total_pages if self.flex_layout is not None else num_blocks
        shape = (config.num_layers, pool_blocks, block_size, config.num_kv_heads, last)
        # k, v: [layers, blocks, block_size, kv_heads, head_dim]; a token's (block, offset) is one flat slot index.
        # Zeroed: batched decodes read whole blocks (and block 0 as padding) and mask what lies past a context, and
        # masked positions must hold finite numbers (never-written memory can hold NaN; 0 x NaN is NaN).
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        # Per-layer views made once: [blocks, block_size, kv_heads, head_dim] for reads, flat slots for writes.
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.k_slots = [layer.flatten(0, 1) for layer in self.k_layers]
        self.v_slots = [layer.flatten(0, 1) for layer in self.v_layers]

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.manager.num_blocks * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.manager.can_allocate(seq)

    def allocate(self, seq: Sequence) -> None:
        self.manager.allocate(seq)
        # Tokens found in the prefix cache need no computing: their KV is already in the shared blocks.
        seq.num_computed_tokens = seq.num_cached_tokens

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the free blocks can grow `seq`'s table to hold `num_tokens` tokens."""
        missing = self.manager.blocks_needed(num_tokens) - len(seq.block_table)
        return missing <= self.manager.num_free_blocks

    def ensure_capacity(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens (default: all of its tokens)."""
        self.manager.ensure_capacity(seq, num_tokens)

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        first_query = seq.num_computed_tokens  # where the forward being committed started
        seq.num_computed_tokens = num_computed_tokens
        self.manager.commit(seq, num_computed_tokens)
        if self.sliding_window is not None:
            # The next forward starts at or after `first_query` (a rollback never goes back further), so no later
            # query reaches keys before first_query - window + 1: blocks wholly before that go back to the pool,
            # but for those holding the attention sinks.
            self.manager.release_before(seq, first_query - self.sliding_window + 1, self.attention_sinks)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens; blocks past them go back to the pool."""
        self.manager.rollback(seq, num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def copy_token(self, seq: Sequence, source: int, target: int) -> None:
        """Every layer's KV at token position `source` written to `target` too (a tree's accepted leaf moving next
        to its parent); both lie in blocks this sequence holds, past what it has committed."""
        table, size = seq.block_table, self.block_size
        if self.int4 is not None:
            self.int4.copy_token((table[source // size], source % size), (table[target // size], target % size))
            return
        for cache in (self.k, self.v):
            cache[:, table[target // size], target % size] = cache[:, table[source // size], source % size]

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq)

    def held_tokens(self, seq: Sequence) -> int:
        """Tokens whose KV this sequence still holds: its computed tokens less those in blocks that fell out of a
        sliding window."""
        return max(0, seq.num_computed_tokens - seq.block_table.count(FREED) * self.block_size)

    def usage(self, seq: Sequence) -> tuple[int, int]:
        """(bytes holding this sequence's tokens, bytes of the blocks it holds); blocks that fell out of a sliding
        window hold nothing."""
        num_held_blocks = len(seq.block_table) - seq.block_table.count(FREED)
        return (self.held_tokens(seq) * self.bytes_per_token,
                num_held_blocks * self.block_size * self.bytes_per_token)

    def blocks_in_use(self) -> int:
        return self.manager.num_used_blocks

    def prepare(self, seqs: list[Sequence], batch) -> None:
        """Per-forward index tensors: each new token's flat write slot, and the block tables as one int32 tensor
        [sequences, most blocks any of them needs], padded with block 0 (reads past a context are masked)."""
        block_size = self.block_size
        writes = [(seq.block_table[pos // block_size], pos % block_size)  # each new token's (block, offset)
                  for seq, (first_pos, last_pos) in zip(seqs, batch.position_ranges)
                  for pos in range(first_pos, last_pos)]
        needed = [-(-context // block_size) for context in batch.context_lens]
        width = max(needed)
        # Blocks released from a sliding window (FREED) and the padding read block 0; the window's mask hides them.
        rows = [[max(block, 0) for block in seq.block_table[:count]] + [0] * (width - count)
                for seq, count in zip(seqs, needed)]
        if self.int4 is not None:
            self.settle()
            batch.tail_slots = self.int4.write_slots(writes)
        else:
            batch.slot_mapping = torch.tensor([block * block_size + offset for block, offset in writes],
                                              dtype=torch.long, device=self.device)
        batch.block_tables = torch.tensor(rows, dtype=torch.int32, device=self.device)
        batch.num_blocks = needed
        if self.flex_layout is not None:
            batch.flex = self._flex_batch(seqs, batch)

    def _block_state(self, block_id: int) -> str:
        """int4: a block is full once every one of its tokens is committed (a rollback already undone), free once
        back in the pool without a cached prefix."""
        block = self.manager.blocks[block_id]
        if block.num_filled == self.block_size:
            return FULL
        return PARTIAL if block.ref_count > 0 else FREE

    def _flex_batch(self, seqs: list[Sequence], batch) -> flex.FlexBatch:
        """The forward's FlexAttention calls: every single-token decode in one, then each other sequence alone."""
        window, num_decodes = self.sliding_window, batch.num_decodes
        decodes = None
        if num_decodes:
            decodes = flex.build_call(self.flex_layout, [seq.block_table for seq in seqs[:num_decodes]],
                                      [first for first, _ in batch.position_ranges[:num_decodes]], 1, window,
                                      self.device)
        chunks = [flex.build_call(self.flex_layout, [seq.block_table], [first], last - first, window, self.device)
                  for seq, (first, last) in zip(seqs[num_decodes:], batch.position_ranges[num_decodes:])]
        return flex.FlexBatch(decodes, chunks)

    def prepare_tree(self, seq: Sequence, batch, positions: torch.Tensor, mask: torch.Tensor) -> None:
        """flex: the call of a tree verification (one sequence): its queries at `positions` [queries], seeing the keys
        `mask` [queries, context] marks (those before the queries as the window allows)."""
        first = batch.position_ranges[0][0]
        call = flex.build_call(self.flex_layout, [seq.block_table], [first], len(positions), self.sliding_window,
                               self.device, tree=(positions, mask[:, first:]))
        batch.flex = flex.FlexBatch(None, [call])

    def attend(self, layer: int, call: flex.FlexCall, q: torch.Tensor, scale: float) -> torch.Tensor:
        """flex: q [rows, heads, queries, head_dim] over this layer's pool, through `call`'s block mask."""
        # The pool [blocks, block_size, kv_heads, head_dim] seen as one sequence [1, kv_heads, slots, head_dim]: a view.
        k = self.k_slots[layer].transpose(0, 1).unsqueeze(0)
        v = self.v_slots[layer].transpose(0, 1).unsqueeze(0)
        return flex.attend(call, q.to(k.dtype), k, v, scale)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        # k, v: [tokens, kv_heads, head_dim] -> the pool seen as [blocks * block_size, kv_heads, head_dim].
        if self.int4 is not None:
            self.int4.write(layer, k, v, batch.tail_slots)
            return
        self.k_slots[layer].index_copy_(0, batch.slot_mapping, self.encode(k))
        self.v_slots[layer].index_copy_(0, batch.slot_mapping, self.encode(v))

    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather one sequence's blocks through its block table: [kv_heads, context, head_dim] each."""
        table, context = batch.block_tables[index, :batch.num_blocks[index]], batch.context_lens[index]
        k, v = self._blocks(layer, table)
        return k.flatten(0, 1)[:context].transpose(0, 1), v.flatten(0, 1)[:context].transpose(0, 1)

    def _blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [n] of a layer -> their K and V [n, block_size, kv_heads, head_dim] in the model dtype."""
        if self.int4 is not None:
            return self.int4.read(layer, blocks)
        return (self.decode(self.k_layers[layer].index_select(0, blocks)),
                self.decode(self.v_layers[layer].index_select(0, blocks)))

    def load_decodes(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather for every decoding sequence: [decodes, kv_heads, longest context, head_dim] each."""
        return self._gather(layer, batch.block_tables[:batch.num_decodes], batch.max_decode_context)

    def load_chunks(self, layer: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather for every batched sequence (`runner.ChunkBatch`): [chunks, kv_heads, longest, head_dim]."""
        return self._gather(layer, batch.block_tables[batch.chunks.first:], batch.chunks.longest)

    def _gather(self, layer: int, tables: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of each row of `tables` ([rows, blocks] int32) up to `longest` positions."""
        tables = tables[:, :-(-longest // self.block_size)]
        k, v = self._blocks(layer, tables.flatten())
        shape = (tables.shape[0], -1) + k.shape[2:]  # [rows, blocks * block_size, kv_heads, d]
        return k.view(shape)[:, :longest].transpose(1, 2), v.view(shape)[:, :longest].transpose(1, 2)
