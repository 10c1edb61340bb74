"""What the race shows, as pure functions of the lanes' traces: each lane's header and text, the speed-up line and
plain-language notes, the lossless check and the KV view (the summary table is `ui.race_table`).

Every number comes from one `LaneFigures` per lane, taken once per refresh from the lane's trace (the engine's final
stats once the lane has finished or stopped, its streamed events before that), so the lane header, the summary table
and the speed-up line always show the same numbers. Every speed-up clause names the lane that wins and the two
numbers it is computed from, so it cannot point the wrong way.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from inference_core import Engine, FinishEvent, GenerationStats
from inference_core.engine.loop import EngineLoop
from inference_core.engine.request import Request
from inference_core.settings import KV_MODE_LABELS, SPEC_METHOD_LABELS, LaneSettings
from ui.figures import LANE_COLOURS
from ui.kv_view import pool_counts, render_pool
from ui.speculation import AcceptanceCount
from ui.token_view import TokenTrail

FINISH_REASONS = {"length": "max new tokens reached", "eos": "end of text", "stop": "stop string",
                  "stopped": "stopped"}
LOW_ACCEPTANCE = 0.25  # a speculating lane below this share of accepted drafts gets a note on why it loses
WHY_DRAFTS_FAIL = {
    "early-exit": "this model's first layers were not trained to predict its output, so they rarely agree with "
                  "the full model (early exit pays off on models trained for it)",
    "ngram": "prompt lookup only finds drafts where the answer repeats the prompt (try a grounded prompt)",
    "draft": "the draft model rarely agrees with the target",
    "medusa": "the heads were trained on this model's chat answers; other kinds of text get fewer right",
    "eagle": "the layer was trained on this model's chat answers; other kinds of text get fewer right",
}


@dataclass(frozen=True)
class LaneFigures:
    """One lane's numbers at one moment; None where not measured yet."""

    tokens: int
    state: str  # "waiting", "running", "not started", or a finish reason (FINISH_REASONS)
    prompt_tokens: int
    cached_prompt_tokens: int | None
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    device_s: float | None
    last_step_ms: float | None
    acceptance_rate: float | None  # speculating lanes, once they have drafted
    stats: GenerationStats | None

    @property
    def ended(self) -> bool:
        return self.state not in ("waiting", "running")

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.prompt_tokens / (self.ttft_ms / 1e3) if self.ttft_ms else None


