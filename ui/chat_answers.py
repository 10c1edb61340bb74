"""A chat turn's answers beyond the chat log: every answer a turn samples (`n`, "answers per turn": the job's copies,
copy i sampling with the seed + i and sharing the prompt's KV blocks through the paged prefix cache), each token of
them with what the engine measured of the model's distribution, and the chat's KV view of them.

`TurnAnswers` follows one turn's requests as they stream (a text, a `ui.token_view.TokenTrail` and a final event per
answer); the first answer is the one the conversation keeps, the others are shown beside it. `ChatMemory` is what a
visitor's page keeps of its latest turn (a gr.State: the colour mode and the answers' trails), which the colour mode's
radio redraws without running the turn again. The panels are pure functions of those: `tokens_html` draws the kept
answer token by token with a CSS-only tooltip per token (its probability, the entropy, the top alternatives; the
chat's requests ask for them, `CHAT_SAMPLING`), `others_html` the other answers. `check_answers` refuses an `n` that
cannot give different answers (greedy decoding) or that the chat cannot run (an external engine answers one).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent
from inference_core.settings import LaneSettings
from serving.admission import Run
from ui.kv_view import pool_counts, render_pool
from ui.race import TOP_ALTERNATIVES
from ui.token_view import COLOUR_MODES, TokenTrail

MAX_ANSWERS = 4
# What every chat request asks of the engine besides the chat's settings: its tokens' top log-probabilities (computed
# in the batched sampling step for the requests that ask; docs/benchmarks.md measures the cost at batch 1 within 2%).
CHAT_SAMPLING = {"logprobs": TOP_ALTERNATIVES}
DEFAULT_MODE = "probability"  # the chat rarely speculates: its tokens' probabilities are what the panel is for
TOKENS_HELP = ("hover or tap a token for its probability, the entropy and the model's top "
               f"{TOP_ALTERNATIVES} alternatives")
TOKENS_EMPTY = f"<p><b>The answer, token by token</b>, appears here when a turn ends: {TOKENS_HELP}.</p>"
TOKENS_WAITING = "<p>The answer's tokens appear here when the turn ends.</p>"
EXTERNAL_KV = "<p>An external engine answered this turn; its KV cache is not visible from here.</p>"
NO_POOL = "<p>This configuration has no paged KV pool; pick the paged KV mode to watch its blocks.</p>"


@dataclass
class ChatMemory:
    """One visitor's latest turn, kept in a `gr.State`: the colour mode of its tokens (`COLOUR_MODES`) and its
    answers' token trails, the kept answer first (None while a turn runs, before the first, or when an external
    engine answered)."""

    mode: str = DEFAULT_MODE
    answers: list[TokenTrail] | None = None


def check_answers(answers, settings: LaneSettings) -> int:
    """The number of answers a turn samples, from the page's "answers per turn (n)"; a ConfigError (page words:
    `{answers}`, `{temperature}`, `{endpoint}`) when it is out of range or cannot give different answers."""
    try:
        count = int(answers)
    except (TypeError, ValueError):
        raise ConfigError(f"{{answers}} must be a whole number from 1 to {MAX_ANSWERS}, got {answers!r}.") from None
    if not 1 <= count <= MAX_ANSWERS:
        raise ConfigError(f"{{answers}} must be 1 to {MAX_ANSWERS}, got {count}.")
    if count > 1 and settings.external:
        raise ConfigError("{answers} above 1 runs on this app's engine only: an external engine answers once. Set "
                          "{answers} to 1 or clear {endpoint}.")
    if count > 1 and settings.greedy:
        raise ConfigError(f"{{answers}} is {count} but {{temperature}} is 0 (greedy decoding): all {count} answers "
                          "would be the same tokens. Raise {temperature} to compare sampled answers (answer i "
                          "samples with the seed + i), or set {answers} to 1.")
    return count


class TurnAnswers:
    """One turn's answers as they stream, by the engine loop's handle: each answer's text, token trail (None for an
    external engine) and final event; the first to finish, whose KV picture at its last token the KV view shows
    (every other answer still held its blocks then)."""

    def __init__(self, run: Run):
        self.engine = run.engines.get("chat")  # None: an external engine answers, and nothing of it lives in ours
        self.requests = run.requests.get("chat", [])
        self.count = max(1, len(self.requests))
        self.index_of = {id(handle): index for index, handle in enumerate(run.handles)}
        self.texts = [""] * self.count
        self.trails: list[TokenTrail] | None = None
        if self.engine is not None:
            decode = self.engine.tokenizer.decode
            speculates = run.job.lanes["chat"][1].speculates
            self.trails = [TokenTrail(decode, speculates, spell=lambda ids: decode(ids, skip_special_tokens=False))
                           for _ in range(self.count)]
        self.finished: list[FinishEvent | None] = [None] * self.count
        self.first_finished = None  # the Request that finished first

    def add(self, handle, event) -> None:
        index = self.index_of.get(id(handle), 0)
        if isinstance(event, FinishEvent):
            self.finished[index], self.texts[index] = event, event.text
            if self.trails is not None:
                self.trails[index].finish(event.text)
            if self.first_finished is None and self.requests:
                self.first_finished = self.requests[index]
            return
        self.texts[index] += event.text
        if self.trails is not None:
            self.trails[index].add(event)

    def labels(self) -> dict[int, str]:
        """The KV view's names for this turn's requests (the pool's other requests stay anonymous)."""
        if self.count == 1:
            return {request.seq.seq_id: "this turn" for request in self.requests}
        return {request.seq.seq_id: f"answer {index}" for index, request in enumerate(self.requests, 1)}

    def live_kv(self, pool) -> str:
        """The chat engine's pool now, read between the loop's steps."""
        if self.engine is None:
            return EXTERNAL_KV
        snapshot = pool.loop.call(self.engine.kv_snapshot)
        if snapshot is None:
            return NO_POOL
        return render_pool(snapshot, self.engine.tokenizer.decode, "Chat paged pool", self.labels())

    def final_kv(self, pool) -> str:
        """The pool at the last token of the answer that finished first (the answers' shared prompt blocks marked
        xN), then how the pool stands now that every answer has returned its blocks."""
        snapshot = getattr(self.first_finished, "final_kv_snapshot", None)
        if snapshot is None:
            return self.live_kv(pool)
        when = "at its last token" if self.count == 1 else "at the last token of the first answer to finish"
        page = render_pool(snapshot, self.engine.tokenizer.decode, f"Chat paged pool ({when})", self.labels())
        held, cached, free = pool_counts(pool.loop.call(self.engine.kv_snapshot))
        return page + (f'<p class="kv-after">Since then this turn\'s {_requests(self.count)} returned their blocks: '
                       f"the pool now has {held} blocks held, {cached} cached for reuse and {free} free.</p>")

    def shared_blocks(self) -> int | None:
        """Blocks every answer held at once (the prompt's full blocks, through the prefix cache), read from the
        first finisher's KV picture; None without one."""
        snapshot = getattr(self.first_finished, "final_kv_snapshot", None)
        if snapshot is None:
            return None
        ids = {request.seq.seq_id for request in self.requests}
        return sum(ids <= set(block["owners"]) for block in snapshot["blocks"] if block["state"] == "used")

    def note(self) -> str:
        """The status line's words on several answers: where the others are, and how many KV blocks they all held
        at once ("" for one answer)."""
        if self.count == 1:
            return ""
        shared = self.shared_blocks()
        everyone = "Both answers" if self.count == 2 else f"All {self.count} answers"
        sharing = "" if shared is None else (
            f" {everyone} held the prompt's {shared} full KV blocks at once (x{self.count} in the KV view)."
            if shared else f" They shared no KV block: {self._no_sharing_reason()}.")
        return (f" {self.count} answers were sampled (answer i with the seed + i); the conversation keeps the first, "
                f"the other{'s are' if self.count > 2 else ' is'} under 'Other answers'.{sharing}")

    def _no_sharing_reason(self) -> str:
        if not self.engine.shares_prompts:
            return "copies share the prompt's blocks with the paged KV cache, the prefix cache and continuous batching"
        return "the prompt is shorter than one full block"


def _requests(count: int) -> str:
    return "request" if count == 1 else f"{count} requests"


def tokens_html(memory: ChatMemory) -> str:
    """The kept answer of the latest turn, token by token in the memory's colour mode, a tooltip per token."""
    if not memory.answers:
        return TOKENS_EMPTY
    trail = memory.answers[0]
    return (f'<div class="chat-tokens"><b>The answer, token by token</b>: {TOKENS_HELP}.{trail.legend(memory.mode)}'
            f'<div class="chat-tokens-text" style="white-space:pre-wrap;margin-top:6px;max-height:240px;'
            f'overflow-y:auto">{trail.html(memory.mode, tips=True)}</div></div>')


def others_html(trails: list[TokenTrail] | None, texts: list[str], mode: str, ended: bool) -> str:
    """The answers after the first ("answer 2" ... "answer n"), each token with its tooltip once the turn has ended
    (plain text while it streams); empty for a turn of one answer."""
    if len(texts) < 2:
        return ""
    items = []
    for index in range(1, len(texts)):
        body = trails[index].html(mode, tips=ended) if trails is not None else html.escape(texts[index])
        items.append(f'<div class="chat-other" data-answer="{index + 1}" style="flex:1 1 260px;padding-left:8px;'
                     f'border-left:3px solid #94a3b8"><b>Answer {index + 1}</b> (sampled with the seed + {index})'
                     f'<div style="white-space:pre-wrap;margin-top:4px;max-height:240px;overflow-y:auto">{body}'
                     "</div></div>")
    # Side by side, to compare; each at least 260 px wide, so they wrap one under the other on a phone.
    return (f'<details class="chat-others" open><summary>Other answers ({len(texts) - 1}): the conversation keeps '
            f'answer 1</summary><div style="display:flex;flex-wrap:wrap;gap:12px;margin-top:6px">{"".join(items)}'
            "</div></details>")


def remembered_others(memory: ChatMemory) -> str:
    """The latest turn's other answers from the visitor's memory, in its colour mode."""
    if not memory.answers:
        return ""
    texts = ["".join(mark.text for mark in trail.marks) for trail in memory.answers]
    return others_html(memory.answers, texts, memory.mode, ended=True)


def recolour_chat(memory: ChatMemory, mode: str):
    """The colour mode's radio: keep the mode and redraw the latest turn's answers (nothing while a turn runs)."""
    memory.mode = mode if mode in COLOUR_MODES else DEFAULT_MODE
    if memory.answers is None:
        return gr.skip(), gr.skip()
    return tokens_html(memory), remembered_others(memory)
