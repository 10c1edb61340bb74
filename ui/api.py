"""The playground's API for programs: two named Gradio endpoints, `race` and `chat`, that a script calls by keyword
with `gradio_client` (`Client(url).predict(prompt="Hi", max_new_tokens=8, api_name="/race")`) and that return
JSON-able dicts. Every other event of the page is private (`api_visibility="private"` in `ui.layout`).

Both run the page's own streaming handlers to their end (`ui.race.run_race`, `ui.chat.chat_turn`), so a call goes
through the same engine loop, device-time check and error messages as a click: a run the page would refuse raises
`gr.Error` with the page's message. Settings are keyword overrides of `LaneSettings`' fields (the race's lanes start
from `ui.setups.DEFAULT_LANES`, the chat from the chat tab's paged default); an unknown key is refused by name. Each
API session (one per `gradio_client.Client`) has its own prefix-cache salt, so a client's second chat turn reuses its
first turn's KV blocks and never another caller's.
"""

# No `from __future__ import annotations`: gr.api reads the endpoints' return type from their signatures as written.
import uuid
from dataclasses import replace
from functools import partial

import gradio as gr

from inference_core.settings import LaneSettings
from serving.pool import EnginePool
from ui.chat import CHAT_OUTPUTS, chat_turn
from ui.control import RunControl, caller_of
from ui.race import LANE_SETTING_FIELDS, RACE_OUTPUTS, run_race
from ui.race_table import lane_numbers
from ui.race_view import lossless_check
from ui.setups import DEFAULT_LANES

CHAT_DEFAULT = LaneSettings(kv_mode="paged")
ROLES = ("user", "assistant")


def lane_settings(overrides: dict | None, default: LaneSettings, what: str) -> LaneSettings:
    """`default` with `overrides` applied; gr.Error naming `what` and the key for anything not a LaneSettings field.
    Values are checked where the page's are, when the engine is made."""
    if overrides is None:
        return default
    if not isinstance(overrides, dict):
        raise gr.Error(f"{what} must be a dict of settings, got {type(overrides).__name__}.")
    unknown = [key for key in overrides if key not in LANE_SETTING_FIELDS]
    if unknown:
        raise gr.Error(f"{what} has unknown setting{'s' if len(unknown) > 1 else ''} "
                       f"{', '.join(repr(key) for key in unknown)}; the settings are {', '.join(LANE_SETTING_FIELDS)}.")
    return replace(default, **overrides)


def _values(settings: LaneSettings) -> list:
    return [getattr(settings, name) for name in LANE_SETTING_FIELDS]


def _control(visitor: str | None, caller: str | None = None) -> RunControl:
    """A run's control: never stopped; `visitor` salts the prefix cache (None: a salt of its own); `caller` is the
    client address the deployment's per-caller limits count against."""
    return RunControl(_visitor=visitor, caller=caller)


def _run_to_end(updates, outputs: tuple[str, ...]) -> tuple[dict, object]:
    """Drive a streaming handler to its end: (the latest value sent for each output, the handler's return value)."""
    latest = {}
    try:
        while True:
            latest.update((name, value) for name, value in zip(outputs, next(updates)) if not _skipped(value))
    except StopIteration as end:
        return latest, end.value
    finally:
        updates.close()


def _skipped(value) -> bool:
    return isinstance(value, dict) and value == {"__type__": "update"}  # gr.skip(): the output is left as it is


def _refused(status: str) -> gr.Error:
    return gr.Error(status.replace("**", ""))


def race(pool: EnginePool, prompt: str, system: str = "", max_new_tokens: int = 128, lane_a: dict | None = None,
         lane_b: dict | None = None, visitor: str | None = None, caller: str | None = None) -> dict:
    """Run a race to its end. Returns the status line, the lossless check (`identical`: True or False where the
    lanes' token ids must match, None where they need not; `check`: the verdict, see
    `ui.race_view.lossless_check`) and per lane its settings, text, token ids, the summary table's numbers
    (`ui.race_table.lane_numbers`) and, for a speculating lane, its acceptance counts."""
    settings = {"A": lane_settings(lane_a, DEFAULT_LANES["A"], "lane_a"),
                "B": lane_settings(lane_b, DEFAULT_LANES["B"], "lane_b")}
    latest, traces = _run_to_end(run_race(pool, _control(visitor, caller), prompt, system, max_new_tokens,
                                          *_values(settings["A"]), *_values(settings["B"])), RACE_OUTPUTS)
    if traces is None:
        raise _refused(latest["status"])
    check = lossless_check(traces, finished=True)[0]
    lanes = {}
    for trace in traces:
        acceptance = None
        if trace.acceptance is not None:
            acceptance = {**trace.acceptance.shown(), "equals_engine_count": trace.acceptance.agrees}
        lanes[trace.name] = {"settings": trace.settings.describe(), "text": trace.text,
                             "token_ids": list(trace.token_ids), **lane_numbers(trace), "acceptance": acceptance}
    return {"status": latest["status"], "identical": {"identical": True, "different": False}.get(check),
            "check": check, "lanes": lanes}


