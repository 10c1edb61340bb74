"""The model runner: the one place where Python lists of sequences become tensors for a forward pass.

Every forward, batch of one or many, goes through `ModelRunner.run(seqs, num_new_tokens)`: each sequence contributes
its next `num_new_tokens` uncomputed tokens (a prefill chunk, a single decode token, or a speculative verification),
at its own positions, with its own block table or cache slot. In KV mode `none` the cache keeps nothing, so every
sequence contributes its whole text every time.

The flat batch puts single-token decodes first: attention handles all of them with one gather and one SDPA call
(`KVCache.load_decodes`, padded to the longest context and masked by length). The prefill chunks after them attend
in one padded call too (`ChunkBatch`, `KVCache.load_chunks`) where padding adds little (`CHUNK_PADDING`), else one at
a time. The batch's index tensors (positions, write slots, int32 block tables padded to `[batch, max_blocks]`,
context lengths, cumulative query lengths) have shapes that depend only on the batch size, the number of tokens and
the longest context, so a decode step can later be padded to buckets and compiled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from inference_core.kv.cache import KVCache, RecomputeKVCache
from inference_core.kv.flex import FlexBatch
from inference_core.model.llama import CausalLM
from inference_core.model.loader import LoadedModel
from inference_core.sequence import PAD_TOKEN, Sequence


# Several prefill chunks (or whole texts, in mode none) of one forward attend in one padded call where that computes
# at most this many times the scores the chunks need one at a time (each chunk's queries by its keys); past it they
# attend one at a time. Bundled model, bf16, a 2-core CPU: 16 chat prompts of 40-50 tokens (1.2 times) prefilled in
# one step took 194-199 ms in one call against 222-234 ms one at a time (attention 36-37 against 60-69 ms); 16
# benchmark prompts of 36-151 tokens (2.75 times) reached their first tokens later in one call (continuous batching,
# TTFT p50 666 against 537 ms).
CHUNK_PADDING = 1.5


def window_mask(keys: torch.Tensor, query_positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Which keys (positions, broadcast against the queries') a query sees under a sliding window: those at positions
    p - window + 1 .. p for a query at p, and the sequence's first `sinks` tokens (attention sinks). Causality is the
    caller's."""
    seen = keys > query_positions - window
    return seen | (keys < sinks) if sinks else seen


@dataclass(slots=True)
class ChunkBatch:
    """The forward's sequences from `first` on (its prefill chunks, after the decodes), attended in one call: their
    queries padded to the longest chunk, their keys to the longest context, with a mask."""

    first: int  # the first batched sequence, in the flat batch's order
    count: int  # sequences batched
    longest: int  # the longest context among them (keys)
    query_index: torch.Tensor  # [count * most new tokens] flat token index of each padded query (padding: the last)
    rows: torch.Tensor  # [their new tokens] the padded query rows that are real, in the flat batch's order
    mask: torch.Tensor  # [count, 1, most new tokens, longest] bool: the keys each query sees
    slots: torch.Tensor | None = None  # [count] contiguous cache slots (filled by the cache's prepare)


