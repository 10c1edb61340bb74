"""KV cache storage: where the keys and values of past tokens live between forward passes.

Two layouts, each behind the same two verbs the attention layer calls, `store` (write this step's k/v) and `load`
(read one sequence's whole context):

- `ContiguousKVCache`: one preallocated buffer of `max_seq_len` positions per sequence slot, written in place (never
  grown by concatenation). Reading a context is a view, no copy.
- `PagedKVCache`: one pool of fixed-size blocks shared by all sequences. A sequence's block table (kept by the
  `BlockManager`) maps its logical blocks to physical ones; reads gather the blocks through that table. Memory is held
  per block actually used, and full blocks with the same token prefix are shared across requests (prefix caching).

Mode `none` has no cache object at all: every step recomputes the whole sequence.
"""

from __future__ import annotations

import torch

from inference_core.block_manager import BlockManager
from inference_core.config import ModelConfig
from inference_core.sequence import Sequence


class ContiguousKVCache:
    kv_mode = "contiguous"

    def __init__(self, config: ModelConfig, max_seq_len: int, num_slots: int, dtype, device):
        self.max_seq_len = max_seq_len
        self.bytes_per_token = config.kv_bytes_per_token(dtype)
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        # k, v: [layers, slots, kv_heads, max_seq_len, head_dim]; head-major so one slot's context is a plain view.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # views, so a step indexes less
        self.free_slots = list(range(num_slots))

    def allocate(self, seq: Sequence) -> None:
        if not self.free_slots:
            raise RuntimeError("all contiguous KV slots are in use; finish or cancel a running request first.")
        seq.cache_slot = self.free_slots.pop(0)

    def ensure_capacity(self, seq: Sequence) -> None:
        """The slot was sized for max_seq_len up front; the engine never lets a sequence grow past that."""

    def commit(self, seq: Sequence) -> None:
        seq.num_computed_tokens = len(seq)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens only (later positions are simply overwritten next time)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        if seq.cache_slot >= 0:
            self.free_slots.append(seq.cache_slot)
            self.free_slots.sort()
            seq.cache_slot = -1

    def prepare(self, seqs: list[Sequence], batch) -> None:
        batch.cache_slots = [seq.cache_slot for seq in seqs]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        # k, v: [tokens, kv_heads, head_dim] for all sequences of the batch, in batch.query_ranges order.
        for slot, (start, end), (first_pos, last_pos) in zip(batch.cache_slots, batch.query_ranges,
                                                            batch.position_ranges):
            self.k_layers[layer][slot, :, first_pos:last_pos] = k[start:end].transpose(0, 1)
            self.v_layers[layer][slot, :, first_pos:last_pos] = v[start:end].transpose(0, 1)

    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        slot, context = batch.cache_slots[index], batch.context_lens[index]
        return self.k_layers[layer][slot, :, :context], self.v_layers[layer][slot, :, :context]

    def usage(self, seq: Sequence) -> tuple[int, int]:
        """(bytes holding this sequence's tokens, bytes reserved for it)."""
        return seq.num_computed_tokens * self.bytes_per_token, self.max_seq_len * self.bytes_per_token



class PagedKVCache:
    kv_mode = "paged"

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, prefix_cache: bool, dtype, device):
        self.block_size = block_size
        self.bytes_per_token = config.kv_bytes_per_token(dtype)
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_cache=prefix_cache)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # k, v: [layers, blocks, block_size, kv_heads, head_dim]; a token's (block, offset) is one flat slot index.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        # Per-layer views made once: [blocks, block_size, kv_heads, head_dim] for reads, flat slots for writes.
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.k_slots = [layer.flatten(0, 1) for layer in self.k_layers]
        self.v_slots = [layer.flatten(0, 1) for layer in self.v_layers]
        self.device = device

    def allocate(self, seq: Sequence) -> None:
        self.manager.allocate(seq)
        # Prompt tokens found in the prefix cache need no computing: their KV is already in the shared blocks.
        seq.num_computed_tokens = seq.num_cached_tokens

    def ensure_capacity(self, seq: Sequence) -> None:
        self.manager.ensure_capacity(seq)

    def commit(self, seq: Sequence) -> None:
        seq.num_computed_tokens = len(seq)
        self.manager.commit(seq, len(seq))

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens; blocks past them go back to the pool."""
        self.manager.rollback(seq, num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq)

    def prepare(self, seqs: list[Sequence], batch) -> None:
        """Per-forward index tensors: each new token's flat write slot, and each sequence's needed blocks."""
        block_size = self.block_size
        slot_mapping, block_tables = [], []
        for seq, (first_pos, last_pos), context in zip(seqs, batch.position_ranges, batch.context_lens):
            table = seq.block_table
            slot_mapping.extend(table[pos // block_size] * block_size + pos % block_size
                                for pos in range(first_pos, last_pos))
            num_blocks = -(-context // block_size)
            block_tables.append(torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device))
        batch.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=self.device)
        batch.block_tables = block_tables

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        # k, v: [tokens, kv_heads, head_dim] -> the pool seen as [blocks * block_size, kv_heads, head_dim].
        self.k_slots[layer].index_copy_(0, batch.slot_mapping, k)
        self.v_slots[layer].index_copy_(0, batch.slot_mapping, v)

    def load(self, layer: int, index: int, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather one sequence's blocks through its block table: [kv_heads, context, head_dim] each."""
        table, context = batch.block_tables[index], batch.context_lens[index]
        k = self.k_layers[layer].index_select(0, table).flatten(0, 1)[:context].transpose(0, 1)
        v = self.v_layers[layer].index_select(0, table).flatten(0, 1)[:context].transpose(0, 1)
        return k, v

    def usage(self, seq: Sequence) -> tuple[int, int]:
        return (seq.num_computed_tokens * self.bytes_per_token,
                len(seq.block_table) * self.block_size * self.bytes_per_token)