@dataclass
class LaneTrace:
    """What one lane has produced so far: plain values only."""

    name: str
    settings: LaneSettings
    engine: Engine | None  # None: an external engine (`serving.remote`), of which only the streamed text is seen
    prompt_tokens: int
    loop: EngineLoop | None = None  # the engine loop that steps `engine` (its state is read between steps)
    request: Request | None = None  # this lane's request: the only one whose text the KV view shows
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # own-clock time of each token
    step_ms: list[float] = field(default_factory=list)  # the step that produced each token (0: same step as before)
    cached_prompt_tokens: int | None = None
    stats: GenerationStats | None = None
    over: bool = False  # the race has ended for this lane (set also when it never took a step)
    kv_html: str = ""
    tokens: TokenTrail | None = None  # every token with what the engine measured of it (None: an external lane)
    acceptance: AcceptanceCount | None = None  # speculating lanes only
    shown: LaneFigures | None = None  # the figures of the latest panel refresh: what the page shows

    def __post_init__(self) -> None:
        if self.engine is not None:
            decode = self.engine.tokenizer.decode
            self.tokens = TokenTrail(decode, self.settings.speculates,
                                     spell=lambda ids: decode(ids, skip_special_tokens=False))
        if self.settings.speculates:
            self.acceptance = AcceptanceCount()

    def add(self, event) -> None:
        if isinstance(event, FinishEvent):
            self.text, self.token_ids, self.stats = event.text, list(event.token_ids), event.stats
            self.over = True
            if self.tokens is not None:
                self.tokens.finish(event.text)
            if self.acceptance is not None:
                self.acceptance.finish(event.stats.spec)
            return
        self.text += event.text
        self.token_ids.append(event.token_id)
        self.times_s.append(event.time_s)
        self.step_ms.append(event.step_ms)
        if event.cached_prompt_tokens is not None:
            self.cached_prompt_tokens = event.cached_prompt_tokens
        if self.tokens is not None:
            self.tokens.add(event)
        if self.acceptance is not None:
            self.acceptance.add(event)

    def figures(self) -> LaneFigures:
        """The lane's numbers now: the engine's stats once it has them, else measured from the streamed events."""
        steps = [ms for ms in self.step_ms if ms > 0]
        drafted = self.acceptance is not None and self.acceptance.drafted
        common = dict(tokens=len(self.token_ids), prompt_tokens=self.prompt_tokens,
                      last_step_ms=steps[-1] if steps else None, stats=self.stats,
                      acceptance_rate=self.acceptance.shown()["acceptance_rate"] if drafted else None)
        if self.stats is not None:
            s = self.stats
            return LaneFigures(state=s.finish_reason, cached_prompt_tokens=s.cached_prompt_tokens, ttft_ms=s.ttft_ms,
                               decode_tokens_per_s=s.decode_tokens_per_s or None, device_s=s.total_ms / 1e3,
                               **common)
        decode = None
        if len(self.times_s) >= 2 and self.times_s[-1] > self.times_s[0]:
            decode = (len(self.times_s) - 1) / (self.times_s[-1] - self.times_s[0])
        state = ("not started" if self.over else "waiting") if not self.times_s else "running"
        return LaneFigures(state=state, cached_prompt_tokens=self.cached_prompt_tokens,
                           ttft_ms=self.times_s[0] * 1e3 if self.times_s else None, decode_tokens_per_s=decode,
                           device_s=self.times_s[-1] if self.times_s else None, **common)

    def refresh(self) -> LaneFigures:
        self.shown = self.figures()
        return self.shown

    def _kv_snapshot(self) -> dict | None:
        if self.engine is None:
            return None
        return self.loop.call(self.engine.kv_snapshot) if self.loop is not None else self.engine.kv_snapshot()

    def snapshot_kv(self) -> None:
        """Redraw the KV view: live while the request runs; once it has finished, the picture the engine took at
        its last token (`Request.final_kv_snapshot`: the step that finished it gave its blocks back)."""
        final = self.stats is not None and self.request is not None
        snapshot = self.request.final_kv_snapshot if final else self._kv_snapshot()
        if snapshot is not None:
            labels = {self.request.seq.seq_id: f"Lane {self.name}"} if self.request is not None else None
            when = "at its last token" if final else "after the race" if self.over else "live"
            self.kv_html = render_pool(snapshot, self.engine.tokenizer.decode,
                                       f"Lane {self.name} paged pool ({when})", labels)

    def note_pool_after(self) -> None:
        """After the race: add to the KV view how the pool stands now that the request has returned its blocks."""
        snapshot = self._kv_snapshot()
        if snapshot is not None and self.kv_html:
            held, cached, free = pool_counts(snapshot)
            self.kv_html += (f'<p class="kv-after">Since then lane {self.name}\'s request returned its blocks: the '
                             f"pool now has {held} blocks held, {cached} cached for reuse and {free} free.</p>")


def _state_words(figures: LaneFigures) -> str:
    if figures.state == "waiting":
        return "waiting for its first step"
    if figures.state == "running":
        return "running"
    if figures.state == "not started":
        return "stopped before its first step"
    return f"done ({FINISH_REASONS[figures.state]})" if figures.state != "stopped" else "stopped"


