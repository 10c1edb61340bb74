"""The OpenAI-compatible HTTP API, served by `python app.py` on the page's port (`server.app.create_app`).

    GET  /v1/models            the served model
    POST /v1/completions       text in, text out (streaming with server-sent events, or not)
    POST /v1/chat/completions  messages through the model's chat template
    GET  /health               200 once the model is loaded
    GET  /metrics              Prometheus text (`server.metrics`)
    POST /tokenize, POST /detokenize, GET /tokenizer_info   vLLM's, beside them (`server.tokenizer_api`)

Requests go to the chat's engine through the pool's one engine loop, so they are batched with the page's chat turns
(same settings, same engine) and take turns with the races. The fields (`server.api_body`) behave as OpenAI documents,
log-probabilities, penalties, logit bias and `response_format` included; vLLM's extensions that benchmark clients
send (`ignore_eos`, `min_tokens`, `stream_options.continuous_usage_stats`, `top_k`, `min_p`, ...) have vLLM's meaning;
the playground's own settings (`PLAYGROUND_FIELDS`: KV mode, draft source, weights, ...) are extra body fields. Every
response (`server.api_replies`) reports them back with the measured timings under `playground`, and the prompt tokens
served from the prefix cache as `usage.prompt_tokens_details.cached_tokens`.

Errors are OpenAI's JSON shape: a bad body is a 400 whose message names the field (`param` too), an unknown model a
404, a caller over its limits or a full queue a 429 with `Retry-After`; nothing answers with a traceback. A client that
disconnects mid-stream cancels its requests at once, and their KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inference_core.config import ConfigError
from inference_core.engine.request import FinishEvent, TokenEvent
from server.api_body import (API_WORDS, APIError, bad, error_response, param_of, read_body, read_request,
                             refuse_unsupported)
from server.api_replies import Reply
from serving.admission import Job, QueueFull, Run
from serving.policy import LimitExceeded, cache_salt, client_address, looks_like_path

log = logging.getLogger(__name__)
DISCONNECT_CHECK_S = 0.25  # how often a request asks whether its client is still there
SLOT = "chat"  # the pool slot the API shares with the page's chat: same settings, same engine, batched together


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
        return {"status": "ok", "model": self.model_id, "device": str(self.pool.loaded.device),
                "serving": self.pool.serving_state()}

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
            response = error_response(error)
        except Exception:  # never a traceback to the caller; the log has it
            log.exception("API request failed")
            response = error_response(APIError(500, "the engine failed on this request; see the server log."))
        self.metrics.http.labels(endpoint, str(response.status_code)).inc()
        return response

    def caller(self, http: Request) -> str:
        """The client's address (in public mode, behind a Space's proxy, the first X-Forwarded-For hop)."""
        return client_address(http.headers, http.client.host if http.client else None, self.policy.public) \
            or "unknown"

    async def _answer(self, http: Request, kind: str):
        body = await read_body(http)
        refuse_unsupported(body, kind)
        self.check_model(body.get("model"))
        asked = read_request(body, kind, self.policy, self.pool.serving)
        caller = self.caller(http)
        key = http.headers.get("authorization", "").removeprefix("Bearer ").strip() or None
        job = Job("request", {"api": (SLOT, asked.settings)}, tuple(asked.prompts), chat=kind == "chat",
                  max_new_tokens=asked.max_tokens, default_new_tokens=16 if kind == "completions" else None,
                  copies=asked.n, top_k=asked.top_k, stop=asked.stop, ignore_eos=asked.ignore_eos,
                  sampling=asked.sampling, caller=caller, cache_salt=cache_salt(key, caller))
        run = await asyncio.to_thread(self._submit, job, asked.constraint_field)
        for name in run.to_compile():
            await asyncio.to_thread(run.compile, name)
        sink = _AsyncSink()
        run.start(sink, tag="api")
        loaded = self.pool.loaded
        end_ids = frozenset() if asked.ignore_eos else frozenset(loaded.eos_token_ids)
        reply = Reply(kind, self.model_id, asked, loaded.tokenizer, run.prompt_ids,
                      end_ids | frozenset(asked.sampling.get("stop_token_ids", ())))
        if asked.stream:
            return StreamingResponse(self._stream(http, run, sink, reply),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            collected = await self._collect(http, run, sink, keep_tokens=reply.wants_logprobs)
        finally:
            run.close(wait=False)
        if collected is None:  # the client went away
            return Response(status_code=499)
        return JSONResponse(reply.whole(*collected))

    def check_model(self, model) -> None:
        if not isinstance(model, str) or not model:
            raise bad("'model' is required: the served model's id, from GET /v1/models.", "model")
        if self.policy.public and looks_like_path(model):
            raise bad("public mode does not accept local paths as 'model'.", "model")
        if model not in self.aliases:
            raise APIError(404, f"the model {model!r} is not served here; this app serves {self.model_id!r}.",
                           "model", "model_not_found")

    def _submit(self, job: Job, constraint_field: str | None = None) -> Run:
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
            raise bad(error.in_words(API_WORDS), param_of(error, job.sampling, constraint_field)) from None

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

    async def _collect(self, http, run: Run, sink, keep_tokens: bool):
        """(final events, token events per choice: kept only with `keep_tokens`), or None if the client left."""
        finals: list[FinishEvent | None] = [None] * len(run.handles)
        tokens: list[list[TokenEvent]] = [[] for _ in run.handles]
        async for i, event in self._events(http, run, sink):
            if isinstance(event, FinishEvent):
                finals[i] = event
            elif keep_tokens:
                tokens[i].append(event)
        return None if any(f is None for f in finals) else (finals, tokens)

    async def _stream(self, http, run: Run, sink, reply: Reply):
        finals: list[FinishEvent | None] = [None] * len(run.handles)
        try:
            for i in range(len(run.handles) if reply.kind == "chat" else 0):
                yield reply.sse(reply.chunk(i, role=True))
            async for i, event in self._events(http, run, sink):
                if isinstance(event, FinishEvent):
                    finals[i] = event
                    yield reply.sse(reply.chunk(i, final=event))
                elif reply.wants_chunk(event) or (reply.asked.echo and event.index == 0):
                    yield reply.sse(reply.chunk(i, event))
                else:
                    reply.generated[i] = reply.generated.get(i, 0) + 1  # counted, though it has no chunk yet
            if all(f is not None for f in finals):
                if reply.asked.include_usage:
                    yield reply.sse(reply.usage_chunk(finals))
                yield "data: [DONE]\n\n"
        except Exception as error:  # a failed step: tell the client in the stream, as OpenAI does
            log.exception("API stream failed")
            yield reply.sse({"error": {"message": f"the engine failed: {type(error).__name__}",
                                       "type": "server_error", "param": None, "code": None}})
        finally:
            run.close(wait=False)  # a disconnect (or any early end) frees every request's KV now
