"""What the page says that the runtime does not: its names for the settings a refusal tells a visitor to change
(`PAGE_WORDS`, for `ConfigError.in_words`), how it words a limit to wait out, and what a run that has had no event
for a while is waiting for."""

from __future__ import annotations

from inference_core.config import ConfigError
from inference_core.settings import words
from serving.cost import duration

PAGE_WORDS = {**words("page"), "max_new_tokens": "'max new tokens'", "draft_model": "start the app with a draft model",
              "longer_context": ""}


def refusal(error: ConfigError, page_words: dict[str, str] = PAGE_WORDS) -> str:
    """A refusal in the page's words; a limit that frees with time says when to try again."""
    retry = getattr(error, "retry_after_s", None)
    return error.in_words(page_words) + (f" Try again in {duration(retry)}." if retry else "")


def waiting_note(pool, engines) -> str:
    """What a run that has had no event for a while is waiting for, and about how long, from the engine loop's
    measured step times: other configurations sharing the device (the loop alternates between them step by step),
    or a full batch on its own configuration (it waits for a running request to end)."""
    status = pool.loop.status()
    mine = set(engines)
    others = [s for s in status if s["engine"] not in mine]
    notes = []
    if others:
        requests = sum(s["waiting"] + s["running"] for s in others)
        steps = [s["mean_step_ms"] for s in others if s["mean_step_ms"]]
        took = f" (their steps take about {sum(steps) / len(steps):.0f} ms each, measured)" if steps else ""
        notes.append(f"The device is shared with {requests} other request{'s' if requests != 1 else ''} on "
                     f"{len(others)} other configuration{'s' if len(others) != 1 else ''}: the engine loop takes "
                     f"turns between configurations, step by step{took}.")
    for s in status:
        if s["engine"] in mine and s["waiting"] and s["running"] and s["mean_step_ms"]:
            wait_s = s["steps_until_a_slot"] * s["mean_step_ms"] / 1e3 * (1 + len(others))
            notes.append(f"This configuration's batch is full ({s['running']} requests run together); the next "
                         f"place frees in about {duration(wait_s)}, from its measured step time.")
    return " ".join(notes) or "Waiting for the device..."


def widget_number(value, name: str, low: float, high: float, whole: bool = True):
    """A widget's number, checked: ConfigError naming the widget for an empty, non-numeric or out-of-range value."""
    try:
        number = float(value)
        ok = low <= number <= high and (not whole or number.is_integer())
    except (TypeError, ValueError):
        ok = False
    if not ok:
        kind = "a whole number" if whole else "a number"
        raise ConfigError(f"'{name}' must be {kind} from {low:g} to {high:g}, got {value!r}.")
    return int(number) if whole else number
