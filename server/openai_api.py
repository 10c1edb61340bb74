"""The OpenAI-compatible HTTP API, served by `python app.py` on the page's port (`server.app.create_app`).

    GET  /v1/models            the served model
    POST /v1/completions       text in, text out (streaming with server-sent events, or not)
    POST /v1/chat/completions  messages through the model's chat template
    GET  /health               200 once the model is loaded
    GET  /metrics              Prometheus text (`server.metrics`)

Requests go to the chat's engine through the pool's one engine loop, so they are batched with the page's chat turns
(same settings, same engine) and take turns with the races. The usual fields behave as OpenAI documents (`max_tokens`
or `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`, `stream`, `stream_options.include_usage`);
`top_k` and the playground's own settings (`PLAYGROUND_FIELDS`: KV mode, draft source, weights, ...) are accepted as
extra body fields. Every response reports them back with the measured timings under `playground`, and the prompt
tokens served from the prefix cache as `usage.prompt_tokens_details.cached_tokens`.

Errors are OpenAI's JSON shape: a bad body is a 400 whose message names the field (`param` too), an unknown model a
404, a caller over its limits or a full queue a 429 with `Retry-After`; nothing answers with a traceback. A client that
disconnects mid-stream cancels its requests at once, and their KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent, TokenEvent
from inference_core.sampling import MIN_TEMPERATURE
from inference_core.settings import SETTINGS, LaneSettings, kinds, words
from serving.admission import Job, QueueFull, Run
from serving.policy import LimitExceeded, cache_salt, client_address, looks_like_path

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
DISCONNECT_CHECK_S = 0.25  # how often a request asks whether its client is still there
SLOT = "chat"  # the pool slot the API shares with the page's chat: same settings, same engine, batched together
# The playground's own settings, accepted as extra body fields (the lane settings' table); sampling comes from
# OpenAI's fields. (An API request runs here: a lane's `endpoint` to an external engine is the page's, not the API's.)
PLAYGROUND_FIELDS = tuple(name for name, setting in SETTINGS.items() if setting.api == "extra")
API_WORDS = {**words("api"), "max_new_tokens": "'max_tokens'", "draft_model": "start the app with --draft-model",
             "longer_context": ""}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
          "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", *PLAYGROUND_FIELDS}
FIELDS = {"completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                            "tool_choice", "parallel_tool_calls"}}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "stopped": "length"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = \
            status, message, param, code, retry_after_s

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "server_error")
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.retry_after_s else None
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


# --- reading the body ---------------------------------------------------------------------------------------------

def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}.", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low:g} and {high:g}, got {value}.", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)[:40]}.", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings.", "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict, kind: str) -> None:
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"unrecognized request argument supplied: {unknown[0]} (this endpoint accepts "
                  f"{', '.join(sorted(FIELDS[kind] - set(PLAYGROUND_FIELDS)))}, and the playground's own "
                  f"settings {', '.join(PLAYGROUND_FIELDS)}).", unknown[0])
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0, -2, 2) != 0:
            raise bad(f"'{name}' is not supported by this engine; leave it at 0.", name)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by this engine.", "logit_bias")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        raise bad("log probabilities are not returned by this engine; leave 'logprobs' unset.", "logprobs")
    if body.get("echo") or _number(body, "best_of", 1, 1, 1, integer=True) != 1 or body.get("suffix"):
        name = "echo" if body.get("echo") else "suffix" if body.get("suffix") else "best_of"
        raise bad(f"'{name}' is not supported by this engine.", name)
    if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
        raise bad("tool calls are not supported by this engine.", "tools")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("only response_format {\"type\": \"text\"} is supported.", "response_format")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string.", "user")


def _messages(body: dict) -> list[dict]:
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


def _prompts(body: dict) -> list:
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


def _settings(body: dict, temperature: float, top_p: float, seed, public: bool) -> LaneSettings:
    """The playground's extra fields as LaneSettings; a bad one is a 400 naming it (each is checked alone first)."""
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
        settings = LaneSettings(**{"kv_mode": "paged", **extra, "temperature": temperature, "top_p": top_p,
                                   "seed": seed})
        settings.check()
    except ConfigError as error:  # fields that do not go together
        raise bad(error.in_words(API_WORDS), _param_of(error) or next(iter(extra), None)) from None
    return settings


