"""A lane's generated text token by token, as the page draws it: `TokenTrail` keeps one `TokenMark` per token event
(its text delta, where it came from in speculative decoding, the drafts it replaced, and what the engine measured of
the model's distribution there: the token's log-probability, the top alternatives and the entropy), and draws the text
in one of three colour modes (`COLOUR_MODES`):

- "draft": where each token came from in speculative decoding (`ui.speculation.TOKEN_KINDS`); a plain lane's text
  stays plain;
- "probability": red for a token the model found unlikely, clear for a certain one;
- "entropy": clear where the model was sure of the next token, amber where it was unsure.

While a lane streams, neighbouring tokens of one colour are merged into one span (fewer nodes for the browser to
redraw four times a second). Once the lane has ended every token is its own focusable span with a tooltip: its
probability, the entropy, the top alternatives with theirs, and on a speculating lane the probability the target gave
each rejected draft. The tooltips are CSS only (`TOKEN_CSS`, hover or tap to focus: Gradio's HTML runs no script):
each is `position: fixed` without offsets, so it sits where it would in the text yet is never cut off by the lane's
scrolling box. An event's text may be empty (the detokenizer holds back an incomplete character); the held text
arrives with a later token and takes that token's colour and tooltip. A last token without text (the end-of-text
token) is drawn as a small mark, so that its tooltip can be reached too.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from inference_core import TokenEvent
from ui.speculation import TOKEN_KINDS, legend_html, token_span

COLOUR_MODES = {"draft": "draft kind", "probability": "probability", "entropy": "entropy"}
ENTROPY_FULL_NATS = 3.0  # the entropy drawn fully amber (about 20 equally likely tokens)
SHADE_STEPS = 20  # colours are rounded to this many steps, so that neighbours of one colour merge while streaming
MAX_ALPHA = 0.8
UNKNOWN_TOKEN = -1  # a mark of text whose tokens are not known (see `TokenTrail.finish`)
UNLIKELY_RGB, UNSURE_RGB = (239, 68, 68), (245, 158, 11)
# The tooltips' style, given to the lanes' gr.HTML as its css_template (Gradio scopes it to that component).
TOKEN_CSS = """
.tok[tabindex] { cursor: help; border-radius: 2px; }
.tok[tabindex]:focus { outline: 1px solid #475569; }
.tok-tip { display: none; position: fixed; margin-top: 1.45em; z-index: 1000; padding: 4px 7px; border-radius: 4px;
  background: #0f172a; color: #f8fafc; font-size: 11px; line-height: 1.45; white-space: pre; text-decoration: none;
  font-family: ui-monospace, monospace; pointer-events: none; box-shadow: 0 2px 6px rgba(0,0,0,.25); }
.tok-tip b { color: inherit; }
.tok:hover > .tok-tip, .tok:focus > .tok-tip { display: inline-block; }
.tok-end::before { content: "∎"; color: #94a3b8; }
.tok-scale { display: inline-block; width: 90px; height: 9px; vertical-align: middle; border-radius: 2px; }
"""


@dataclass(frozen=True, slots=True)
class TokenMark:
    token_id: int
    text: str  # this event's text delta (may be "")
    kind: str  # "accepted" | "replaced" | "bonus" | "plain"
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    entropy: float | None = None
    rejected_ids: tuple[int, ...] = ()  # the drafts this token replaced ("replaced" only)
    rejected_text: str = ""  # those drafts decoded
    rejected_logprobs: tuple[float, ...] = ()  # the target's log-probability of each verified rejected draft

    @property
    def probability(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)


class TokenTrail:
    """A lane's tokens as `TokenMark`s, one per token event. `decode`: token ids to text as the lane's text shows it;
    `speculates`: the lane drafts (draft-kind colours); `spell`: ids to text with special tokens spelled out, for the
    tooltips (default: `decode`)."""

    def __init__(self, decode: Callable[[list[int]], str], speculates: bool,
                 spell: Callable[[list[int]], str] | None = None):
        self.decode = decode
        self.spell = spell or decode
        self.speculates = speculates
        self.marks: list[TokenMark] = []
        self._names: dict[int, str] = {}

    def add(self, event: TokenEvent) -> None:
        rejected = self.decode(list(event.rejected_ids)) if event.rejected_ids else ""
        self.marks.append(TokenMark(event.token_id, event.text, event.draft or "plain", event.logprob,
                                    tuple(event.top_logprobs), event.entropy, tuple(event.rejected_ids), rejected,
                                    tuple(event.rejected_logprobs)))

    def finish(self, final_text: str) -> None:
        """Make the marks spell the request's final text: cut where a stop string ended it; if the final text is not
        a prefix of what streamed (it should be), keep the final text as one plain mark rather than show a wrong one."""
        streamed = "".join(mark.text for mark in self.marks)
        if streamed == final_text:
            return
        if not streamed.startswith(final_text):
            self.marks = [TokenMark(UNKNOWN_TOKEN, final_text, "plain")]
            return
        kept, length = [], 0
        for mark in self.marks:
            if length >= len(final_text):
                break
            text = mark.text[:len(final_text) - length]
            kept.append(replace(mark, text=text))
            length += len(text)
        self.marks = kept

    def name(self, token_id: int) -> str:
        """A token's own text, quoted (whitespace visible), as the tooltips and the logit lens show it."""
        if token_id not in self._names:
            self._names[token_id] = repr(self.spell([token_id]))
        return self._names[token_id]

    def legend(self, mode: str) -> str:
        if mode == "draft":
            return legend_html() if self.speculates else ""
        if mode == "probability":
            return _scale("probability: unlikely", "certain", _colour(UNLIKELY_RGB, MAX_ALPHA), "transparent")
        return _scale("entropy: sure", f"unsure ({ENTROPY_FULL_NATS:g}+ nats)", "transparent",
                      _colour(UNSURE_RGB, MAX_ALPHA))

    def html(self, mode: str, tips: bool) -> str:
        """The text in colour mode `mode`: runs of one colour while streaming, a span with a tooltip per token
        (`tips`) once the lane has ended. Rejected drafts are struck through before the token that replaced them."""
        if not tips:
            return self._runs(mode)
        last = len(self.marks) - 1
        return "".join(self._rejected_html(mark) + self._token_html(index, mark, mode, index == last)
                       for index, mark in enumerate(self.marks))

    def _runs(self, mode: str) -> str:
        """Neighbouring tokens of one colour merged: a run's key is its draft kind (draft-kind colours of a
        speculating lane) or its inline style ("style:" + the style)."""
        by_kind = mode == "draft" and self.speculates
        runs: list[list[str]] = []  # [key, text]
        for mark in self.marks:
            key = mark.kind if by_kind else "style:" + _style(mark, mode, self.speculates)
            for run_key, text in (("rejected", mark.rejected_text), (key, mark.text)):
                if not text:
                    continue
                if runs and runs[-1][0] == run_key:
                    runs[-1][1] += text
                else:
                    runs.append([run_key, text])
        return "".join(_run_html(key, text) for key, text in runs)

    def _token_html(self, index: int, mark: TokenMark, mode: str, last: bool) -> str:
        if mark.token_id == UNKNOWN_TOKEN:
            return html.escape(mark.text)
        style = _style(mark, mode, self.speculates)
        kind = f' data-kind="{mark.kind}"' if self.speculates else ""
        end = " tok-end" if last and not mark.text else ""  # an end-of-text token: a mark to hover, not text
        probability = "" if mark.probability is None else f' data-p="{mark.probability:.6g}"'
        style = f' style="{style}"' if style else ""
        return (f'<span class="tok tok-{mark.kind}{end}"{kind} tabindex="0" data-i="{index}"{probability}{style}>'
                f'{html.escape(mark.text)}<span class="tok-tip">{self._tip(mark)}</span></span>')

    def _tip(self, mark: TokenMark) -> str:
        """A token's tooltip: its probability and the entropy, where it came from, the top alternatives."""
        lines = [f"<b>{html.escape(self.name(mark.token_id))}</b>"]
        if mark.probability is None:
            return lines[0] + "<br>no log-probabilities for this token"
        lines[0] += f"  p {_p(mark.probability)}  entropy {mark.entropy:.2f} nats"
        if self.speculates:
            lines.append(html.escape(TOKEN_KINDS[mark.kind][2]))
        lines += [html.escape(f"{rank}. {self.name(token_id):<14} {_p(math.exp(logprob))}")
                  for rank, (token_id, logprob) in enumerate(mark.top, 1)]
        return "<br>".join(lines)

    def _rejected_html(self, mark: TokenMark) -> str:
        """The drafts a "replaced" token replaced, struck through, with the target's probability of each."""
        if not mark.rejected_ids:
            return ""
        background, colour, label = TOKEN_KINDS["rejected"]
        lines = [html.escape(label + ": the target's probability of each")]
        for index, token_id in enumerate(mark.rejected_ids):
            name = f"{self.name(token_id):<14}"
            verified = index < len(mark.rejected_logprobs)
            lines.append(html.escape(f"{name} {_p(math.exp(mark.rejected_logprobs[index]))}" if verified
                                     else f"{name} not verified by the target"))
        text = html.escape(mark.rejected_text.replace("\n", "↵"))
        return (f'<s class="tok tok-rejected" data-kind="rejected" tabindex="0" style="background:{background};'
                f'color:{colour}">{text}<span class="tok-tip">{"<br>".join(lines)}</span></s>')


def _run_html(key: str, text: str) -> str:
    if key in TOKEN_KINDS:
        return token_span(key, text)
    style = key.removeprefix("style:")
    return f'<span class="tok" style="{style}">{html.escape(text)}</span>' if style else html.escape(text)


def _p(probability: float) -> str:
    return f"{probability:.3f}" if probability >= 0.001 else f"{probability:.1e}"


def _colour(rgb: tuple[int, int, int], alpha: float) -> str:
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{alpha:.2f})"


def _shade(level: float) -> float:
    """0..1 -> an alpha rounded to SHADE_STEPS steps."""
    return round(min(max(level, 0.0), 1.0) * SHADE_STEPS) / SHADE_STEPS * MAX_ALPHA


def _style(mark: TokenMark, mode: str, speculates: bool) -> str:
    """A token's inline style in `mode` ("" for none)."""
    if mode == "draft":
        if not speculates:
            return ""
        background, colour, _ = TOKEN_KINDS[mark.kind]
        return f"background:{background};color:{colour}"
    if mark.logprob is None:
        return ""
    level = 1 - mark.probability if mode == "probability" else mark.entropy / ENTROPY_FULL_NATS
    alpha = _shade(level)
    return f"background:{_colour(UNLIKELY_RGB if mode == 'probability' else UNSURE_RGB, alpha)}" if alpha else ""


def _scale(low: str, high: str, start: str, end: str) -> str:
    return (f'<div class="tok-legend" style="font-size:11px;margin-top:4px">{low} <span class="tok-scale" '
            f'style="background:linear-gradient(90deg,{start},{end})"></span> {high}</div>')