def lane_html(trace: LaneTrace, name: str, mode: str = "draft") -> str:
    """A lane's header (its configuration and the numbers of the latest panel refresh) over its text, which scrolls
    in a box that stays at the newest line. The text is coloured in `mode` (`ui.token_view.COLOUR_MODES`); once the
    lane has ended each token has a tooltip."""
    colour = LANE_COLOURS[name]
    figures = trace.shown or trace.refresh()
    numbers = [f"{figures.tokens} tokens"]
    if figures.ttft_ms is not None:
        numbers.append(f"TTFT {figures.ttft_ms:.0f} ms")
    if figures.decode_tokens_per_s:
        numbers.append(f"{figures.decode_tokens_per_s:.1f} tok/s")
    if figures.acceptance_rate is not None:
        numbers.append(f"{figures.acceptance_rate:.0%} of drafts accepted")
    numbers.append(_state_words(figures))
    legend, text = "", html.escape(trace.text)
    if trace.tokens is not None:
        legend, text = trace.tokens.legend(mode), trace.tokens.html(mode, tips=figures.ended)
    return (f'<div class="lane" data-done="{"true" if figures.ended else "false"}" data-state="{figures.state}" '
            f'style="border-left:4px solid {colour};padding-left:8px"><b>Lane {name}</b>: '
            f'{html.escape(trace.settings.describe())}<div class="lane-numbers" style="font-size:12px;'
            f'color:#475569">{", ".join(numbers)}</div>{legend}'
            # column-reverse keeps the box scrolled to its newest line as text streams in
            f'<div class="lane-text" style="white-space:pre-wrap;margin-top:6px;max-height:240px;overflow-y:auto;'
            f'display:flex;flex-direction:column-reverse"><div>{text}</div></div></div>')


def _compare(what: str, ratio: float, better: str, worse: str, numbers: str, kind: str) -> str:
    """One clause of the speed-up line: `ratio` > 1 means lane A wins."""
    if round(ratio, 2) == 1.0:
        verdict = "the same"
    elif ratio > 1:
        verdict = f"{ratio:.2f}x {better}"
    else:
        verdict = f"{1 / ratio:.2f}x {worse}"
    return f'<span data-figure="{kind}" data-ratio="{ratio:.4f}">{what} <b>{verdict}</b> ({numbers})</span>'


def speedup_html(figures: list[LaneFigures]) -> str:
    a, b = figures
    clauses = []
    if a.ttft_ms and b.ttft_ms:
        clauses.append(_compare("first token", b.ttft_ms / a.ttft_ms, "sooner", "later",
                                f"{a.ttft_ms:.0f} vs {b.ttft_ms:.0f} ms", "ttft"))
    if a.decode_tokens_per_s and b.decode_tokens_per_s:
        clauses.append(_compare("decode", a.decode_tokens_per_s / b.decode_tokens_per_s, "faster", "slower",
                                f"{a.decode_tokens_per_s:.1f} vs {b.decode_tokens_per_s:.1f} tok/s", "decode"))
    if not clauses:
        return ""
    return f'<p class="race-speedup">Lane A against lane B: {"; ".join(clauses)}.</p>'