def _history(history: list | None) -> list[dict]:
    """The conversation so far, checked: a list of {"role": "user" or "assistant", "content": text} (other keys, such
    as a chat log's metadata, are dropped)."""
    if not isinstance(history, (list, type(None))):
        raise gr.Error(f"history must be a list of messages, got {type(history).__name__}.")
    checked = []
    for index, message in enumerate(history or []):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise gr.Error(f"history[{index}] must be {{'role': 'user' or 'assistant', 'content': text}}, got "
                           f"{message!r}.")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def chat(pool: EnginePool, message: str, history: list | None = None, system: str = "", max_new_tokens: int = 128,
         settings: dict | None = None, visitor: str | None = None, caller: str | None = None) -> dict:
    """One chat turn after `history`. Returns the reply, the history with this turn added (pass it to the next call)
    and the turn's measured numbers (`stats`: turn number, configuration, prompt and cached prompt tokens, TTFT,
    decode tokens/s, tokens, finish reason, speculation counts)."""
    turn_settings = lane_settings(settings, CHAT_DEFAULT, "settings")
    latest, _ = _run_to_end(chat_turn(pool, _control(visitor, caller), message, _history(history), [], system,
                                      max_new_tokens,
                                      *_values(turn_settings)), CHAT_OUTPUTS)
    if not latest.get("turn_stats"):
        raise _refused(latest["status"])
    history = latest["history"]
    turn = sum(message["role"] == "user" for message in history)  # the handler counted this call's turns only
    return {"reply": history[-1]["content"], "history": history, "stats": {**latest["turn_stats"][-1], "turn": turn}}


def _visitor(request: gr.Request | None) -> str:
    """The API session's prefix-cache salt (a fresh one without a session)."""
    session = getattr(request, "session_hash", None) or uuid.uuid4().hex
    return f"api-{session}"


def add_api(pool: EnginePool, gpu_task=lambda function: function, **listener) -> None:
    """Register the `race` and `chat` endpoints in the Blocks being built. `gpu_task` wraps the work (`spaces.GPU` on
    a ZeroGPU Space); `listener`: gr.api's queue settings (the page's generations' concurrency group)."""
    run = {"race": gpu_task(partial(race, pool)), "chat": gpu_task(partial(chat, pool))}

    def race_endpoint(prompt: str, system: str = "", max_new_tokens: int = 128, lane_a: dict | None = None,
                      lane_b: dict | None = None, request: gr.Request = None) -> dict:
        """Race two lanes on one prompt, both greedy unless told otherwise. lane_a, lane_b: overrides of the lane
        settings by name (the page's settings: kv_mode, spec_method, weights, ...; an unknown name is refused with the
        list); lane A starts paged, lane B with no KV cache. Returns per lane the text and the measured numbers, and
        whether greedy lanes produced identical token ids."""
        return run["race"](prompt, system, max_new_tokens, lane_a, lane_b, visitor=_visitor(request),
                           caller=caller_of(request))

    def chat_endpoint(message: str, history: list | None = None, system: str = "", max_new_tokens: int = 128,
                      settings: dict | None = None, request: gr.Request = None) -> dict:
        """One chat turn on the paged KV cache with the prefix cache. history: the previous call's history (a list of
        {role, content}); settings: overrides of the same settings as a race lane. Returns the reply, the history to
        pass next time and the turn's measured numbers (cached prompt tokens, TTFT, decode tokens/s)."""
        return run["chat"](message, history, system, max_new_tokens, settings, visitor=_visitor(request),
                           caller=caller_of(request))

    gr.api(race_endpoint, api_name="race", **listener)
    gr.api(chat_endpoint, api_name="chat", **listener)
