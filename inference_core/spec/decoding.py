"""Speculative decoding: cheap drafts of the next k tokens, verified by the target model in one forward pass.

This module owns the draft sources, the verification step, the acceptance rule and the statistics; the engine owns
the request loop (`Engine._run`) and builds the draft source for a request (`Engine._drafter`). One verification step
(`draft_chain`, one forward, `finish_chain`; the engine verifies every speculating request of a step in one
forward: `Engine._run_speculative`):

1. A draft source proposes up to k tokens after the sequence so far (`propose`).
2. The target forwards the last accepted token plus the k drafts through its KV cache in one pass and returns logits
   for every one of those k + 1 positions (`ModelRunner.run(..., num_logits=k + 1)`).
3. Acceptance. Greedy: draft i is accepted while it equals the target's argmax at its position; at the first
   mismatch the target's own token replaces it, and if all k are accepted the target's token after them is a bonus.
   Every step therefore yields between 1 and k + 1 tokens, exactly the tokens plain greedy decoding would have
   produced. Sampling (`accept_sampled`): the standard rule that keeps the target's distribution exactly.
4. The KV of rejected drafts is rolled back (paged: their tail blocks return to the pool).

Draft sources, each with `propose` (up to k tokens and, when sampling from a model, their draft distributions) and
`close` (release what the request held):
- `ngram`: prompt lookup. Find the latest earlier occurrence of the sequence's last n tokens and propose what
  followed it. No model, nearly free; helps where the answer copies from the prompt.
- `early-exit`: self-speculation. The target's first L layers, then its final norm and LM head, draft k tokens one
  by one. No extra weights: the draft writes layers 0..L-1 of the target's own KV cache, and the verification pass
  rewrites every layer at those positions.
- `draft`: a separate, smaller model with the same tokenizer, with its own KV cache that is rolled back to the
  tokens both models agree on before each proposal.
- `medusa` and `eagle`: heads trained on the target's own answers that read its last hidden state
  (`inference_core.spec.draft_heads`); the verification pass hands them the hidden states of the positions it keeps.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from inference_core.config import ConfigError
from inference_core.logits import shape_logits, token_logprobs
from inference_core.model.row_kernel import argmax_rows
from inference_core.sampling import SamplingParams, probabilities, sample_with_probabilities
from inference_core.sequence import Sequence

SPEC_METHODS = ("none", "ngram", "early-exit", "draft", "medusa", "eagle")
HIDDEN_READERS = ("medusa", "eagle")  # draft sources that read the target's hidden states
MAX_K = 16
MAX_TREE_WIDTH = 8
# A pruned tree follows the drafter's confidence (EAGLE-2's dynamic draft tree, within the request's depth and width):
# the chain drafts one more level only while the product of its draft probabilities so far is at least TREE_GO_ON,
# and a position's next-best tokens join the tree only where their draft probability times the chain's above them is
# at least TREE_KEEP. Chosen from the shipped EAGLE layer's calibration on the benchmark's chat and code answers
# (docs/benchmarks.md, "Trees that follow the drafter's confidence"): a second draft pays for its cost (about a tenth
# of a step) where the first is at least even odds, and a leaf's verification row (a few percent of a step) where it
# is accepted a twentieth of the time.
TREE_GO_ON = 0.5
TREE_KEEP = 0.05


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding settings of one request. method: 'none', 'ngram' (prompt lookup), 'early-exit' (the
    target's first `draft_layers` layers as the draft), 'draft' (the engine's separate draft model), or 'medusa' /
    'eagle' (trained draft heads). With
    `adaptive`, k is where the draft length starts: it grows by one after a fully accepted step (up to 2k, at most
    MAX_K) and shrinks by one after a rejection in the first half of the drafts (down to 1). k None leaves the draft
    length to the engine (`Engine.resolve_spec`: the best measured for the source, `spec.defaults`); tree_width None
    leaves the width to it likewise (a greedy request of a ranking source gets the best measured, any other a chain;
    the lane settings leave both open by default)."""

    method: str = "none"
    k: int | None = None  # draft length (the starting one when adaptive); None: the engine's measured default
    adaptive: bool = False
    draft_layers: int | None = None  # early exit: layers the draft runs (None: half the model's)
    # Prompt lookup: the longest and shortest suffix to match. Shorter matches than 3 tokens propose far more drafts
    # that the target rejects (bundled model, k=5: acceptance 0.16 on chat prompts with 1-token matches, 0.50 with
    # 3-token ones), and on a CPU each rejected draft costs verification time (see README, "Speculative decoding").
    ngram_max: int = 3
    ngram_min: int = 3
    # Tree verification (trained heads, greedy): each draft position offers its `tree_width` best tokens. The best
    # ones form the chain; the others are leaves beside it, verified in the same forward (`draft_tree`).
    tree_width: int | None = 1  # None: the engine's measured default
    # A tree pruned by the drafter's confidence (TREE_GO_ON, TREE_KEEP): k and tree_width are then its most; False
    # verifies every level and candidate.
    tree_prune: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; use one of: {', '.join(SPEC_METHODS)}.")
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                   or not 1 <= self.k <= MAX_K):
            raise ConfigError(f"draft length k must be an integer from 1 to {MAX_K} ({{spec_k}}), got {self.k!r}.")
        if self.draft_layers is not None and (isinstance(self.draft_layers, bool)
                                              or not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise ConfigError(f"draft layers must be a positive integer ({{draft_layers}}), got {self.draft_layers!r}.")
        if self.tree_width is not None:  # None: left to the engine
            if isinstance(self.tree_width, bool) or not isinstance(self.tree_width, int) \
                    or not 1 <= self.tree_width <= MAX_TREE_WIDTH:
                raise ConfigError(f"tree width must be an integer from 1 to {MAX_TREE_WIDTH} ({{spec_tree_width}}), "
                                  f"got {self.tree_width!r}.")
            if self.tree_width > 1 and self.method not in HIDDEN_READERS:
                raise ConfigError(f"tree verification ({{spec_tree_width}} > 1) needs a draft source that ranks its "
                                  f"candidates: {' or '.join(HIDDEN_READERS)}, not {self.method!r}.")
            if self.tree_width > 1 and self.adaptive:
                raise ConfigError("tree verification ({spec_tree_width} > 1) takes its depth from k and the drafter's "
                                  "confidence ({spec_tree_prune}); turn adaptive k off.")
        if not isinstance(self.tree_prune, bool):
            raise ConfigError(f"tree pruning ({{spec_tree_prune}}) is on or off, got {self.tree_prune!r}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"prompt lookup needs 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                              f"{self.ngram_max}.")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def reads_hidden(self) -> bool:
        """Trained draft heads: the engine hands them the target's hidden state at every position it computes."""
        return self.method in HIDDEN_READERS

    @property
    def max_k(self) -> int:
        """The longest draft this setting can propose (once the engine has settled k)."""
        if self.k is None:
            raise ValueError("the draft length is left to the engine: settle it with Engine.resolve_spec first")
        return min(2 * self.k, MAX_K) if self.adaptive else self.k


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


def next_k(k: int, drafted: int, accepted: int, max_k: int) -> int:
    """Adaptive draft length: one longer after a full draft was wholly accepted, one shorter after a rejection in the
    first half of the drafts, else unchanged (within 1..max_k)."""
    if drafted == k and accepted == drafted:
        return min(k + 1, max_k)
    if accepted < drafted // 2:
        return max(k - 1, 1)
    return k


class NgramDrafter:
    """Prompt lookup: deterministic drafts, so no draft distribution."""

    def __init__(self, spec: SpecConfig):
        self.ngram_max, self.ngram_min = spec.ngram_max, spec.ngram_min

    def propose(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator):
        return propose_ngram(seq.token_ids, max_drafts, self.ngram_max, self.ngram_min), None

    def close(self) -> None:
        pass


class EarlyExitDrafter:
    """The target's first `num_layers` layers as the draft, on the target's own runner and KV cache."""

    def __init__(self, runner, num_layers: int):
        self.runner, self.num_layers = runner, num_layers

    def propose(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator):
        full_depth = seq.num_computed_tokens  # every layer's KV is written before this position
        num_before = len(seq)
        drafts, probs = [], []
        try:
            for _ in range(max_drafts):
                logits = self.runner.run_shallow(seq, self.num_layers)[0]
                # The shallow layers' KV now covers the sequence; the next draft pass computes only the new token.
                seq.num_computed_tokens = len(seq)
                token, q = sample_with_probabilities(logits, params, generator)
                seq.token_ids.append(token)
                drafts.append(token)
                probs.append(q)
        finally:
            # The verification pass recomputes these positions at full depth (overwriting layers 0..L-1 too).
            del seq.token_ids[num_before:]
            seq.num_computed_tokens = full_depth
        return drafts, None if params.greedy else torch.stack(probs)

    def close(self) -> None:
        pass


class DraftModelDrafter:
    """A separate draft model on its own runner and KV cache. Its sequence mirrors the target's: before each proposal
    it takes the target's tokens, and its KV is rolled back to the longest prefix both still share (the drafts the
    target rejected drop out there). Its logits are cut to the target's `vocab_size`, so it drafts only ids the target
    can emit and its draft distribution is one over the target's ids."""

    def __init__(self, runner, vocab_size: int):
        self.runner, self.vocab_size = runner, vocab_size
        self.seq: Sequence | None = None

    def propose(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator):
        kv_cache = self.runner.kv_cache
        if self.seq is None:
            self.seq = Sequence(list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens)
            kv_cache.allocate(self.seq)
        else:
            shared = common_prefix_length(self.seq.token_ids, seq.token_ids)
            # Keep the last token uncomputed: its logits give the first draft.
            kv_cache.rollback(self.seq, min(self.seq.num_computed_tokens, shared, len(seq) - 1))
            self.seq.token_ids = list(seq.token_ids)
        drafts, probs = [], []
        for _ in range(max_drafts):
            token, q = sample_with_probabilities(self.runner.run([self.seq])[0, :self.vocab_size], params, generator)
            self.seq.append(token)
            drafts.append(token)
            probs.append(q)
        return drafts, None if params.greedy else torch.stack(probs)

    def close(self) -> None:
        if self.seq is not None:
            self.runner.kv_cache.free(self.seq)
        self.seq = None


def common_prefix_length(first: list[int], second: list[int]) -> int:
    """How many leading token ids the two lists share."""
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def accept_greedy(drafts: list[int], target_ids: list[int]) -> int:
    """Number of drafts accepted: the length of the prefix where each draft equals the target's argmax at its
    position. `target_ids` has len(drafts) + 1 entries (the last one is the bonus position)."""
    return common_prefix_length(drafts, target_ids[:len(drafts)])


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
    """Per-request acceptance statistics, as plain numbers. The by-position lists start `k` long (the longest draft
    the request can propose) and grow if a longer draft is recorded (a count that starts at k=0 and learns k)."""

    k: int
    tree_width: int = 1  # candidates verified per draft position (1: a chain)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    # Steps this request took plain because plain steps measured faster for its batch (`spec.pays`), and the last
    # reason given.
    plain_steps: int = 0
    plain_reason: str | None = None
    # Steps whose drafts were shortened so that the step's group of speculating requests verified within the rows
    # that cost about one row's time (`Engine.drafts_that_fit`), and why.
    fitted_steps: int = 0
    fitted_reason: str | None = None
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at position i (0-based)
    drafted_by_position: list[int] = field(default_factory=list)  # drafts proposed at position i

    def __post_init__(self) -> None:
        self.accepted_by_position = [0] * self.k
        self.drafted_by_position = [0] * self.k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        missing = num_drafted - len(self.drafted_by_position)
        if missing > 0:
            self.accepted_by_position += [0] * missing
            self.drafted_by_position += [0] * missing
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for position in range(num_drafted):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {
            "k": self.k, "tree_width": self.tree_width, "steps": self.steps, "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            # Tokens a verification step produced on average: the accepted drafts plus the target's own token.
            "mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "draft_ms": self.draft_ms, "verify_ms": self.verify_ms,
            "plain_steps": self.plain_steps, "plain_reason": self.plain_reason,
            "fitted_steps": self.fitted_steps, "fitted_reason": self.fitted_reason,
        }


@dataclass(slots=True)
class ChainDraft:
    """A chain of drafts appended to its sequence, waiting for the target's verification forward
    (`draft_chain`, then `finish_chain` with the forward's logits)."""

    proposed: list[int]  # what the drafter proposed (through the first end of sequence)
    drafts: list[int]  # those the target verifies: cut at the first one a grammar forbids
    draft_probs: torch.Tensor | None  # [len(proposed), vocab] the draft's distributions (sampling from a model)
    rows: list | None  # each verified position's shaping context, or None
    num_before: int  # the sequence's length before the drafts (its last token's KV not yet written)
    drafted_at: float  # perf_counter when drafting ended

    @property
    def num_rows(self) -> int:
        """Logits rows the verification reads: the last token's and each draft's."""
        return len(self.drafts) + 1


def draft_chain(seq: Sequence, drafter, max_drafts: int, stats: SpecStats, params: SamplingParams, generator,
                eos_ids, contexts=None, proposal: tuple | None = None) -> ChainDraft | None:
    """A verification step's first half: propose up to `max_drafts` drafts and append the ones the target will
    verify to `seq`. None (and `seq` unchanged) when the drafter proposed nothing: the caller takes a plain step.
    `proposal`: the drafter's `propose` output, where the caller had it drafted already (with other requests').

    `contexts(drafts)` (the request's `row_contexts`, for a request that shapes its logits or asks for
    log-probabilities) cuts the drafts at the first one its grammar forbids, before the target sees them, and gives
    each verified position its shaping context: position i is shaped as plain decoding would shape it after drafts
    0..i-1, so greedy ids equal plain greedy's under penalties and constraints too."""
    started = time.perf_counter()
    proposed, draft_probs = proposal or drafter.propose(seq, max_drafts, params, generator)
    proposed = through_first_eos(proposed, eos_ids)
    drafted_at = time.perf_counter()
    stats.draft_ms += (drafted_at - started) * 1e3
    if not proposed:
        return None
    legal, rows = contexts(proposed) if contexts is not None else (len(proposed), None)
    chain = ChainDraft(proposed, proposed[:legal], draft_probs, rows, len(seq), drafted_at)
    seq.token_ids.extend(chain.drafts)
    return chain


def finish_chain(runner, seq: Sequence, drafter, chain: ChainDraft, logits: torch.Tensor, hidden, stats: SpecStats,
                 params: SamplingParams, generator) -> list[tuple]:
    """A verification step's second half, after the forward that scored the last token and the drafts (`logits`:
    [chain.num_rows, vocab], fp32; `hidden`: the final-normed hidden states of the positions the forward computed,
    for a drafter that reads them, else None): keep the accepted prefix (greedy: the agreeing one; sampling: the
    standard rule), roll the rest back. Returns the step's tokens as (token, draft kind, rejected drafts,
    TokenLogprobs or None, the target's log-probabilities of the rejected drafts it verified)."""
    drafts, rows = chain.drafts, chain.rows
    shaped = shape_logits(logits, rows) if rows is not None else logits
    if params.greedy:
        target_ids = argmax_rows(shaped).tolist()
        accepted = accept_greedy(drafts, target_ids)
        final_token = target_ids[accepted]
    else:
        target_probs = probabilities(shaped, params)
        draft_probs = chain.draft_probs
        if draft_probs is not None:  # a draft model with a narrower vocabulary: no probability on the rest
            draft_probs = _pad_width(draft_probs[:len(drafts)], target_probs.shape[-1])
        accepted, final_token = accept_sampled(drafts, draft_probs, target_probs, generator)
    # Keep the KV of the last token and the accepted drafts; the tokens themselves are re-appended by the caller.
    del seq.token_ids[chain.num_before:]
    if hidden is not None:  # the hidden states of the kept positions (mode none forwards more before them); the
        # last one predicted the final token
        drafter.observe(chain.num_before - 1, hidden[-chain.num_rows:][:accepted + 1])
    runner.kv_cache.rollback(seq, chain.num_before + accepted)
    stats.record(len(chain.proposed), accepted)
    stats.verify_ms += (time.perf_counter() - chain.drafted_at) * 1e3
    tokens = step_tokens(drafts[:accepted], final_token, chain.proposed)
    if params.logprobs is None:
        return [(*token, None, ()) for token in tokens]
    # Each emitted token's log-probabilities come from the row that predicted it; a rejected draft the target
    # verified gets the log-probability the target gave it at its own position.
    emitted = [token for token, _, _ in tokens]
    logprobs = token_logprobs(logits[:len(emitted)], shaped[:len(emitted)], rows[:len(emitted)], emitted)
    rejected = drafts[accepted:]
    rejected_logprobs = tuple(lp.logprob for lp in token_logprobs(
        logits[accepted:len(drafts)], shaped[accepted:len(drafts)], rows[accepted:len(drafts)], rejected))
    return [(*token, lp, rejected_logprobs if kind == "replaced" else ())
            for token, lp, kind in zip(tokens, logprobs, (kind for _, kind, _ in tokens))]


@dataclass(slots=True)
class DraftTree:
    """Draft tokens as a tree below node 0 (the sequence's last token): nodes 1..len(chain) are the chain of each
    position's best token, one below the other; after them come the other candidates, each a leaf at its position
    whose parent is the chain's node just above. Node order is the slot order of the verification forward."""

    chain: list[int]
    tokens: list[int]  # nodes 1.. (chain first)
    depths: list[int]  # node 0's and each node's: 0, 1, 2, ...
    parents: list[int]  # node 0's (-1) and each node's parent index

    @classmethod
    def from_candidates(cls, candidates: list[list[int]], eos_ids) -> DraftTree:
        """`candidates[d]`: position d's tokens, best first. Nothing after an end-of-sequence token in the chain
        can be emitted, so the tree stops at its depth."""
        chain = through_first_eos([ranked[0] for ranked in candidates], eos_ids)
        others = [(depth, token) for depth, ranked in enumerate(candidates[:len(chain)], 1) for token in ranked[1:]]
        return cls(chain=chain, tokens=chain + [token for _, token in others],
                   depths=[0, *range(1, len(chain) + 1), *(depth for depth, _ in others)],
                   parents=[-1, *range(len(chain)), *(depth - 1 for depth, _ in others)])

    def mask(self) -> torch.Tensor:
        """[nodes, nodes] bool: node i sees its ancestors and itself. One tensor per tree shape (every step of a
        request drafts the same shape, or a shorter chain): read it, never write it."""
        return _tree_mask(tuple(self.parents))

    def accept_greedy(self, target_ids: list[int]) -> list[int]:
        """The accepted path (node indices below node 0): follow the chain while it matches the target's argmax at
        its parent; at the first mismatch, a leaf at that depth that matches ends the path."""
        path, node = [], 0
        for depth in range(1, len(self.chain) + 1):
            want = target_ids[node]
            if self.chain[depth - 1] == want:
                path.append(node := depth)
                continue
            for leaf in range(len(self.chain) + 1, len(self.parents)):
                if self.depths[leaf] == depth and self.tokens[leaf - 1] == want:
                    path.append(leaf)
                    break
            break
        return path


@dataclass(slots=True)
class TreeDraft:
    """A draft tree appended to its sequence (nodes 1.. in slot order after node 0, the last token), waiting for the
    target's verification forward (`draft_tree`, then `finish_tree` with the forward's logits)."""

    tree: DraftTree
    rows: list | None  # each node's shaping context, or None
    num_before: int  # the sequence's length before the nodes (its last token, node 0, has no KV yet)
    drafted_at: float  # perf_counter when drafting ended

    @property
    def num_rows(self) -> int:
        """Logits rows the verification reads: node 0's and every node's."""
        return len(self.tree.tokens) + 1


def draft_tree(seq: Sequence, drafter, depth: int, width: int, stats: SpecStats, eos_ids, shaping=None,
               prune: bool = False, candidates: list[list[int]] | None = None) -> TreeDraft | None:
    """A tree verification's first half: the drafter ranks `width` candidates at each of `depth` positions (with
    `prune`, fewer where its confidence is low: TREE_GO_ON, TREE_KEEP), laid out as a `DraftTree` and appended to
    `seq` in slot order. None (and `seq` unchanged) when the drafter proposed nothing: the caller takes a plain step.

    `shaping` (the request, for one that shapes its logits or asks for log-probabilities) first drops the candidates
    its grammar forbids (`legal_candidates`), then gives every node its shaping context (`tree_contexts`: the text
    so far and the path down to the node), so greedy ids equal plain greedy's under penalties and constraints too.
    `candidates`: the drafter's `propose_tree` output, where the caller had it drafted already."""
    started = time.perf_counter()
    if candidates is None:
        candidates = drafter.propose_tree(seq, depth, width, prune)
    if shaping is not None:
        candidates = shaping.legal_candidates(candidates)
    drafted_at = time.perf_counter()
    stats.draft_ms += (drafted_at - started) * 1e3
    if not candidates:
        return None
    tree = DraftTree.from_candidates(candidates, eos_ids)
    rows = shaping.tree_contexts(tree.tokens, tree.parents) if shaping is not None else None
    draft = TreeDraft(tree, rows, len(seq), drafted_at)
    seq.token_ids.extend(tree.tokens)
    return draft


def finish_tree(runner, seq: Sequence, drafter, draft: TreeDraft, logits: torch.Tensor, hidden: torch.Tensor,
                stats: SpecStats, params: SamplingParams) -> list[tuple]:
    """A tree verification's second half, after the forward that scored node 0 and every node under the tree's mask
    without committing their KV (`logits` [draft.num_rows, vocab] fp32, `hidden` their final-normed hidden states):
    keep the longest path the target's argmax follows, the KV of a leaf that ends it moved next to its parent;
    commit node 0 and the path, roll the rest back. Emits exactly plain greedy decoding's tokens, like the chain
    (`finish_chain`). Returns the tokens as `finish_chain` does."""
    tree, rows, root = draft.tree, draft.rows, draft.num_before - 1
    try:
        shaped = shape_logits(logits, rows) if rows is not None else logits
        target_ids = argmax_rows(shaped).tolist()
        path = tree.accept_greedy(target_ids)
        if path and path[-1] > len(tree.chain):  # a leaf ended the path: its KV goes to its depth's chain slot
            runner.kv_cache.copy_token(seq, root + path[-1], root + len(path))
        # Commit node 0 and the path (as consecutive tokens, for the prefix cache's block hashes), free the rest.
        del seq.token_ids[root + 1:]
        seq.token_ids.extend(tree.tokens[node - 1] for node in path)
        runner.kv_cache.commit(seq, root + 1 + len(path))
    finally:
        del seq.token_ids[root + 1:]
    runner.kv_cache.rollback(seq, root + 1 + len(path))
    drafter.observe(root, hidden[-draft.num_rows:][[0, *path]])
    stats.record(len(tree.chain), len(path))
    stats.verify_ms += (time.perf_counter() - draft.drafted_at) * 1e3
    # The target's token after the path replaces the chain's drafts from there on (a leaf took the place of the
    # chain's token at its depth, and the chain's later drafts followed that token).
    tokens = step_tokens([tree.tokens[node - 1] for node in path], target_ids[path[-1] if path else 0], tree.chain)
    if params.logprobs is None:
        return [(*token, None, ()) for token in tokens]
    # Token j was predicted by node 0 (j = 0) or by the path's node j - 1.
    nodes, emitted = [0, *path], [token for token, _, _ in tokens]
    logprobs = token_logprobs(logits[nodes], shaped[nodes], [rows[node] for node in nodes], emitted)
    return [(*token, lp, ()) for token, lp in zip(tokens, logprobs)]


@functools.lru_cache(maxsize=64)
def _tree_mask(parents: tuple[int, ...]) -> torch.Tensor:
    rows = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            rows[node] = rows[parent]
        rows[node, node] = True
    return rows


def through_first_eos(drafts: list[int], eos_ids) -> list[int]:
    """The drafts up to and including the first end-of-sequence token: nothing after it can be emitted."""
    for index, token in enumerate(drafts):
        if token in eos_ids:
            return drafts[:index + 1]
    return drafts


def step_tokens(accepted: list[int], final_token: int, chain: list[int]) -> list[tuple]:
    """A verification step's tokens as (token, draft kind, rejected drafts): the accepted drafts, then the target's
    own token, which replaces the chain's drafts past the accepted ones or, after the whole chain, is a bonus."""
    tokens = [(token, "accepted", ()) for token in accepted]
    if len(accepted) < len(chain):
        return tokens + [(final_token, "replaced", tuple(chain[len(accepted):]))]
    return tokens + [(final_token, "bonus", ())]


def _pad_width(probs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, v] probabilities -> [n, width] with v <= width, zero-padded."""
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
