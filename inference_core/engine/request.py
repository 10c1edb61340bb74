"""One request's own state and the events it streams: what the engine keeps per request between scheduler steps.

A `Request` owns its `Sequence` (token ids and KV placement), its sampling settings and seeded generator, its
incremental detokenizer and stop-string handling, its speculative draft source and statistics, and its clocks. The
engine's step turns the tokens a forward produced into `TokenEvent`s through `Request.record` and ends the request
with one `FinishEvent` (`Request.finish_event`); nothing else in the engine knows about text.

Clocks. `busy_s` is the request's own device time: tokenization plus the duration of every engine step it took part
in (a shared step counts in full for each request in it: that is how long the request waited for it), never the time
it spent queued, preempted, or suspended in a caller. TTFT and tokens/s in `GenerationStats` are on this clock, so a
race lane's numbers do not include the other lane's steps. Wall-clock times (`submitted_at`, `first_scheduled_at`)
are kept too, for queueing delay and for benchmarks that measure latency as a user sees it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from inference_core.logits import RowContext, TokenLogprobs
from inference_core.model.tokenizer import IncrementalDetokenizer
from inference_core.sampling import SamplingParams, make_generator
from inference_core.sequence import Sequence
from inference_core.spec.decoding import SpecConfig, SpecStats

_next_request_id = itertools.count()


class StopGeneration(Exception):
    """Thrown into a running request's generator to stop it with a final event (finish_reason "stopped")."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    text: str  # text delta; "" while an incomplete character or a possible stop string is held back
    index: int  # 0 for the first generated token
    time_s: float  # the request's own busy time when this token was ready
    step_ms: float  # the forward pass + sampling that produced this token (0 for later tokens of a speculative step)
    # Speculative decoding: "accepted" (a draft the target agreed with), "replaced" (the target's token where it
    # rejected a draft), "bonus" (the target's token after a fully accepted draft), or None (a plain decode step).
    draft: str | None = None
    rejected_ids: tuple[int, ...] = ()  # on a "replaced" token: the drafts rejected from this position on
    # The first token's event only (None on later ones): prompt tokens whose KV came from the prefix cache.
    cached_prompt_tokens: int | None = None
    batch_size: int = 1  # sequences in the engine step that produced this token (1: the request ran alone)
    # Asked for with SamplingParams.logprobs (else None and ()): this token's log-probability, its top alternatives
    # ((token id, log-probability), best first) and the entropy of the distribution, in nats; on a "replaced" token,
    # the target's log-probability of each rejected draft it verified, at that draft's position.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    entropy: float | None = None
    rejected_logprobs: tuple[float, ...] = ()
    # The first token's event only, with SamplingParams.prompt_logprobs: one entry per prompt token (the first None).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class GenerationStats:
    kv_mode: str
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV came from the prefix cache
    generated_tokens: int
    finish_reason: str  # "eos" | "stop" | "length" | "stopped" (StopGeneration)
    ttft_ms: float  # tokenization + prefill + first sampling, on the request's own clock (compiling left out)
    prefill_tokens_per_s: float  # computed (not cached) prompt tokens / the prefill steps' time
    decode_tokens_per_s: float  # tokens after the first / busy time from the first token to the last (the same)
    total_ms: float
    kv_bytes_in_use: int  # KV of this request's tokens at its end
    kv_bytes_reserved: int  # KV memory set aside for this request (contiguous: its whole slot; paged: its blocks)
    spec: dict | None = None  # speculative decoding statistics (`SpecStats.as_dict`), None without speculation
    preemptions: int = 0  # times the scheduler took its KV away (recompute) to make room for others
    queue_ms: float = 0.0  # wall time from submission to its first scheduled step
    batch_size_mean: float = 1.0  # mean number of sequences in the steps that served this request
    # Compiled decode (None when eager): the engine's `compiled.CompileStats` at the end of this request, and
    # `compile_s`, the seconds this request waited for a graph to compile or a package to load (left out of ttft_ms
    # and decode_tokens_per_s: a compiled engine's first prefill loads the flat step's package, its first
    # verification the query step's).
    compile: dict | None = None
    grammar_ms: float = 0.0  # a constrained request: time its grammar's masks took (part of total_ms)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class FinishEvent:
    text: str
    token_ids: list[int]  # generated ids (an end-of-sequence token included)
    stats: GenerationStats