def race_notes(traces: list[LaneTrace], figures: list[LaneFigures]) -> list[tuple[str, str]]:
    """Plain sentences on why a lane wins or loses, each from measured numbers: (kind, HTML)."""
    notes = []
    for index, trace in enumerate(traces):
        other, f, g = traces[1 - index], figures[index], figures[1 - index]
        name, other_name = trace.name, other.name
        if f.cached_prompt_tokens:
            notes.append(("prefix-cache", f"Lane {name} found {f.cached_prompt_tokens} of its {f.prompt_tokens} "
                          "prompt tokens in its prefix cache (KV kept from earlier requests on this lane, the app's "
                          "start-up warm-up included), so its prefill computed only "
                          f"{f.prompt_tokens - f.cached_prompt_tokens}."))
        elif (f.cached_prompt_tokens == 0 and trace.settings.kv_mode == "paged" and trace.settings.prefix_cache
              and other.settings.kv_mode == "paged" and not other.settings.prefix_cache):
            notes.append(("prefix-cache-empty", f"Lane {name}'s prefix cache held none of this prompt yet: it keeps "
                          "what earlier requests on this lane computed. Run the race again, or pick another question "
                          f"with the same system prompt, and lane {name} reuses those blocks."))
        if trace.acceptance is not None and f.ended:
            counts = trace.acceptance.shown()
            slower = f.decode_tokens_per_s and g.decode_tokens_per_s and f.decode_tokens_per_s < g.decode_tokens_per_s
            if counts["drafted"] >= 10 and counts["acceptance_rate"] < LOW_ACCEPTANCE and slower:
                method = trace.settings.spec_method
                notes.append(("low-acceptance", f"Lane {name} loses because only {counts['acceptance_rate']:.0%} of "
                              f"its {SPEC_METHOD_LABELS.get(method, method)} drafts were accepted "
                              f"({counts['accepted']} of {counts['drafted']}): every step paid for drafting and "
                              f"verifying yet kept about one token, and {WHY_DRAFTS_FAIL.get(method, '')}."))
        spec = f.stats.spec if f.ended and f.stats is not None else None
        if spec and spec.get("plain_steps"):
            notes.append(("speculation-off", f"Lane {name} drafted in {spec['steps']} of its steps and took "
                          f"{spec['plain_steps']} without drafting, because {spec['plain_reason']}: the engine "
                          "measures both kinds of step at each batch size and drafts only where that pays."))
        if (trace.settings.kv_mode == "none" and other.settings.kv_mode != "none" and f.last_step_ms
                and g.last_step_ms and f.last_step_ms > 2 * g.last_step_ms):
            notes.append(("recompute", f"Lane {name} has {KV_MODE_LABELS['none']}: every new token recomputes the "
                          f"whole text so far ({f.prompt_tokens + max(f.tokens - 1, 0)} tokens by its last step), so "
                          f"its last step took {f.last_step_ms:.0f} ms against {g.last_step_ms:.0f} ms for lane "
                          f"{other_name}; the longer the text, the wider the gap."))
    return notes


def identical_html(traces: list[LaneTrace], finished: bool) -> str:
    return lossless_check(traces, finished)[1]


def _verdict(kind: str, body: str) -> tuple[str, str]:
    return kind, f'<p data-verdict="{kind}">{body}</p>'


def lossless_check(traces: list[LaneTrace], finished: bool) -> tuple[str, str]:
    """(verdict, HTML) of the lossless check. Verdicts: "identical", "different", "pending" (identical so far, still
    running), "identical-so-far" (stopped), "agreement" (greedy lanes of different arithmetic: how long they agree),
    "not-checked" (the lanes' token ids say nothing about losslessness)."""
    first, second = traces
    if first.engine is None or second.engine is None:
        return _external_check(first, second, finished)
    reason = not_comparable(first.settings, second.settings)
    if reason == DIFFERENT_ARITHMETIC and first.settings.greedy and second.settings.greedy:
        a, b = first.token_ids, second.token_ids
        common = min(len(a), len(b))
        agree = next((i for i in range(common) if a[i] != b[i]), common)
        return _verdict("agreement", "Greedy agreement: the lanes compute with different weights, KV precision or "
                        "attention window (or sinks), and their token ids agree on the first "
                        f"<b>{agree}</b> of {common} tokens. "
                        "(Near-ties flip under small numeric changes; after the first difference the texts go their "
                        "own ways. `python -m inference_core quality` measures perplexity.)")
    if reason:
        return _verdict("not-checked", f"Lossless check: not applicable, {reason}. Set both temperatures to 0, or give "
                        "both lanes the same temperature, top-p and seed without speculation, to compare token ids.")
    how = "greedy lanes" if first.settings.greedy else f"lanes sampling with seed {int(first.settings.seed)}"
    a, b = first.token_ids, second.token_ids
    common = min(len(a), len(b))
    mismatch = next((i for i in range(common) if a[i] != b[i]), None)
    decode = first.engine.tokenizer.decode
    if mismatch is not None:
        return _verdict("different", f"Lossless check: <b>different</b>. The token ids first differ at position "
                        f"{mismatch}: lane A {a[mismatch]} {html.escape(repr(decode([a[mismatch]])))}, lane B "
                        f"{b[mismatch]} {html.escape(repr(decode([b[mismatch]])))}.")
    if not finished:
        return _verdict("pending", f"Lossless check: identical so far ({common} tokens compared).")
    stopped = any(t.stats is None or t.stats.finish_reason == "stopped" for t in traces)
    if len(a) != len(b) and not stopped:
        return _verdict("different", f"Lossless check: <b>different</b> at position {common}: one lane stopped after "
                        f"{common} tokens, the other went on to {max(len(a), len(b))}.")
    if stopped:
        return _verdict("identical-so-far", f"Lossless check: identical as far as both got: the {how} agree on all "
                        f"{common} token ids they both produced before the race was stopped.")
    return _verdict("identical", f"Lossless check: <b>identical</b>. Both {how} produced the same {common} token ids.")


