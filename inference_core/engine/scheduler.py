"""The scheduler: which requests run in the next engine step, and how many tokens each forwards.

It owns two queues and nothing else: `waiting` (submitted or preempted, ordered by priority, then by arrival) and
`running` (requests that hold KV placement, in admission order). It asks the KV cache (`inference_core.kv.cache`)
whether a sequence fits and never touches tensors or text. One `schedule()`:

1. Running requests, highest priority first (a lower number runs first; then the earliest admitted): each decoding
   sequence gets one token, a sequence still in its prompt gets the next chunk of it, within the step's token budget
   (`max_num_batched_tokens`; without chunked prefill a prompt is never split, but one that exceeds the budget runs
   alone). A sequence that needs a new KV block when none is free preempts a victim: the lowest-priority, most
   recently admitted running request (possibly itself). Preemption is by recompute: the victim's blocks are freed
   (its full blocks stay in the prefix cache), its tokens so far are kept, and it goes back to the waiting queue; when
   it is admitted again it recomputes its KV, reusing whatever prefix blocks are still cached.
2. Waiting requests, in queue order, while the batching mode admits (`BATCHING_MODES`), fewer than `max_num_seqs` run,
   the budget lasts, and the KV cache can place them.

Batching modes (the classic comparison, over the same engine):
- `continuous`: iteration level; a request joins the running batch at any step where it fits (or, with
  `join_every` N, at a step where it fits once N steps have run since requests last joined), and leaves it the
  step it finishes.
- `dynamic`: a batch is formed once the running one has wholly finished, from what is waiting, as soon as
  `max_num_seqs` requests wait or the oldest has waited `batch_window_ms`; it runs to completion.
- `static`: fixed batches of `max_num_seqs` in arrival order; a batch starts once it is full (or no more requests
  are coming: `drain()`) and the previous one has wholly finished, so every member waits for the longest one. The
  batch is padded, as a rectangular batch is: each prompt is computed as long as the batch's longest (padding
  tokens after it, `Request.prompt_padding`), and a member that finishes keeps its row: it gets its final event,
  but its sequence stays in the batch (`padding`), decoding a padding token every step and holding its KV, until
  the whole batch has finished.
- `none`: one request at a time, in queue order.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass

from inference_core.config import BATCHING_MODES
from inference_core.engine.request import Request
from inference_core.kv.cache import KVCache
from inference_core.sequence import PAD_TOKEN, Sequence

__all__ = ["BATCHING_MODES", "ScheduledWork", "Scheduler", "SchedulerOutput"]


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    request: Request
    num_tokens: int  # tokens this step forwards for the request (1 for a decode, more for a prefill chunk)
    kind: str  # "prefill" (prompt or recomputed tokens, possibly a chunk), "decode" or "speculative"


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    work: list[ScheduledWork]
    preempted: list[Request]


class Scheduler:
    def __init__(self, kv_cache: KVCache, batching: str = "continuous", max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 2048, chunked_prefill: bool = True, batch_window_ms: float = 50.0,
                 join_every: int = 1):
        self.kv_cache = kv_cache
        self.batching = batching
        self.max_num_seqs = 1 if batching == "none" else max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill and kv_cache.kv_mode != "none"
        self.batch_window_s = batch_window_ms / 1e3
        self.join_every = join_every
        self._steps_since_join = 0  # continuous: steps run while requests waited without joining
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.padding: list[Sequence] = []  # static: finished members' rows, still computed until the batch ends
        self.draining = False  # static batches: no more requests are coming, so a partial batch may start
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self._order: dict[int, int] = {}  # request id -> arrival number (kept across preemptions)
        self._admitted: dict[int, int] = {}  # request id -> admission number (of its latest admission)

    # --- queues ---------------------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._order.setdefault(request.request_id, next(self._arrivals))
        request.state = "waiting"
        keys = [self._queue_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._queue_key(request)), request)

    def _queue_key(self, request: Request) -> tuple[int, int]:
        return request.priority, self._order[request.request_id]

    def _running_key(self, request: Request) -> tuple[int, int]:
        return request.priority, self._admitted[request.request_id]

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (finished or cancelled), releasing its KV placement."""
        if request in self.running:
            self.running.remove(request)
            self.kv_cache.free(request.seq)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._order.pop(request.request_id, None)
        self._admitted.pop(request.request_id, None)

    def keeps_row(self) -> bool:
        """Whether a request that finishes now leaves a padding row (static batching, batch still running)."""
        return self.batching == "static" and len(self.running) > 1

    def retire_to_padding(self, request: Request) -> None:
        """Static batching: the finished request leaves the queues, but its sequence (and KV) stays as a padding
        row until the batch ends."""
        self.running.remove(request)
        self._order.pop(request.request_id, None)
        self._admitted.pop(request.request_id, None)
        self.padding.append(request.seq)

    def pad_rows(self) -> list[Sequence]:
        """The padding rows that decode in this step, each given its next (padding) token; a row the pool cannot
        grow any more is dropped. When the batch has ended, every padding row's KV goes back."""
        if not self.running:
            self.free_padding()
            return []
        for seq in list(self.padding):
            if not self.kv_cache.can_append(seq, len(seq) + 1):
                self.padding.remove(seq)
                self.kv_cache.free(seq)
                continue
            seq.append(PAD_TOKEN)
            self.kv_cache.ensure_capacity(seq)
        return list(self.padding)

    def free_padding(self) -> None:
        for seq in self.padding:
            self.kv_cache.free(seq)
        self.padding.clear()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def drain(self) -> None:
        """No more requests are coming: a static batch may start with fewer than max_num_seqs members."""
        self.draining = True

    # --- one step -------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        work: list[ScheduledWork] = []
        preempted: list[Request] = []
        # 1. Running requests, highest priority first.
        for request in sorted(self.running, key=self._running_key):
            if request not in self.running:  # preempted earlier in this loop
                continue
            seq = request.seq
            remaining = len(seq) - seq.num_computed_tokens
            num_tokens = self._tokens_to_run(remaining, budget, bool(work))
            if num_tokens == 0:
                continue
            while not self.kv_cache.can_append(seq, seq.num_computed_tokens + num_tokens):
                victim = max(self.running, key=self._running_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request not in self.running:
                continue
            # Take the new block now, not in the forward: can_append does not reserve, so two decodes crossing a
            # block boundary in one step with one block free would both pass and the second forward would fail.
            self.kv_cache.ensure_capacity(seq)
            work.append(ScheduledWork(request, num_tokens, self._kind(request, remaining)))
            budget -= num_tokens
        # 2. Admit waiting requests while the mode, the sequence limit, the budget and the KV cache allow. A batch
        # mode (static, dynamic) admits its whole batch at once: members the budget leaves out of this step start
        # their prompts in the next steps, still members of the batch.
        admitted = []
        if self._admits(bool(self.running)):
            whole_batch = self.batching in ("static", "dynamic")
            while self.waiting and len(self.running) < self.max_num_seqs and (budget > 0 or whole_batch):
                request = self.waiting[0]
                seq = request.seq
                if not self.chunked_prefill and work and len(seq) > budget and not whole_batch:
                    break  # an unsplittable prompt waits for a step with room for all of it
                source = request.prompt_source
                if source is not None and not (source.finished or source.seq.num_generated_tokens):
                    break  # a copy (n > 1) waits for the first copy's prompt, then shares its blocks
                if not self.kv_cache.can_allocate(seq):
                    break
                self.waiting.pop(0)
                self.kv_cache.allocate(seq)
                self.running.append(request)
                admitted.append(request)
                request.state = "running"
                self._admitted[request.request_id] = next(self._admissions)
                num_tokens = self._tokens_to_run(len(seq) - seq.num_computed_tokens, budget, bool(work))
                if num_tokens:
                    work.append(ScheduledWork(request, num_tokens, "prefill"))
                    budget -= num_tokens
            if self.batching == "static":
                self._pad_prompts(admitted)
            if not self.waiting:
                self.draining = False  # the drained requests are all in: later ones form full batches again
        if admitted:
            self._steps_since_join = 0
        elif self.waiting:
            self._steps_since_join += 1
        return SchedulerOutput(work, preempted)

    @staticmethod
    def _pad_prompts(batch: list[Request]) -> None:
        """A static batch is padded: each new prompt is computed as long as the batch's longest, PAD_TOKENs after
        it, forwarded with its last chunk (outside the token budget, like a padded batch's one rectangular prefill).
        A request resumed after a preemption only recomputes its own tokens."""
        fresh = [request for request in batch if request.seq.num_generated_tokens == 0]
        longest = max((len(request.seq) for request in fresh), default=0)
        for request in fresh:
            request.prompt_padding = longest - len(request.seq)

    def _kind(self, request: Request, remaining: int) -> str:
        """A running request's work: "decode" (or "speculative") once its text is computed but the newest token
        (mode none: its whole text again, once it has generated), else "prefill" (its prompt, or a recompute after a
        preemption)."""
        seq = request.seq
        cached_decode = remaining == 1 and seq.num_computed_tokens > 0
        if cached_decode or (self.kv_cache.kv_mode == "none" and seq.num_generated_tokens > 0):
            return "speculative" if request.speculates else "decode"
        return "prefill"

    def _tokens_to_run(self, remaining: int, budget: int, others: bool) -> int:
        """Tokens a sequence with `remaining` uncomputed tokens forwards this step. Mode none forwards the whole
        text every step; otherwise a chunk within the budget, or (no chunked prefill) all or nothing, except that
        a sequence alone in its step always runs whole."""
        if self.kv_cache.kv_mode == "none" or not others:
            return remaining if not self.chunked_prefill else min(remaining, max(budget, 1))
        if self.chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _admits(self, busy: bool) -> bool:
        """Whether the batching mode lets waiting requests in now."""
        if self.batching == "continuous":
            return not busy or self._steps_since_join + 1 >= self.join_every
        if busy or not self.waiting:
            return False  # none, static and dynamic run a batch to completion before forming the next
        if self.batching == "none":
            return True
        full = len(self.waiting) >= self.max_num_seqs
        if self.batching == "static":
            return full or self.draining
        oldest = min(request.submitted_at for request in self.waiting)
        return full or self.draining or time.perf_counter() - oldest >= self.batch_window_s

    def seconds_until_admission(self) -> float:
        """How long until the batching mode would let a waiting request in: 0 for now, inf for never on its own (a
        static batch that is not full waits for more requests or `drain()`; any mode waits while a batch runs to
        completion). Dynamic batching: until the oldest waiting request has waited the batch window."""
        if not self.waiting or self._admits(bool(self.running)):
            return 0.0
        if self.batching != "dynamic" or self.running:
            return math.inf
        oldest = min(request.submitted_at for request in self.waiting)
        return max(0.0, oldest + self.batch_window_s - time.perf_counter())

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free the KV, keep the tokens, queue the request again (ahead of later arrivals of
        its priority, since it keeps its arrival number)."""
        self.running.remove(request)
        self.kv_cache.free(request.seq)
        request.seq.num_computed_tokens = 0
        request.preemptions += 1
        self._admitted.pop(request.request_id, None)
        self.add(request)