class Request:
    """A request from submission to its final event. States: "waiting" (queued, or preempted and queued again),
    "running" (holds KV placement), "finished" (final event produced; KV released)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig, *, detokenizer,
                 eos_ids: frozenset[int], device, priority: int = 0, cache_salt: str | None = None,
                 tokenize_s: float = 0.0):
        self.request_id = next(_next_request_id)
        self.seq = Sequence(list(prompt_ids), cache_salt=cache_salt)
        self.params = params
        self.spec = spec
        self.priority = priority
        self.generator = make_generator(params, device)
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.ending_ids = self.eos_ids | self.stop_token_ids  # what min_tokens masks
        self.grammar = None  # `structured.GrammarState` of a constrained request (set by the engine)
        # A copy of another request's prompt (n > 1): admitted once that request's prompt is computed, so that its
        # prompt's full blocks come from the prefix cache, shared (reference-counted) instead of computed again.
        self.prompt_source: Request | None = None
        self.prompt_logprobs: tuple | None = None  # computed by the engine before the first token's event
        self.grammar_s = 0.0  # time spent computing the grammar's masks (part of busy_s)
        self.detokenizer: IncrementalDetokenizer = detokenizer
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.state = "waiting"
        # Where events go: `listener` (the engine loop's callback) if set, else the `events` deque for the caller. A
        # failed step calls the listener with the error instead of an event.
        self.events: deque[TokenEvent | FinishEvent] = deque()
        self.listener: Callable[[Request, TokenEvent | FinishEvent | BaseException], None] | None = None
        self.stop_requested = False  # StopGeneration: end after the step in flight, with a final event
        self.finish_reason: str | None = None
        self.error: BaseException | None = None  # set when a step failed: the handle re-raises it
        # A viewer that draws the KV pool asks for its picture at the request's last token (taken by the step that
        # finishes the request, just before its blocks go back).
        self.keep_final_kv_snapshot = False
        self.final_kv_snapshot: dict | None = None
        self.text, self.emitted = "", 0
        # Speculative decoding: the draft source (built at first admission), stats, and the current draft length.
        self.drafter = None
        self.spec_stats = SpecStats(spec.max_k, tree_width=spec.tree_width) if spec.enabled else None
        self.draft_k = spec.k
        # Clocks and counters (see the module docstring).
        self.submitted_at = time.perf_counter()
        self.first_scheduled_at: float | None = None
        self.first_token_at: float | None = None  # wall clock (perf_counter) of the first token, queueing included
        self.finished_at: float | None = None  # wall clock of the final event
        self.busy_s = tokenize_s
        self.first_token_busy_s: float | None = None
        self.first_token_compile_s = 0.0  # compile_s when the first token came
        self.prefill_s = 0.0  # steps that computed prompt tokens (the first token's step included)
        self.compile_s = 0.0  # time its steps spent compiling decode graphs (compiled engines only)
        self.cached_prompt_tokens: int | None = None  # set at first admission
        self.num_computed_prompt_tokens = 0
        self.preemptions = 0
        # Static batching: PAD_TOKENs forwarded after the prompt's last chunk (the prompt padded to its batch's
        # longest, as in a padded batch; see ModelRunner.run). Set at admission, cleared once computed.
        self.prompt_padding = 0
        self.steps = 0
        self.batch_size_sum = 0

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.state}, {len(self.seq)} tokens, priority {self.priority})"

    @property
    def speculates(self) -> bool:
        return self.spec.enabled

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    def emit(self, event: TokenEvent | FinishEvent) -> None:
        if self.listener is not None:
            self.listener(self, event)
        else:
            self.events.append(event)

    def room(self) -> int:
        """New tokens this request may still produce."""
        return self.params.max_new_tokens - self.seq.num_generated_tokens

    def account_step(self, step_s: float, batch_size: int, prompt_tokens: int, compile_s: float = 0.0) -> None:
        """Charge one engine step this request took part in: its duration, the batch size, whether it computed
        prompt tokens (a prefill chunk), and the part of it spent compiling a graph."""
        self.busy_s += step_s
        self.compile_s += compile_s
        self.steps += 1
        self.batch_size_sum += batch_size
        if prompt_tokens:
            self.prefill_s += step_s
            self.num_computed_prompt_tokens += prompt_tokens

    @property
    def reads_logits(self) -> bool:
        """Whether choosing its token needs more than the bare logits: shaping, a grammar, or log-probabilities."""
        return self.params.shapes_logits or self.params.logprobs is not None

    def row_contexts(self, drafts: list[int] = ()) -> tuple[int, list[RowContext]]:
        """Shaping contexts for the position after the text so far and after each draft in turn (a speculative
        verification scores them all at once). The grammar cuts the drafts at the first one it forbids: returns how
        many stay, and a context for each of their positions plus one. The grammar's state is left as it was."""
        seq, params = self.seq, self.params
        allowed: list = []
        legal = len(drafts)
        if self.grammar is not None:
            started = time.perf_counter()
            legal = 0
            while True:
                allowed.append(None if self.grammar.is_terminated() else self.grammar.allowed_ids())
                if legal == len(drafts) or not self.grammar.accept(drafts[legal]):
                    break
                legal += 1
            self.grammar.rollback(legal)
            self.grammar_s += time.perf_counter() - started
        shaping = params.shapes_logits
        return legal, [RowContext(params, seq.token_ids + list(drafts[:i]) if shaping else [], seq.num_prompt_tokens,
                                  self.ending_ids, allowed[i] if allowed else None) for i in range(legal + 1)]

    def legal_candidates(self, candidates: list[list[int]]) -> list[list[int]]:
        """A draft tree's candidates (`candidates[d]`: position d's tokens, best first) without the tokens the grammar
        forbids, so the target never sees them: position d keeps the candidates allowed after the best kept ones
        before it (the best of those becomes the chain's token), and the tree ends at a position with none left."""
        if self.grammar is None:
            return candidates
        started = time.perf_counter()
        kept: list[list[int]] = []
        for ranked in candidates:
            allowed = []
            for token in ranked:
                if self.grammar.accept(token):
                    allowed.append(token)
                    self.grammar.rollback(1)
            if not allowed or not self.grammar.accept(allowed[0]):  # the chain goes on through the best one
                break
            kept.append(allowed)
        self.grammar.rollback(len(kept))
        self.grammar_s += time.perf_counter() - started
        return kept

    def tree_contexts(self, tokens: list[int], parents: list[int]) -> list[RowContext]:
        """Shaping contexts for every node of a draft tree (node 0, the last token: the text so far; node i: after
        the path from the root down to it, `tokens[i - 1]` its token, `parents[i]` its parent), every node allowed by
        the grammar (`legal_candidates`). The grammar's state is left as it was."""
        paths: list[list[int]] = [[]]
        for node in range(1, len(parents)):
            paths.append(paths[parents[node]] + [tokens[node - 1]])
        allowed: list = [None] * len(paths)
        if self.grammar is not None:
            started = time.perf_counter()
            for node, path in enumerate(paths):
                accepted = sum(1 for _ in itertools.takewhile(self.grammar.accept, path))
                if accepted == len(path) and not self.grammar.is_terminated():
                    allowed[node] = self.grammar.allowed_ids()
                self.grammar.rollback(accepted)
            self.grammar_s += time.perf_counter() - started
        seq, shaping = self.seq, self.params.shapes_logits
        return [RowContext(self.params, seq.token_ids + path if shaping else [], seq.num_prompt_tokens,
                           self.ending_ids, allowed[node]) for node, path in enumerate(paths)]

    def record(self, token: int, step_s: float, batch_size: int, draft: str | None = None,
               rejected_ids: tuple[int, ...] = (), logprobs: TokenLogprobs | None = None,
               rejected_logprobs: tuple[float, ...] = ()) -> TokenEvent:
        """Append one generated token, extend the text, check the stop conditions (sets `finish_reason`)."""
        seq = self.seq
        seq.append(token)
        if self.grammar is not None and not self.grammar.is_terminated():
            started = time.perf_counter()
            self.grammar.accept(token)
            self.grammar_s += time.perf_counter() - started
        ends = token in self.ending_ids
        text = self.text + ("" if ends else self.detokenizer.add(token))
        stops = self.params.stop
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif ends:
            self.finish_reason = "stop"
        elif stops and (hit := _find_stop(text, stops, max(0, self.emitted - self.longest_stop))) >= 0:
            end = hit + (len(next(s for s in stops if text.startswith(s, hit)))
                         if self.params.include_stop_str_in_output else 0)
            text, self.finish_reason = text[:end], "stop"
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finish_reason = "stop"  # the output is complete (the grammar's end token is ignore_eos's)
        elif seq.num_generated_tokens >= self.params.max_new_tokens:
            self.finish_reason = "length"
        self.text = text
        # Hold back a tail that could still become a stop string.
        safe = len(text) if self.finish_reason else len(text) - _stop_prefix_len(text, stops)
        delta, self.emitted = text[self.emitted:safe], max(self.emitted, safe)
        first = seq.num_generated_tokens == 1
        if first:
            self.first_token_busy_s = self.busy_s
            self.first_token_compile_s = self.compile_s
            self.first_token_at = time.perf_counter()
        return TokenEvent(token, delta, seq.num_generated_tokens - 1, self.busy_s, step_s * 1e3, draft, rejected_ids,
                          self.cached_prompt_tokens if first else None, batch_size,
                          logprobs.logprob if logprobs else None, logprobs.top if logprobs else (),
                          logprobs.entropy if logprobs else None, rejected_logprobs,
                          self.prompt_logprobs if first else None)

    def stats(self, kv_mode: str, kv_usage: tuple[int, int], compile_stats: dict | None = None) -> GenerationStats:
        generated = self.seq.num_generated_tokens
        first_busy = self.first_token_busy_s if self.first_token_busy_s is not None else self.busy_s
        first_compile = self.first_token_compile_s if self.first_token_busy_s is not None else self.compile_s
        decode_s = self.busy_s - first_busy - (self.compile_s - first_compile)
        decode_tokens = max(generated - 1, 0)
        queue_s = (self.first_scheduled_at or time.perf_counter()) - self.submitted_at
        return GenerationStats(
            kv_mode=kv_mode, prompt_tokens=self.seq.num_prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens or 0, generated_tokens=generated,
            finish_reason=self.finish_reason or "stopped", ttft_ms=(first_busy - first_compile) * 1e3,
            prefill_tokens_per_s=self.num_computed_prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0,
            decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
            total_ms=self.busy_s * 1e3, kv_bytes_in_use=kv_usage[0], kv_bytes_reserved=kv_usage[1],
            spec=self.spec_stats.as_dict() if self.spec_stats is not None else None, preemptions=self.preemptions,
            queue_ms=queue_s * 1e3, batch_size_mean=self.batch_size_sum / self.steps if self.steps else 0.0,
            compile=None if compile_stats is None else {**compile_stats, "compile_s": self.compile_s},
            grammar_ms=self.grammar_s * 1e3)

    def finish_event(self, kv_mode: str, kv_usage: tuple[int, int], compile_stats: dict | None = None) -> FinishEvent:
        self.finished_at = time.perf_counter()
        return FinishEvent(self.text, self.seq.generated_token_ids, self.stats(kv_mode, kv_usage, compile_stats))


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int:
    hits = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    return min(hits) if hits else -1


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best
