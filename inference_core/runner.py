"""The model runner: the one place where Python lists of sequences become tensors for a forward pass.

Every forward, batch of one or many, goes through `ModelRunner.run(seqs)`: each sequence contributes the tokens it has
not computed yet (all of them in KV mode `none`, only the new ones with a cache), at its own positions, with its own
block table or cache slot. The runner returns one row of fp32 logits per sequence (for its last token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_core.model import CausalLM
from inference_core.sequence import Sequence


@dataclass(slots=True)
class ForwardBatch:
    """Tensors and per-sequence ranges for one forward pass over a flat batch of tokens."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    logits_indices: torch.Tensor  # [sequences * num_logits]: flat indices of each sequence's last num_logits tokens
    query_ranges: list[tuple[int, int]]  # per sequence: its new tokens' [start, end) in the flat batch
    position_ranges: list[tuple[int, int]]  # per sequence: positions [first, last) being computed
    context_lens: list[int]  # per sequence: tokens it attends to after this step (cached + new)
    is_causal: list[bool]  # per sequence: SDPA's own causal mask fits (queries and keys start together)
    attention_masks: list[torch.Tensor | None]  # per sequence: [new, context] bool mask where SDPA's does not fit
    # Filled by the KV cache's prepare(): contiguous slots, or paged write slots and block tables.
    cache_slots: list[int] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None
    block_tables: list[torch.Tensor] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache  # None in KV mode `none`
        self.device = device

    def prepare(self, seqs: list[Sequence], num_logits: int = 1) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_ranges, position_ranges, context_lens, is_causal, masks, last = [], [], [], [], [], []
        for seq in seqs:
            first = 0 if self.kv_cache is None else seq.num_computed_tokens
            context = len(seq)
            new_tokens = context - first
            start = len(input_ids)
            input_ids.extend(seq.token_ids[first:])
            positions.extend(range(first, context))
            query_ranges.append((start, start + new_tokens))
            position_ranges.append((first, context))
            context_lens.append(context)
            last.extend(range(start + new_tokens - min(num_logits, new_tokens), start + new_tokens))
            if new_tokens == 1 or new_tokens == context:
                # One query sees everything before it; or queries and keys start together (plain causal).
                is_causal.append(new_tokens > 1)
                masks.append(None)
            else:
                # New tokens after a cached prefix: query i (position first + i) sees keys 0..first + i.
                masks.append(torch.ones(new_tokens, context, dtype=torch.bool, device=self.device)
                             .tril(diagonal=first))
                is_causal.append(False)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            logits_indices=torch.tensor(last, dtype=torch.long, device=self.device),
            query_ranges=query_ranges, position_ranges=position_ranges, context_lens=context_lens,
            is_causal=is_causal, attention_masks=masks)
        if self.kv_cache is not None:
            self.kv_cache.prepare(seqs, batch)
        return batch

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_logits: int = 1) -> torch.Tensor:
        """Forward the uncomputed tokens of `seqs`; returns fp32 logits for each sequence's last `num_logits` tokens,
        [len(seqs) * num_logits, vocab] (more than 1 for speculative verification). Commits the new KV."""
        if self.kv_cache is not None:
            for seq in seqs:
                self.kv_cache.ensure_capacity(seq)
        logits = self.model.forward(self.prepare(seqs, num_logits), self.kv_cache)
        if self.kv_cache is not None:
            for seq in seqs:
                self.kv_cache.commit(seq)
        return logits

    @torch.inference_mode()
    def run_shallow(self, seq: Sequence, num_layers: int) -> torch.Tensor:
        """An early-exit draft pass: forward the uncomputed tokens of `seq` through the first `num_layers` layers
        (writing only their KV) and return the last token's fp32 logits [1, vocab]. Nothing is committed: the caller
        moves `seq.num_computed_tokens` itself and puts it back before the full-depth pass, which rewrites every
        layer's KV at those positions."""
        if self.kv_cache is not None:
            self.kv_cache.ensure_capacity(seq)
        return self.model.forward(self.prepare([seq]), self.kv_cache, num_layers)
