"""What a speculating lane shows besides its speed: the colours of where each token came from, and its acceptance
counted live from the token events.

`TOKEN_KINDS` and `token_span` are the draft-kind colours (a draft the target accepted, the rejected drafts, drawn
struck through just before the target's token that replaced them, a bonus token after a fully accepted draft, or a
plain decode step); `ui.token_view` draws a lane's text with them in its "draft kind" colour mode.

`AcceptanceCount` rebuilds the engine's acceptance statistics from the events alone: a verification step is a run of
"accepted" events closed by one "replaced" event (drafted = accepted + the rejected drafts) or one "bonus" event
(drafted = accepted). At the end it is compared with the engine's own count (`GenerationStats.spec`).
`speculation_summary_rows` turns both into the race summary's speculation rows.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from inference_core import TokenEvent
from inference_core.spec.decoding import SpecStats

# kind -> (background, text colour, legend label)
TOKEN_KINDS = {
    "accepted": ("#dcfce7", "#166534", "accepted draft token"),
    "rejected": ("#fee2e2", "#b91c1c", "rejected draft tokens (proposed here)"),
    "replaced": ("#fef3c7", "#92400e", "target's token where it rejected a draft"),
    "bonus": ("#e0e7ff", "#3730a3", "bonus token after a fully accepted draft"),
    "plain": ("transparent", "#111827", "plain decode step (nothing drafted)"),
}


def token_span(kind: str, text: str) -> str:
    """One highlighted run of text; rejected drafts are struck through (newlines in them shown as ↵)."""
    background, colour, label = TOKEN_KINDS[kind]
    style = f"background:{background};color:{colour};border-radius:2px"
    if kind == "rejected":
        shown = html.escape(text.replace("\n", "↵"))
        return (f'<s class="tok tok-rejected" data-kind="rejected" title="{label}" '
                f'style="{style};text-decoration:line-through;opacity:.8">{shown}</s>')
    return f'<span class="tok tok-{kind}" data-kind="{kind}" style="{style}">{html.escape(text)}</span>'


def legend_html() -> str:
    chips = "".join(f'<span style="margin-right:10px">{token_span(kind, label)}</span>'
                    for kind, (_, _, label) in TOKEN_KINDS.items())
    return f'<div class="tok-legend" style="font-size:11px;margin-top:4px">{chips}</div>'


@dataclass
class AcceptanceCount:
    """Acceptance statistics counted from a lane's events, live; `finish` checks them against the engine's. What is
    independent of the engine is how the steps are read from the events; the counting per step is the engine's own
    `SpecStats`, which grows here to the longest draft seen."""

    counts: SpecStats = field(default_factory=lambda: SpecStats(k=0))
    running_rate: list[float] = field(default_factory=list)  # accepted / drafted so far, after each step
    open_run: int = 0  # "accepted" events of the step in progress
    engine_spec: dict | None = None  # GenerationStats.spec once the request has finished
    agrees: bool | None = None  # whether the live count equals the engine's (None until the end)

    def add(self, event: TokenEvent) -> None:
        if event.draft == "accepted":
            self.open_run += 1
        elif event.draft == "replaced":
            self._record(self.open_run + len(event.rejected_ids), self.open_run)
        elif event.draft == "bonus":
            self._record(self.open_run, self.open_run)

    @property
    def steps(self) -> int:
        return self.counts.steps

    @property
    def drafted(self) -> int:
        return self.counts.drafted

    @property
    def accepted(self) -> int:
        return self.counts.accepted

    def _record(self, drafted: int, accepted: int) -> None:
        self.counts.record(drafted, accepted)
        self.running_rate.append(self.counts.acceptance_rate)
        self.open_run = 0

    def finish(self, engine_spec: dict | None) -> None:
        """The request ended. A step still open was cut by the end of the request after its last accepted draft:
        the engine drops drafts after an end-of-sequence draft, so that step's drafts were all accepted."""
        if self.open_run:
            self._record(self.open_run, self.open_run)
        self.engine_spec = engine_spec
        self.agrees = engine_spec is not None and self.as_dict() == _comparable(engine_spec)

    def as_dict(self) -> dict:
        """The live count in the engine's terms (`SpecStats.as_dict` keys, without the timings and k)."""
        counts = _comparable(self.counts.as_dict())
        if self.engine_spec is not None:  # the engine's lists are as long as the longest possible draft
            width = len(self.engine_spec["drafted_by_position"])
            for key in ("accepted_by_position", "drafted_by_position"):
                counts[key] = _padded(counts[key], width)
        return counts

    def shown(self) -> dict:
        """What the page shows: the live count, or the engine's where they disagree at the end."""
        if self.engine_spec is not None and not self.agrees:
            return _comparable(self.engine_spec)
        return self.as_dict()


def speculation_summary_rows() -> list[tuple]:
    """The race summary's rows for speculation, as (row name, function of a lane's trace -> its cell): acceptance (live,
    then checked against the engine's count), tokens per verification step, and where the step time went. A trace
    has `acceptance` (an AcceptanceCount, None when the lane does not speculate) and `stats` (None until the end)."""
    def acceptance(t) -> str:
        if t.acceptance is None:
            return "no speculation"
        counts = t.acceptance.shown()
        if not counts["drafted"]:
            return "nothing drafted yet" if t.stats is None else "nothing drafted"
        cell = f"{counts['acceptance_rate']:.0%} ({counts['accepted']} of {counts['drafted']} drafts)"
        if t.acceptance.agrees is not None:
            cell += " = engine's count" if t.acceptance.agrees else " (engine's count; the live count differed)"
        return cell

    def per_step(t) -> str:
        if t.acceptance is None or not t.acceptance.steps:
            return "-"
        counts = t.acceptance.shown()
        return f"{counts['mean_accepted_length']:.2f} ({counts['steps']} steps)"

    def split(t) -> str:
        if t.acceptance is None:
            return "-"
        if t.stats is None:
            return "at the end"
        draft_ms, verify_ms = t.stats.spec["draft_ms"], t.stats.spec["verify_ms"]
        total = draft_ms + verify_ms
        share = f" ({draft_ms / total:.0%} drafting)" if total else ""
        return f"{draft_ms:.0f} ms / {verify_ms:.0f} ms{share}"

    return [("drafts accepted", acceptance), ("tokens per verification step", per_step),
            ("draft / verify time", split)]


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))


def _comparable(engine_spec: dict) -> dict:
    keys = ("steps", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "accepted_by_position",
            "drafted_by_position")
    return {key: engine_spec[key] for key in keys}
