"""A request in flight: the `Sequence` owns its token ids, its sampling settings and its KV placement.

The engine, the block manager and the model runner all read and update a `Sequence`; none of them keeps its own
copy of a request's tokens. A sequence's KV placement is either a block table (paged cache: logical block i of the
sequence lives in physical block `block_table[i]`) or a slot index (contiguous cache: one preallocated buffer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_next_seq_id = itertools.count()
PAD_TOKEN = 0  # what a static batch computes in its padding (prompts padded to the longest, finished rows); thrown away


@dataclass(slots=True)
class Sequence:
    """Token ids of one request (prompt followed by generated tokens) and where its KV lives."""

    token_ids: list[int]
    num_prompt_tokens: int = -1
    seq_id: int = field(default_factory=lambda: next(_next_seq_id))
    # Paged cache: physical block ids, in logical order. Written by the block manager only.
    block_table: list[int] = field(default_factory=list)
    # Contiguous cache: index of this sequence's preallocated buffer, or -1.
    cache_slot: int = -1
    # Prompt tokens whose KV was found in the prefix cache (set by the block manager when it allocates).
    num_cached_tokens: int = 0
    # Tokens whose KV has been written to the cache (everything before this position can be attended to).
    num_computed_tokens: int = 0
    # Mixed into the prefix cache's block hashes: only sequences with the same salt can share cached blocks (one
    # salt per visitor of a shared engine, so that nobody's cache hit reveals another visitor's prompt).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