# --- the API ------------------------------------------------------------------------------------------------------

class _AsyncSink:
    """A loop handle's event queue read from asyncio: the engine loop's thread puts, the handler awaits."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:  # from the engine loop's thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class OpenAIAPI:
    def __init__(self, pool, metrics):
        self.pool, self.policy, self.metrics = pool, pool.policy, metrics
        loaded = pool.loaded
        self.model_id = loaded.display_name.split(" (")[0]  # "SmolLM2-135M-Instruct", not the GGUF's long label
        self.aliases = {self.model_id, loaded.name, loaded.display_name, *self.policy.allowed_models}
        self.created = int(time.time())
        self.router = APIRouter()
        self.router.add_api_route("/v1/models", self.models, methods=["GET"])
        self.router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        self.router.add_api_route("/health", self.health, methods=["GET"])
        self.router.add_api_route("/metrics", self.prometheus, methods=["GET"])

    async def health(self):
        return {"status": "ok", "model": self.model_id, "device": str(self.pool.loaded.device)}

    async def prometheus(self):
        body = await asyncio.to_thread(self.metrics.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "inference-playground"}]}

    async def completions(self, request: Request):
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request):
        return await self._serve(request, "chat")

    async def _serve(self, http: Request, kind: str):
        endpoint = f"/v1/{'chat/' if kind == 'chat' else ''}completions"
        try:
            response = await self._answer(http, kind)
        except APIError as error:
            reason = {400: "bad_request", 404: "bad_request", 413: "too_large"}.get(error.status, "rate_limited")
            self.metrics.rejected.labels(error.code if error.code == "queue_full" else reason).inc()
            response = error.response()
        except Exception:  # never a traceback to the caller; the log has it
            log.exception("API request failed")
            response = APIError(500, "the engine failed on this request; see the server log.").response()
        self.metrics.http.labels(endpoint, str(response.status_code)).inc()
        return response

    def caller(self, http: Request) -> str:
        """The client's address (in public mode, behind a Space's proxy, the first X-Forwarded-For hop)."""
        return client_address(http.headers, http.client.host if http.client else None, self.policy.public) \
            or "unknown"

    async def _answer(self, http: Request, kind: str):
        body = await _read_body(http)
        _refuse_unsupported(body, kind)
        self._check_model(body.get("model"))
        asked = _read_request(body, kind, self.policy)
        caller = self.caller(http)
        key = http.headers.get("authorization", "").removeprefix("Bearer ").strip() or None
        job = Job("request", {"api": (SLOT, asked.settings)}, tuple(asked.prompts), chat=kind == "chat",
                  max_new_tokens=asked.max_tokens, default_new_tokens=16 if kind == "completions" else None,
                  copies=asked.n, top_k=asked.top_k, stop=asked.stop, caller=caller,
                  cache_salt=cache_salt(key, caller))
        run = await asyncio.to_thread(self._submit, job)
        for name in run.to_compile():
            await asyncio.to_thread(run.compile, name)
        sink = _AsyncSink()
        run.start(sink, tag="api")
        reply = _Reply(kind, self.model_id, asked.settings)
        if asked.stream:
            return StreamingResponse(self._stream(http, run, sink, reply, asked.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            finals = await self._collect(http, run, sink)
        finally:
            run.close(wait=False)
        if finals is None:  # the client went away
            return Response(status_code=499)
        return JSONResponse(reply.whole(finals))

    def _check_model(self, model) -> None:
        if not isinstance(model, str) or not model:
            raise bad("'model' is required: the served model's id, from GET /v1/models.", "model")
        if self.policy.public and looks_like_path(model):
            raise bad("public mode does not accept local paths as 'model'.", "model")
        if model not in self.aliases:
            raise APIError(404, f"the model {model!r} is not served here; this app serves {self.model_id!r}.",
                           "model", "model_not_found")

    def _submit(self, job: Job) -> Run:
        """The pool's admission path (in a worker thread: it tokenizes and may build an engine), its refusals in
        OpenAI's shapes: a 400 naming what to change, a 429 with Retry-After for a limit that frees with time."""
        try:
            return self.pool.submit(job)
        except QueueFull as error:
            raise APIError(429, f"{error} Retry after the time in Retry-After.", code="queue_full",
                           retry_after_s=error.retry_after_s) from None
        except LimitExceeded as error:
            raise APIError(429, str(error), code="rate_limited", retry_after_s=error.retry_after_s) from None
        except ConfigError as error:
            raise bad(error.in_words(API_WORDS), _param_of(error)) from None

    async def _events(self, http: Request, run: Run, sink: _AsyncSink):
        """(choice index, event) as they arrive until every request has finished; stops the run once it is over the
        app's per-run device time. Ends early (returns) when the client has disconnected."""
        index = {id(h): i for i, h in enumerate(run.handles)}
        checked = time.monotonic()
        while not all(h.done for h in run.handles):
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:  # also while tokens flow
                checked = time.monotonic()
                if await http.is_disconnected():
                    return
            try:
                handle, event = await asyncio.wait_for(sink.events.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                continue
            event = handle.received(event)  # raises a failed step's error
            run.note(handle, event)
            if isinstance(event, TokenEvent) and run.over_limit():
                run.stop()
            yield index[id(handle)], event

    async def _collect(self, http, run: Run, sink) -> list[FinishEvent] | None:
        finals: list[FinishEvent | None] = [None] * len(run.handles)
        async for i, event in self._events(http, run, sink):
            if isinstance(event, FinishEvent):
                finals[i] = event
        return None if any(f is None for f in finals) else finals

    async def _stream(self, http, run: Run, sink, reply: "_Reply", include_usage: bool):
        finals: list[FinishEvent | None] = [None] * len(run.handles)
        try:
            for i in range(len(run.handles) if reply.kind == "chat" else 0):
                yield reply.sse(reply.chunk(i, role=True, include_usage=include_usage))
            async for i, event in self._events(http, run, sink):
                if isinstance(event, FinishEvent):
                    finals[i] = event
                    yield reply.sse(reply.chunk(i, final=event, include_usage=include_usage))
                elif event.text:
                    yield reply.sse(reply.chunk(i, text=event.text, include_usage=include_usage))
            if all(f is not None for f in finals):
                if include_usage:
                    yield reply.sse(reply.usage_chunk(finals))
                yield "data: [DONE]\n\n"
        except Exception as error:  # a failed step: tell the client in the stream, as OpenAI does
            log.exception("API stream failed")
            yield reply.sse({"error": {"message": f"the engine failed: {type(error).__name__}",
                                       "type": "server_error", "param": None, "code": None}})
        finally:
            run.close(wait=False)  # a disconnect (or any early end) frees every request's KV now


async def _read_body(http: Request) -> dict:
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


@dataclass(frozen=True)
class _Asked:
    """One request's OpenAI fields, read and checked."""

    prompts: list
    settings: LaneSettings
    max_tokens: int | None
    top_k: int
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _read_request(body: dict, kind: str, policy) -> _Asked:
    """OpenAI's fields (a 400 naming the first bad one) and the playground's settings."""
    max_name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, max_name, None, 1, policy.max_new_tokens, integer=True)
    temperature = _number(body, "temperature", 1.0, 0, 2)
    if 0 < temperature < MIN_TEMPERATURE:
        raise bad(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}.", "temperature")
    top_p = _number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise bad("'top_p' must be above 0.", "top_p")
    top_k = max(0, _number(body, "top_k", 0, -1, 1 << 20, integer=True))  # -1 or 0: off
    seed = _number(body, "seed", None, -(2 ** 63), 2 ** 63 - 1, integer=True)
    n = _number(body, "n", 1, 1, policy.n_max, integer=True)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}
                                    and isinstance(options.get("include_usage", False), bool)):
        raise bad("'stream_options' must be {\"include_usage\": true|false}.", "stream_options")
    if options is not None and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true.", "stream_options")
    stop = _stop(body)
    settings = _settings(body, temperature, top_p, seed, policy.public)
    prompts = [_messages(body)] if kind == "chat" else _prompts(body)
    if len(prompts) * n > policy.n_max:
        raise bad(f"{len(prompts)} prompts x n={n} completions; this deployment allows up to "
                  f"{policy.n_max} per request.", "n")
    return _Asked(prompts, settings, max_tokens, top_k, n, stop, stream, bool(options and options.get("include_usage")))


