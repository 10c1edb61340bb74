"""Reading an OpenAI request body: every field checked, a 400 naming the first bad one, the result as `Asked`.

Accepted, with OpenAI's meaning: `model`, `max_tokens` (chat: or `max_completion_tokens`), `temperature`, `top_p`,
`n`, `stream`, `stream_options` (`include_usage`), `stop`, `seed`, `user`, `presence_penalty`, `frequency_penalty`,
`logit_bias`, `response_format` (`text`, `json_object`, `json_schema`), and log-probabilities (chat: `logprobs` true and
`top_logprobs` 0-20; completions: `logprobs` 0-5 and `echo`). vLLM's extensions that benchmark clients send
(`VLLM_FIELDS`), with vLLM's meaning: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, `stream_options.continuous_usage_stats`
(usage in every streamed chunk), `guided_json`, `guided_regex`, `guided_choice`. And the playground's own settings
(`PLAYGROUND_FIELDS`: KV mode, draft source, weights, ...). Anything else is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from inference_core.config import ConfigError
from inference_core.sampling import MAX_LOGPROBS, MIN_TEMPERATURE
from inference_core.settings import SETTINGS, LaneSettings, kinds, words
from inference_core.structured import Constraint, strict_schema

MAX_BODY_BYTES = 1 << 20
MAX_COMPLETION_LOGPROBS = 5  # the completions endpoint's `logprobs` limit (OpenAI's)
# The playground's own settings, accepted as extra body fields (the lane settings' table); sampling comes from
# OpenAI's fields. (An API request runs here: a lane's `endpoint` to an external engine is the page's, not the API's.)
PLAYGROUND_FIELDS = tuple(name for name, setting in SETTINGS.items() if setting.api == "extra")
API_WORDS = {**words("api"), "max_new_tokens": "'max_tokens'", "draft_model": "start the app with --draft-model",
             "longer_context": ""}
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "include_stop_str_in_output", "guided_json", "guided_regex", "guided_choice")
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format", *VLLM_FIELDS,
          *PLAYGROUND_FIELDS}
FIELDS = {"completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls"}}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = \
            status, message, param, code, retry_after_s


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


@dataclass(frozen=True)
class Asked:
    """One request's fields, read and checked."""

    prompts: list
    settings: LaneSettings
    max_tokens: int | None
    top_k: int
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    ignore_eos: bool = False
    echo: bool = False
    prompt_only: bool = False  # completions' max_tokens 0 with echo: the prompt (and its log-probabilities) alone
    top_logprobs: int | None = None  # alternatives per token in the reply (None: no log-probabilities)
    sampling: dict = field(default_factory=dict)  # more SamplingParams fields
    constraint_field: str | None = None  # the body field that gave the constraint (response_format, guided_*)


def read_request(body: dict, kind: str, policy, serving: LaneSettings | None = None) -> Asked:
    """OpenAI's fields (a 400 naming the first bad one), vLLM's extensions and the playground's settings (after
    `refuse_unsupported`); `serving`: the engine a request that names none of the playground's settings runs on
    (`read_settings`)."""
    max_name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    # Completions take max_tokens 0 with echo, as vLLM does: the prompt alone (one token is computed, none returned).
    max_tokens = number(body, max_name, None, 0 if kind == "completions" else 1, policy.max_new_tokens, integer=True)
    prompt_only = max_tokens == 0
    if prompt_only:
        if not flag(body, "echo"):
            raise bad("'max_tokens' 0 asks for the prompt alone: it needs 'echo': true.", "max_tokens")
        max_tokens = 1
    temperature = number(body, "temperature", 1.0, 0, 2)
    if 0 < temperature < MIN_TEMPERATURE:
        raise bad(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}.", "temperature")
    top_p = number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise bad("'top_p' must be above 0.", "top_p")
    top_k = max(0, number(body, "top_k", 0, -1, 1 << 20, integer=True))  # -1 or 0: off
    seed = number(body, "seed", None, -(2 ** 63), 2 ** 63 - 1, integer=True)
    n = number(body, "n", 1, 1, policy.n_max, integer=True)
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= STREAM_OPTIONS
                                    and all(isinstance(value, bool) for value in options.values())):
        raise bad("'stream_options' must be {\"include_usage\": true|false, \"continuous_usage_stats\": "
                  "true|false}.", "stream_options")
    if options is not None and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true.", "stream_options")
    options = options or {}
    stop = read_stop(body)
    settings = read_settings(body, temperature, top_p, seed, policy.public, serving)
    prompts = [read_messages(body)] if kind == "chat" else read_prompts(body)
    if len(prompts) * n > policy.n_max:
        raise bad(f"{len(prompts)} prompts x n={n} completions; this deployment allows up to "
                  f"{policy.n_max} per request.", "n")
    top_logprobs, sampling = read_sampling(body, kind)
    constraint_field = next((name for name in ("guided_json", "guided_regex", "guided_choice", "response_format")
                             if "constraint" in sampling and body.get(name) is not None), None)
    return Asked(prompts, settings, max_tokens, top_k, n, stop, stream, options.get("include_usage", False),
                 options.get("continuous_usage_stats", False), flag(body, "ignore_eos"),
                 kind == "completions" and flag(body, "echo"), prompt_only, top_logprobs, sampling, constraint_field)