@dataclass(slots=True)
class ForwardBatch:
    """Tensors and per-sequence ranges for one forward pass over a flat batch of tokens (decodes first)."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    logits_indices: torch.Tensor  # [logit rows]: flat indices of the tokens whose logits are returned, caller's order
    query_start_loc: torch.Tensor  # [sequences + 1] int32: cumulative query lengths
    context_lens_tensor: torch.Tensor  # [sequences] int32: tokens each attends to after this step
    num_decodes: int  # the first num_decodes sequences forward one token each against their cache
    query_ranges: list[tuple[int, int]]  # per sequence: its new tokens' [start, end) in the flat batch
    order: list[int]  # the caller's index of each sequence, in the flat batch's order
    position_ranges: list[tuple[int, int]]  # per sequence: positions [first, last) being computed
    context_lens: list[int]  # per sequence: tokens it attends to after this step (cached + new)
    # Per sequence attending alone: SDPA's own causal mask fits (queries and keys start together, no window cuts the
    # keys), or else a [new, context] bool mask where one is needed (`ModelRunner._sequence_mask`). False and None for
    # the sequences attending together (batched decodes, chunks in one call).
    is_causal: list[bool]
    attention_masks: list[torch.Tensor | None]
    max_decode_context: int = 0  # the longest context among the decodes
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_decode_context] bool: key j < context length
    # Filled by the KV cache's prepare(): contiguous slots, or paged write slots and block tables.
    cache_slots: list[int] = field(default_factory=list)
    decode_slots: torch.Tensor | None = None  # [decodes] contiguous slots of the decodes
    slot_mapping: torch.Tensor | None = None  # [tokens] flat write slot of each new token (paged)
    tail_slots: torch.Tensor | None = None  # [tokens] int4 KV: each new token's slot in the full-precision tail
    block_tables: torch.Tensor | None = None  # [sequences, max_blocks] int32, padded with block 0 (paged)
    num_blocks: list[int] = field(default_factory=list)  # per sequence: blocks its context spans (paged)
    flex: FlexBatch | None = None  # paged with flex attention: the block masks of the forward's calls (kv.flex)
    chunks: ChunkBatch | None = None  # the prefill chunks attended in one call (None: one at a time)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, decoder=None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.decoder = decoder  # a `compiled.CompiledDecoder` for the steps it takes (None: all eager)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int], num_logits: int = 1,
                num_padding: list[int] | None = None) -> ForwardBatch:
        """`seqs[i]` forwards tokens [num_computed, num_computed + num_new_tokens[i]), the last `num_padding[i]` of
        them padding (their logits rows are skipped). The flat batch orders the single-token decodes (with cached
        context) first; logits rows follow the caller's order."""
        num_padding = num_padding or [0] * len(seqs)
        firsts = [seq.num_computed_tokens for seq in seqs]
        is_decode = [count == 1 and first > 0 for first, count in zip(firsts, num_new_tokens)]
        order = [i for i in range(len(seqs)) if is_decode[i]] + [i for i in range(len(seqs)) if not is_decode[i]]
        num_decodes = sum(is_decode)
        input_ids: list[int] = []
        positions: list[int] = []
        query_ranges, position_ranges, context_lens = [], [], []
        window = self.kv_cache.sliding_window
        logit_rows: dict[int, list[int]] = {}
        for index in order:
            seq, first, new_tokens = seqs[index], firsts[index], num_new_tokens[index]
            context = first + new_tokens
            start = len(input_ids)
            input_ids.extend(seq.token_ids[first:context])
            positions.extend(range(first, context))
            query_ranges.append((start, start + new_tokens))
            position_ranges.append((first, context))
            context_lens.append(context)
            last = start + new_tokens - num_padding[index]  # one past the last real token
            logit_rows[index] = list(range(last - min(num_logits, last - start), last))
        starts = [start for start, _ in query_ranges] + [len(input_ids)]
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            logits_indices=torch.tensor([row for index in range(len(seqs)) for row in logit_rows[index]],
                                        dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            num_decodes=num_decodes, query_ranges=query_ranges, order=order, position_ranges=position_ranges,
            context_lens=context_lens, is_causal=[False] * len(seqs), attention_masks=[None] * len(seqs))
        if num_decodes > 1:
            batch.max_decode_context = max(context_lens[:num_decodes])
            keys = torch.arange(batch.max_decode_context, device=self.device)
            contexts = batch.context_lens_tensor[:num_decodes, None]
            visible = keys[None, :] < contexts
            if window is not None:  # the decode's query is at position context - 1
                visible &= window_mask(keys[None, :], contexts - 1, window, self.kv_cache.attention_sinks)
            batch.decode_mask = visible[:, None, None, :]
        if getattr(self.kv_cache, "flex_layout", None) is None:  # flex attention has block masks of its own
            batch.chunks = self._chunk_batch(batch, window)
        # The sequences that attend one at a time: after the batched decodes, unless the chunks attend in one call.
        alone = len(seqs) if batch.chunks is not None else num_decodes if num_decodes > 1 else 0
        for i in range(alone, len(seqs)):
            first, context = position_ranges[i]
            batch.attention_masks[i] = mask = self._sequence_mask(first, context, window)
            batch.is_causal[i] = mask is None and context - first > 1  # one query: no mask at all
        self.kv_cache.prepare([seqs[index] for index in order], batch)
        return batch

    def _sequence_mask(self, first: int, context: int, window: int | None) -> torch.Tensor | None:
        """The [new, context] bool mask of a sequence forwarding positions [first, context) alone, where SDPA's own
        (causal, or none for one query) does not fit: None where it does."""
        if window is not None and context > window:  # query at position p sees keys p - window + 1 .. p
            query_positions = torch.arange(first, context, device=self.device)[:, None]
            keys = torch.arange(context, device=self.device)[None, :]
            return (keys <= query_positions) & window_mask(keys, query_positions, window, self.kv_cache.attention_sinks)
        if context - first == 1 or first == 0:  # one query sees everything before it; or plain causal
            return None
        # New tokens after a cached prefix: query i (position first + i) sees keys 0..first + i.
        return torch.ones(context - first, context, dtype=torch.bool, device=self.device).tril(diagonal=first)

    def _chunk_batch(self, batch: ForwardBatch, window: int | None) -> ChunkBatch | None:
        """The sequences after the decodes (all of them where fewer than two decode) as one padded attention call,
        where there are at least two and padding computes at most `CHUNK_PADDING` times their scores."""
        first = batch.num_decodes if batch.num_decodes > 1 else 0
        ranges, positions = batch.query_ranges[first:], batch.position_ranges[first:]
        if len(ranges) < 2:
            return None
        if self.kv_cache.kv_mode == "none" and any(first_pos for first_pos, _ in positions):
            return None  # mode none keeps no keys: a sequence's keys are its queries (an early-exit pass moves them)
        news = [end - start for start, end in ranges]
        contexts = batch.context_lens[first:]
        most, longest = max(news), max(contexts)
        if len(ranges) * most * longest > CHUNK_PADDING * sum(n * c for n, c in zip(news, contexts)):
            return None
        # Query i of a sequence sits at position first_pos + i; padding queries repeat its last real one.
        query_index, query_positions, rows = [], [], []
        for row, ((start, end), (first_pos, _)) in enumerate(zip(ranges, positions)):
            pad = most - (end - start)
            query_index += list(range(start, end)) + [end - 1] * pad
            query_positions += list(range(first_pos, first_pos + end - start)) + [first_pos + end - start - 1] * pad
            rows += range(row * most, row * most + end - start)
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=self.device)
        query_positions = as_tensor(query_positions).view(len(ranges), most, 1)
        keys = torch.arange(longest, device=self.device)
        mask = keys <= query_positions  # causal; a sequence's context ends at its last query
        if window is not None:
            mask &= window_mask(keys, query_positions, window, self.kv_cache.attention_sinks)
        return ChunkBatch(first, len(ranges), longest, as_tensor(query_index), as_tensor(rows), mask[:, None])

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_new_tokens: list[int] | None = None, num_logits: int = 1,
            num_padding: list[int] | None = None, return_hidden: bool = False):
        """Forward the next `num_new_tokens[i]` uncomputed tokens of each sequence (default: all of them); returns
        fp32 logits for each sequence's last `num_logits` forwarded tokens, [len(seqs) * num_logits, vocab] (more than
        1 for speculative verification). Commits the new KV. With `return_hidden`, returns (logits, hidden) where
        hidden[i] is the final-normed hidden state of sequence i's forwarded tokens, [num_new_tokens[i], hidden_size]
        (what trained draft heads read).

        `num_padding[i]` PAD_TOKENs follow sequence i's new tokens (a static batch's prompts padded to its longest).
        The eager forward computes them like any token, at the next positions, so no real token attends to them; their
        KV goes to the sequence's next slots, which its own next tokens overwrite; never committed; logits are those of
        the last real token. The caller has checked that the KV cache has room for them. The compiled flat step leaves
        them out, which changes no real token's result."""
        if num_new_tokens is None:
            num_new_tokens = [len(seq) - seq.num_computed_tokens for seq in seqs]
        if self.decoder is not None:
            compiled = self._run_compiled(seqs, num_new_tokens, num_logits, any(num_padding or ()), return_hidden)
            if compiled is not None:
                return compiled
        num_padding = num_padding or [0] * len(seqs)
        for seq, pads in zip(seqs, num_padding):
            seq.token_ids.extend([PAD_TOKEN] * pads)  # for the forward only: taken out again below
        try:
            for seq in seqs:
                self.kv_cache.ensure_capacity(seq)
            batch = self.prepare(seqs, [count + pads for count, pads in zip(num_new_tokens, num_padding)],
                                 num_logits, num_padding)
            logits = self.model.forward(batch, self.kv_cache, return_hidden=return_hidden)
        finally:
            for seq, pads in zip(seqs, num_padding):
                if pads:
                    del seq.token_ids[-pads:]
        for seq, count in zip(seqs, num_new_tokens):
            self.kv_cache.commit(seq, seq.num_computed_tokens + count)
        if not return_hidden:
            return logits
        logits, flat = logits
        hidden: list[torch.Tensor] = [flat] * len(seqs)
        for (start, _), index in zip(batch.query_ranges, batch.order):
            hidden[index] = flat[start:start + num_new_tokens[index]]
        return logits, hidden

    def _run_compiled(self, seqs: list[Sequence], num_new_tokens: list[int], num_logits: int, padded: bool,
                      return_hidden: bool):
        """`run` through the compiled decoder: the decode step where every sequence forwards one token and only its
        logits are read; the query step for a verification (several logits a sequence) or hidden states read, where
        it takes the forward; else the flat step (any mix of prefill chunks and decodes; a static batch's padding is
        not forwarded at all, since no real token sees it). None where none takes the forward: the reason is counted
        in the decoder's stats (`fallbacks`), and `run` runs it eager."""
        decoder = self.decoder
        if num_logits == 1 and not padded and not return_hidden and decoder.handles(seqs, num_new_tokens):
            for seq in seqs:
                self.kv_cache.ensure_capacity(seq, seq.num_computed_tokens + 1)
            logits = decoder.run(seqs)
            for seq in seqs:
                self.kv_cache.commit(seq, seq.num_computed_tokens + 1)
            return logits
        if (num_logits > 1 or return_hidden) and decoder.refusal(seqs, num_new_tokens, padded) is None:
            step = decoder.run_queries
        else:
            reason = decoder.flat_refusal(seqs, num_new_tokens)
            if reason is not None:
                self.count_fallback(reason)
                return None
            step = functools.partial(decoder.run_flat, hidden_states=return_hidden)
        for seq, count in zip(seqs, num_new_tokens):
            self.kv_cache.ensure_capacity(seq, seq.num_computed_tokens + count)
        logits, hidden = step(seqs, num_new_tokens, num_logits)
        for seq, count in zip(seqs, num_new_tokens):
            self.kv_cache.commit(seq, seq.num_computed_tokens + count)
        return (logits, hidden) if return_hidden else logits

    def count_fallback(self, reason: str) -> None:
        """A forward of a compiled engine that runs eager, for `reason` (the compile stats' `fallbacks`)."""
        if self.decoder is not None:
            fallbacks = self.decoder.stats.fallbacks
            fallbacks[reason] = fallbacks.get(reason, 0) + 1

    @torch.inference_mode()
    def run_tree(self, seq: Sequence, depths: list[int], tree_mask: torch.Tensor):
        """A tree verification forward. The last len(depths) tokens of `seq` are a draft tree in slot order: node i
        sits at depth depths[i] below node 0 (the sequence's last real token, depth 0), so it is rotated to position
        node 0's + depths[i], and it attends to the context before node 0 and to the nodes `tree_mask[i]` marks (its
        ancestors and itself, [nodes, nodes] bool). Earlier uncomputed tokens (mode none forwards everything) are
        computed as usual. Returns (fp32 logits for every node [nodes, vocab], the nodes' final-normed hidden states
        [nodes, hidden]: the trained heads that draft trees read them). Nothing is committed: the caller keeps the
        accepted path (its KV moved to consecutive slots) and commits that."""
        first, num_nodes = seq.num_computed_tokens, len(depths)
        root = len(seq) - num_nodes  # node 0's position (and slot)
        self.kv_cache.ensure_capacity(seq)
        if self.decoder is not None and first == root:  # the tree alone is new: a compiled step may take it
            step = self._tree_step([seq], [num_nodes])
            if step is not None:
                logits, hidden = step([seq], [num_nodes], num_nodes, trees=[(depths, tree_mask.cpu())])
                return logits, hidden[0]
            self.count_fallback(self.decoder.refusal([seq], [num_nodes]))
        else:
            self.count_fallback("a draft tree's verification")
        batch = self.prepare([seq], [len(seq) - first], num_logits=num_nodes)
        positions = torch.cat([torch.arange(first, root, device=self.device),
                               root + torch.tensor(depths, device=self.device)])
        # Keys in slot order: the context [0, root) and then the nodes. Queries: tokens [first, len(seq)).
        key_positions = torch.cat([torch.arange(root, device=self.device), positions[root - first:]])
        mask = torch.zeros(len(seq) - first, len(seq), dtype=torch.bool, device=self.device)
        mask[:, :root] = torch.ones(len(seq) - first, root, dtype=torch.bool, device=self.device).tril(first)
        mask[root - first:, root:] = tree_mask.to(self.device)
        window = self.kv_cache.sliding_window
        if window is not None:  # a query at position p sees keys at positions p - window + 1 .. p
            mask &= window_mask(key_positions[None, :], positions[:, None], window, self.kv_cache.attention_sinks)
        batch.positions, batch.attention_masks[0], batch.is_causal[0] = positions, mask, False
        if batch.flex is not None:  # flex attention: the tree's own block mask
            self.kv_cache.prepare_tree(seq, batch, positions, mask)
        logits, flat = self.model.forward(batch, self.kv_cache, return_hidden=True)
        return logits, flat[-num_nodes:]

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], needed: list[int], trees: list | None = None,
               return_hidden: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """A speculative step's forward: each sequence's uncomputed tokens (its last token, then its drafts: a
        chain, a draft tree `trees[i]` = (depths, mask) in slot order as `run_tree` takes one, or none), and the
        logits of its last `needed[i]` tokens. Returns (per sequence fp32 logits [needed[i], vocab]; per sequence the
        final-normed hidden states of its forwarded tokens, or None without `return_hidden`). The KV of chains and
        plain tokens is committed (the caller rolls rejected drafts back), a tree's is not (`finish_tree` commits
        the path it keeps). One forward for all where there is no tree, or where the compiled query step (CUDA: the
        flat step) takes the trees with the rest, each tree alone new after its cached context; else each tree's own
        forward beside one for the rest."""
        counts = [len(seq) - seq.num_computed_tokens for seq in seqs]
        trees = trees if trees is not None and any(tree is not None for tree in trees) else None
        if trees is None:
            output = self.run(seqs, counts, num_logits=max(needed), return_hidden=return_hidden)
            logits, hidden = output if return_hidden else (output, None)
            return self._rows(logits, counts, needed, max(needed)), hidden
        alone = all(tree is None or len(tree[0]) == count for tree, count in zip(trees, counts))  # nothing before
        step = self._tree_step(seqs, counts) if self.decoder is not None and alone else None
        if step is not None:
            for seq, count in zip(seqs, counts):
                self.kv_cache.ensure_capacity(seq, seq.num_computed_tokens + count)
            logits, hidden = step(seqs, counts, max(needed),
                                  trees=[None if tree is None else (tree[0], tree[1].cpu()) for tree in trees])
            for seq, count, tree in zip(seqs, counts, trees):
                if tree is None:
                    self.kv_cache.commit(seq, seq.num_computed_tokens + count)
            return self._rows(logits, counts, needed, max(needed)), hidden if return_hidden else None
        rows: list = [None] * len(seqs)
        hidden: list = [None] * len(seqs)
        rest = [index for index, tree in enumerate(trees) if tree is None]
        if rest:
            part_rows, part_hidden = self.verify([seqs[i] for i in rest], [needed[i] for i in rest],
                                                 return_hidden=return_hidden)
            for position, index in enumerate(rest):
                rows[index] = part_rows[position]
                hidden[index] = part_hidden[position] if part_hidden is not None else None
        for index, tree in enumerate(trees):
            if tree is not None:
                logits, hidden[index] = self.run_tree(seqs[index], *tree)
                rows[index] = logits[len(logits) - needed[index]:]
        return rows, hidden if return_hidden else None

    def _tree_step(self, seqs: list[Sequence], counts: list[int]):
        """The compiled step that takes a verification of `counts[i]` new tokens a sequence with draft trees among
        them (each tree alone new): the query step (aoti), or CUDA's flat step; None where neither does."""
        if self.decoder.refusal(seqs, counts) is None:
            return self.decoder.run_queries
        if self.decoder.flat_trees and self.decoder.flat_refusal(seqs, counts) is None:
            return self.decoder.run_flat
        return None

    @staticmethod
    def _rows(logits: torch.Tensor, counts: list[int], needed: list[int], num_logits: int) -> list[torch.Tensor]:
        """`run`'s logits (each sequence's last min(num_logits, count) rows, one after another) as each sequence's
        last `needed[i]` rows."""
        rows, row = [], 0
        for count, need in zip(counts, needed):
            taken = min(num_logits, count)
            rows.append(logits[row + taken - need:row + taken])
            row += taken
        return rows

    @torch.inference_mode()
    def run_shallow(self, seq: Sequence, num_layers: int) -> torch.Tensor:
        """An early-exit draft pass: forward the uncomputed tokens of `seq` through the first `num_layers` layers
        (writing only their KV) and return the last token's fp32 logits [1, vocab]. Nothing is committed: the caller
        moves `seq.num_computed_tokens` itself and puts it back before the full-depth pass, which rewrites every
        layer's KV at those positions."""
        self.count_fallback("an early-exit draft pass")
        self.kv_cache.ensure_capacity(seq)
        batch = self.prepare([seq], [len(seq) - seq.num_computed_tokens])
        return self.model.forward(batch, self.kv_cache, num_layers)


@torch.inference_mode()
def wake_device(loaded: LoadedModel) -> None:
    """One untimed single-token forward, to run just before timed work. After the device has sat idle for a second
    or more, its first forward runs slower: on a 2-core CPU, after 1.5 s idle a race's lanes reached their first
    token 25-70 ms later (TTFTs of 100-250 ms) than with one forward run just before."""
    ModelRunner(loaded.model, RecomputeKVCache(), loaded.device).run([Sequence([0])])
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)
