"""Speculative decoding: cheap drafts of the next k tokens, verified by the target model in one forward pass.

This module owns the draft sources, the acceptance rule and the statistics; the engine owns the loop (see
`Engine._run`). One verification step:

1. A draft source proposes up to k tokens after the sequence so far (`propose`).
2. The target forwards the last accepted token plus the k drafts through its KV cache in one pass and returns logits
   for every one of those k + 1 positions (`ModelRunner.run(..., num_logits=k + 1)`).
3. Acceptance. Greedy: draft i is accepted while it equals the target's argmax at its position; at the first
   mismatch the target's own token replaces it, and if all k are accepted the target's token after them is a bonus.
   Every step therefore yields between 1 and k + 1 tokens, exactly the tokens plain greedy decoding would have
   produced. Sampling (`accept_sampled`): the standard rule that keeps the target's distribution exactly.
4. The KV of rejected drafts is rolled back (paged: their tail blocks return to the pool).

Draft sources so far: `ngram` (prompt lookup: find the latest earlier occurrence of the sequence's last n tokens and
propose what followed it; no model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_core.config import ConfigError

SPEC_METHODS = ("none", "ngram")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    method: str = "none"  # "none" | "ngram"
    k: int = 4  # draft length
    ngram_max: int = 3  # prompt lookup: longest suffix to match
    ngram_min: int = 1  # prompt lookup: shortest suffix to match

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; use one of: {', '.join(SPEC_METHODS)}.")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ConfigError(f"draft length k must be an integer from 1 to 16 (--spec-k), got {self.k!r}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"prompt lookup needs 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                              f"{self.ngram_max}.")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


def propose_ngram(token_ids: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    trying the longest n first. [] when no suffix recurs."""
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = token_ids[length - n:]
        # Latest match first: recent text predicts the continuation best. A match must leave a token after it.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def accept_greedy(drafts: list[int], target_ids: list[int]) -> int:
    """Number of drafts accepted: the length of the prefix where each draft equals the target's argmax at its
    position. `target_ids` has len(drafts) + 1 entries (the last one is the bonus position)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_ids[accepted]:
        accepted += 1
    return accepted


def accept_sampled(drafts: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling. target_probs: [len(drafts) + 1, vocab], the target's sampling distribution at each draft
    position and after the last; draft_probs: [len(drafts), vocab] the draft's, or None for a deterministic draft
    source (prompt lookup: all its mass on the proposed token). Returns (drafts accepted, the step's final token).

    Draft x at position i is accepted with probability min(1, p(x) / q(x)). At the first rejection the token is drawn
    from max(0, p - q) renormalized, and after k acceptances a bonus token is drawn from p at position k; together
    these make every emitted token distributed exactly as the target alone would sample it."""
    for index, token in enumerate(drafts):
        p = target_probs[index]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[index]
        # u < p/q, written as u * q < p so that q(x) = 0 (a draft outside its own support) can only be rejected.
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[token] < p[token]:
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        # total = 0 only if p == q, where rejection cannot happen; guard rounding all the same.
        residual = residual / total if total > 0 else p
        return index, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))


@dataclass(slots=True)
class SpecStats:
    """Per-request acceptance statistics, as plain numbers."""

    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at position i (0-based)
    drafted_by_position: list[int] = field(default_factory=list)  # drafts proposed at position i

    def __post_init__(self) -> None:
        self.accepted_by_position = [0] * self.k
        self.drafted_by_position = [0] * self.k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted

    def as_dict(self) -> dict:
        return {
            "k": self.k, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # Tokens a verification step produced on average: the accepted drafts plus the target's own token.
            "mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "draft_ms": self.draft_ms, "verify_ms": self.verify_ms,
        }