def read_sampling(body: dict, kind: str) -> tuple[int | None, dict]:
    """Penalties, logit bias, vLLM's sampling extensions, log-probabilities and the constraint, as SamplingParams
    fields; and how many alternatives the reply shows per token (None: no log-probabilities)."""
    sampling = {
        "presence_penalty": number(body, "presence_penalty", 0.0, -2, 2),
        "frequency_penalty": number(body, "frequency_penalty", 0.0, -2, 2),
        "repetition_penalty": number(body, "repetition_penalty", 1.0, 0, 10),
        "min_p": number(body, "min_p", 0.0, 0, 1),
        "min_tokens": number(body, "min_tokens", 0, 0, 1 << 20, integer=True),
        "skip_special_tokens": body.get("skip_special_tokens") is None or flag(body, "skip_special_tokens"),
        "include_stop_str_in_output": flag(body, "include_stop_str_in_output"),
        "logit_bias": read_logit_bias(body),
        "stop_token_ids": read_token_ids(body, "stop_token_ids"),
    }
    if sampling["repetition_penalty"] == 0:
        raise bad("'repetition_penalty' must be above 0 (1 turns it off).", "repetition_penalty")
    top_logprobs = None
    if kind == "chat":
        if flag(body, "logprobs"):
            top_logprobs = number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    elif body.get("logprobs") is not None:
        top_logprobs = number(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS, integer=True)
    if top_logprobs is not None:
        sampling["logprobs"] = top_logprobs
        if kind == "completions" and flag(body, "echo"):
            sampling["prompt_logprobs"] = top_logprobs
    constraint = read_constraint(body)
    if constraint is not None:
        sampling["constraint"] = constraint
    return top_logprobs, sampling


def read_constraint(body: dict) -> Constraint | None:
    """`response_format` (json_object, json_schema) or vLLM's guided_json / guided_regex / guided_choice: at most
    one."""
    given = [name for name in ("guided_json", "guided_regex", "guided_choice") if body.get(name) is not None]
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad(f"give one constraint, not {' and '.join(given)}.", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    try:
        if name == "guided_json":
            return Constraint("json_schema", value if isinstance(value, str) else json.dumps(value))
        if name == "guided_regex":
            return Constraint("regex", value)
        if name == "guided_choice":
            return Constraint("choice", tuple(value) if isinstance(value, list) else value)
        return _response_format(value)
    except ConfigError as error:
        raise bad(f"'{name}': {error}", name) from None


def _response_format(value) -> Constraint:
    shape = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., '
             '"schema": {...}, "strict": true}}')
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ConfigError(f"must be {shape}.")
    if value["type"] == "json_object":
        return Constraint("json_object")
    schema = value.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict) \
            or not isinstance(schema.get("name", ""), str):
        raise ConfigError(f"must be {shape}.")
    # Strict or not, decoding cannot leave the schema. Strict also closes every object that does not say otherwise
    # (OpenAI's strict mode requires additionalProperties false), which keeps a small model from adding keys.
    body = schema.get("schema", {})
    return Constraint("json_schema", json.dumps(strict_schema(body) if schema.get("strict") else body))


def read_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > 300:
        raise bad("'logit_bias' must be an object of up to 300 token ids (as strings) to biases from -100 to 100.",
                  "logit_bias")
    out = []
    for token, value in bias.items():
        if not str(token).isdigit():
            raise bad(f"'logit_bias' keys are token ids, got {json.dumps(token)[:40]}.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias' values must be numbers from -100 to 100, got {json.dumps(value)[:40]}.",
                      "logit_bias")
        out.append((int(token), float(value)))
    return tuple(out)