def _param_of(error: ConfigError) -> str | None:
    """The body field a refusal is about: the setting its message names (`{spec_k}`), else one its text mentions."""
    for name in re.findall(r"\{(\w+)\}", error.template):
        if name == "max_new_tokens":
            return "max_tokens"
        if name in PLAYGROUND_FIELDS:
            return name
    text = str(error)
    return next((name for name in PLAYGROUND_FIELDS if name in text), "prompt" if "prompt" in text else None)


class _Reply:
    """OpenAI's response shapes for one request's choices, with the playground's settings and timings."""

    def __init__(self, kind: str, model: str, settings: LaneSettings):
        self.kind, self.model, self.settings = kind, model, settings
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def timings(self, final: FinishEvent) -> dict:
        stats = final.stats
        out = {"finish_reason": stats.finish_reason, "ttft_ms": round(stats.ttft_ms, 2),
               "queue_ms": round(stats.queue_ms, 2), "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
               "total_ms": round(stats.total_ms, 2), "prompt_tokens": stats.prompt_tokens,
               "cached_prompt_tokens": stats.cached_prompt_tokens, "generated_tokens": stats.generated_tokens,
               "batch_size_mean": round(stats.batch_size_mean, 2), "preemptions": stats.preemptions}
        if stats.spec:
            out["acceptance"] = {name: stats.spec[name] for name in ("drafted", "accepted", "acceptance_rate",
                                                                     "mean_accepted_length") if name in stats.spec}
        return out

    def playground(self, finals: list[FinishEvent]) -> dict:
        settings = {name: getattr(self.settings, name) for name in PLAYGROUND_FIELDS}
        return {"settings": settings, "description": self.settings.describe(),
                "timings": [self.timings(f) for f in finals]}

    @staticmethod
    def tokens(finals) -> int:
        return sum(f.stats.prompt_tokens + f.stats.generated_tokens for f in finals)

    def usage(self, finals: list[FinishEvent]) -> dict:
        prompt = sum(f.stats.prompt_tokens for f in finals)
        completion = sum(f.stats.generated_tokens for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.stats.cached_prompt_tokens for f in finals)}}

    def whole(self, finals: list[FinishEvent]) -> dict:
        if self.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": f.text},
                        "finish_reason": FINISH_REASONS.get(f.stats.finish_reason, "stop"), "logprobs": None}
                       for i, f in enumerate(finals)]
        else:
            choices = [{"index": i, "text": f.text, "finish_reason": FINISH_REASONS.get(f.stats.finish_reason, "stop"),
                        "logprobs": None} for i, f in enumerate(finals)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals), "playground": self.playground(finals)}

    def chunk(self, index: int, text: str = "", role: bool = False, final: FinishEvent | None = None,
              include_usage: bool = False) -> dict:
        reason = FINISH_REASONS.get(final.stats.finish_reason, "stop") if final else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
        out = {"id": self.id, "object": self.object + ".chunk" if self.kind == "chat" else self.object,
               "created": self.created, "model": self.model, "choices": [choice]}
        if final is not None:
            out["playground"] = {"description": self.settings.describe(), "timings": [self.timings(final)]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, finals: list[FinishEvent]) -> dict:
        return {"id": self.id, "object": self.object + ".chunk" if self.kind == "chat" else self.object,
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(finals)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"
