"""Speculation where it pays: whether a step's speculating requests draft, from what the engine measured.

A verification forwards k + 1 tokens for each speculating request where a plain step forwards one. At batch 1 on a
CPU that costs little more than a plain step (the weights are read once either way), but as the batch grows the
forward turns compute-bound, and a verification then costs about what its tokens cost: speculation gives back less
than it spends (vLLM turns it off above a batch size it is told, `disable_by_batch_size`). Here the engine measures
instead of being told. For each size of the group of speculating requests it keeps its last `SAMPLES` steps of each
kind, the tokens each produced and its wall time (drafting, verification and rollback included for a speculative
step), and a group drafts in a step unless its plain steps' rate is higher than its speculative steps'.

- A kind's rate is its steps' mean tokens over their median time. A verification costs about the same whatever it
  accepts, while its tokens swing between one a request (nothing accepted) and k + 1: the median of each step's own
  rate read the many steps that accept nothing and missed those that accept everything (16 grounded requests with
  prompt lookup, 4 a step, went plain for 669 request-steps where drafting every step ran about 1.3x plain). A
  median time is not moved by a step the host delayed.
- A kind not yet measured at that size runs first, `MEASURE_FIRST` steps, speculation before plain steps, as the
  user asked for it (one verification that happened to accept nothing once turned speculation off until the next
  try, 31 steps later).
- The losing kind runs again every `EXPLORE_EVERY` steps, so that a batch whose prompts or lengths change can win
  back what it lost. Steps that compiled or loaded a package are not measured, and a speculative step's time leaves
  out its EAGLE drafters' catch-up on the positions plain steps computed (past the draft packages' largest): a
  group that drafts every step never spends it, and charged to the step that returns to drafting after 32 plain
  ones, it kept 4 EAGLE requests plain for good where drafting every step ran 1.08x plain.

Only groups of at least `MIN_BATCH` greedy requests are decided so. Greedy speculation yields exactly plain greedy's
tokens, so the choice changes speed alone; a group with a sampling request always drafts, so that its seeded draws
stay the same from run to run, whatever the host's timings. A lone request drafts as it asked: at batch 1 a
verification costs about a plain step on a CPU, and what speculation gains or loses there is what the playground's
race shows (with a note where few drafts are accepted).
"""

from __future__ import annotations

import statistics
from collections import deque

SAMPLES = 8  # the steps of one kind and batch size whose tokens and times give that kind's rate
EXPLORE_EVERY = 32  # a decided batch size runs the losing kind once in this many steps
MEASURE_FIRST = 4  # the steps of each kind measured before the rates decide: one verification's tokens say little
MIN_BATCH = 2  # the fewest speculating requests in a step whose drafting is decided by measurement


class SpeculationPolicy:
    """Measured token rates of plain and speculative steps by the size of the speculating group (`record`), and the
    choice between them (`plain_reason`)."""

    def __init__(self) -> None:
        self._steps: dict[tuple[int, bool], deque[tuple[int, float]]] = {}  # (tokens, seconds) by batch, kind
        self._decided_steps: dict[int, int] = {}

    def rate(self, batch: int, speculative: bool) -> float | None:
        """Tokens per second of `batch` requests' recent steps of one kind: their mean tokens over their median time
        (None before any)."""
        steps = self._steps.get((batch, speculative))
        if not steps:
            return None
        return statistics.fmean(tokens for tokens, _ in steps) / statistics.median(seconds for _, seconds in steps)

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """One step of `batch` speculating requests: whether they drafted, the tokens it produced and its wall time."""
        if seconds > 0:
            self._steps.setdefault((batch, speculative), deque(maxlen=SAMPLES)).append((tokens, seconds))

    def measured(self, batch: int, speculative: bool) -> int:
        """How many of `batch` requests' recent steps of one kind were measured (at most SAMPLES)."""
        return len(self._steps.get((batch, speculative), ()))

    def plain_reason(self, batch: int) -> str | None:
        """Why `batch` greedy speculating requests take a plain step this time (None: they draft)."""
        if batch < MIN_BATCH or self.measured(batch, True) < MEASURE_FIRST:
            return None  # speculation, as asked, until it is measured
        drafting, plain = self.rate(batch, True), self.rate(batch, False)
        step = self._decided_steps[batch] = self._decided_steps.get(batch, 0) + 1
        if self.measured(batch, False) < MEASURE_FIRST:
            return (f"measuring plain steps at batch {batch} against speculative ones ({drafting:.1f} tokens/s so "
                    f"far)")
        explore = step % EXPLORE_EVERY == 0  # the losing kind once in a while: what it measured may be stale
        if plain > drafting and not explore:
            return (f"at batch {batch} plain steps produce {plain:.1f} tokens/s, speculative ones {drafting:.1f} "
                    f"(their last {SAMPLES} steps each)")
        if plain <= drafting and explore:
            return f"measuring plain steps at batch {batch} again (speculative ones lead: {drafting:.1f} tokens/s)"
        return None