def read_token_ids(body: dict, name: str) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad(f"'{name}' must be a list of token ids (integers of at least 0).", name)
    return tuple(ids)


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    accepted = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, accepted) or (not integer and not math.isfinite(value)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}.", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low:g} and {high:g}, got {value}.", name)
    return value


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)[:40]}.", name)
    return value


def read_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings.", "stop")
    return tuple(stops)


def refuse_unsupported(body: dict, kind: str) -> None:
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"unrecognized request argument supplied: {unknown[0]} (this endpoint accepts "
                  f"{', '.join(sorted(FIELDS[kind] - set(PLAYGROUND_FIELDS)))}, and the playground's own "
                  f"settings {', '.join(PLAYGROUND_FIELDS)}).", unknown[0])
    if number(body, "best_of", 1, 1, 1, integer=True) != 1 or body.get("suffix"):
        name = "suffix" if body.get("suffix") else "best_of"
        raise bad(f"'{name}' is not supported by this engine.", name)
    if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
        raise bad("tool calls are not supported by this engine.", "tools")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string.", "user")


def read_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'.", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}.role must be system, developer, user or assistant, got {json.dumps(role)[:40]}.",
                      f"{where}.role")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content: only text parts are supported.", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string.", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def read_prompts(body: dict) -> list:
    """A completion's prompts: a string, a list of strings, a list of token ids, or a list of such lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return prompt
    raise bad("'prompt' must be a string, a list of strings, or token ids (a list of integers, or of such lists).",
              "prompt")


def read_settings(body: dict, temperature: float, top_p: float, seed, public: bool,
                  serving: LaneSettings | None = None) -> LaneSettings:
    """The playground's extra fields as LaneSettings; a bad one is a 400 naming it (each is checked alone first). A
    request that names none of them runs on `serving`'s engine (`python app.py --serving`: the chat's default); one
    that names any starts from the playground's defaults (paged KV, the model's weights, eager), as docs/api.md's
    table gives them."""
    extra = {name: body[name] for name in PLAYGROUND_FIELDS if body.get(name) is not None}
    type_words = {bool: "true or false", int: "an integer", str: "a string", float: "a number"}
    for name, value in extra.items():
        accepted = kinds(name)
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            expected = 'an integer or "default"' if accepted == (int, str) else type_words[accepted[0]]
            raise bad(f"'{name}' must be {expected}, got {json.dumps(value)[:40]}.", name)
        try:
            LaneSettings(**{"kv_mode": "paged", name: value}).check()
        except (ConfigError, TypeError, ValueError) as error:
            message = error.in_words(API_WORDS) if isinstance(error, ConfigError) else str(error)
            raise bad(f"'{name}': {message}", name) from None
        choices = SETTINGS[name].choices
        if choices and value not in choices:
            raise bad(f"'{name}' must be one of {', '.join(map(str, choices))}.", name)
    if public and extra.get("compile"):
        raise bad("'compile' is off in public mode: compiling holds the shared device for a minute or more.",
                  "compile")
    try:
        engine = {name: getattr(serving, name) for name in PLAYGROUND_FIELDS} if serving and not extra else {}
        settings = LaneSettings(**{"kv_mode": "paged", **engine, **extra, "temperature": temperature,
                                   "top_p": top_p, "seed": seed})
        settings.check()
    except ConfigError as error:  # fields that do not go together
        raise bad(error.in_words(API_WORDS), param_of(error) or next(iter(extra), None)) from None
    return settings


def param_of(error: ConfigError, sampling: dict | None = None, constraint_field: str | None = None) -> str | None:
    """The body field a refusal is about: the setting its message names (`{spec_k}`), else one its text mentions,
    else the constraint's field (a grammar that does not compile)."""
    for name in re.findall(r"\{(\w+)\}", error.template):
        if name == "max_new_tokens":
            return "max_tokens"
        if name in PLAYGROUND_FIELDS:
            return name
    text = str(error)
    for name in (*PLAYGROUND_FIELDS, *(sampling or ())):
        if name in text:
            return name
    if constraint_field is not None:
        return constraint_field
    return "prompt" if "prompt" in text else None


def error_response(error: APIError) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(error.status, "server_error")
    headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))} if error.retry_after_s else None
    return JSONResponse({"error": {"message": error.message, "type": kind, "param": error.param,
                                   "code": error.code}}, status_code=error.status, headers=headers)


async def read_body(http: Request) -> dict:
    raw = await http.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}.")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise bad(f"the body is not valid JSON: {error}.") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object.")
    return body