DIFFERENT_ARITHMETIC = ("the lanes compute with different weights, KV precision or attention window (or sinks), so "
                        "their texts may differ")


def not_comparable(a: LaneSettings, b: LaneSettings) -> str | None:
    """Why the two lanes' token ids say nothing about losslessness, or None when they should match: both greedy, or
    both sampling with the same temperature, top-p and seed without speculation (the same draws from the same seeded
    generator; speculative sampling keeps the distribution but draws differently)."""
    if _arithmetic(a) != _arithmetic(b):
        return DIFFERENT_ARITHMETIC
    if _shaping(a) != _shaping(b):
        return "the lanes shape the model's choices differently (penalties, logit bias or a constraint)"
    if a.greedy and b.greedy:
        return None
    if a.greedy != b.greedy:
        return "one lane is greedy and the other samples"
    if a.seed in (None, "") or b.seed in (None, ""):
        return "a lane samples without a seed"
    if (float(a.temperature), float(a.top_p), int(a.seed)) != (float(b.temperature), float(b.top_p), int(b.seed)):
        return "the lanes sample with different temperatures, top-p or seeds"
    if a.speculates or b.speculates:
        return "speculative sampling keeps the model's distribution but not the exact draws of plain sampling"
    return None


def _arithmetic(settings: LaneSettings) -> tuple:
    """What changes the numbers the model computes: its weights, the KV cache's precision, the window and sinks."""
    window = settings.sliding_window or 0
    return settings.quant(), settings.kv_dtype, window, (settings.attention_sinks or 0) if window else 0


def _shaping(settings: LaneSettings) -> tuple:
    """What changes the logits before a token is chosen (besides temperature, top-p and min-p)."""
    return (float(settings.repetition_penalty), float(settings.presence_penalty), float(settings.frequency_penalty),
            (settings.logit_bias or "").strip(), settings.constraint or "none",
            (settings.constraint_spec or "").strip() if (settings.constraint or "none") != "none" else "")


def _external_check(first: LaneTrace, second: LaneTrace, finished: bool) -> tuple[str, str]:
    """An external lane streams text, not our token ids: compare the texts, which says whether the engines agree
    when both run greedy (the same model and arithmetic give the same text)."""
    if not (first.settings.greedy and second.settings.greedy):
        return _verdict("not-checked", "Text check: not applicable, a lane samples. Set both temperatures to 0 to "
                        "compare the engines' texts.")
    a, b = first.text, second.text
    common = min(len(a), len(b))
    agree = next((i for i in range(common) if a[i] != b[i]), common)
    if agree == common and (not finished or len(a) == len(b)):
        state = "identical" if finished else "pending"
        return _verdict(state, f"Text check (an external lane streams text, not token ids): the greedy texts are "
                        f"{'<b>identical</b>' if finished else 'identical so far'} ({common} characters compared).")
    return _verdict("agreement", f"Text check (an external lane streams text, not token ids): the greedy texts agree "
                    f"on the first <b>{agree}</b> of {max(len(a), len(b))} characters. A different model, dtype or "
                    "kernel on the other engine changes near-ties.")


def kv_view_html(traces: list[LaneTrace]) -> str:
    views = [trace.kv_html for trace in traces if trace.kv_html]
    if not views and not any(trace.settings.kv_mode == "paged" and trace.engine is not None for trace in traces):
        return "<p>Neither lane uses the paged KV cache; set a lane's KV mode to paged to watch its block pool.</p>"
    return "".join(views) or "<p>The paged pool appears here once the race starts.</p>"
