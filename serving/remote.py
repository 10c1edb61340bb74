"""An external engine as a race lane or the chat's engine: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's
server, or this app's own API on another machine), streamed with its own TTFT and tokens/s.

`submit_remote(...)` starts one streaming chat completion in a thread and returns a `RemoteHandle`, which the page's
handlers read exactly like the engine loop's `LoopHandle` (the same sink queue, `merge`, `stop` and `cancel`): the
events are the engine's own `TokenEvent`s and one `FinishEvent`, so the race's chart, table and agreement check need
nothing special. Times are wall-clock from the moment the request is sent, as any client of a remote server sees them
(network and the server's own queue included); token counts come from the server's `usage` when it reports it (most
do with `stream_options.include_usage`), else one token per streamed delta.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import httpx

from inference_core import ConfigError, FinishEvent, TokenEvent
from inference_core.engine.loop import EventHandle
from inference_core.engine.request import GenerationStats
from inference_core.settings import LaneSettings
from serving.policy import ServePolicy

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0  # between two streamed chunks
FINISH_REASONS = {"stop": "eos", "length": "length"}


def list_models(url: str, api_key: str | None = None) -> list[str]:
    """The server's model ids (GET /v1/models), or a ConfigError saying why they could not be read."""
    try:
        response = httpx.get(_base(url) + "/models", headers=_headers(api_key), timeout=CONNECT_TIMEOUT_S)
        response.raise_for_status()
        return [model["id"] for model in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"could not list the models of the external engine at {url}: {_why(error)}.") from None


def resolve_endpoint(policy: ServePolicy, settings: LaneSettings) -> tuple[str, str]:
    """(URL, model id) of an external lane: the URL checked against the deployment's policy (public mode: only the
    allowed ones), the model asked of the server when none was named. ConfigError with the reason otherwise."""
    url = settings.endpoint.strip()
    policy.check_endpoint(url)
    if settings.endpoint_model.strip():
        return url, settings.endpoint_model.strip()
    models = list_models(url)
    if not models:
        raise ConfigError(f"the external engine at {url} lists no models.")
    return url, models[0]


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _why(error: Exception) -> str:
    if isinstance(error, httpx.HTTPStatusError):
        try:
            message = error.response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.response.text[:200]
        return f"HTTP {error.response.status_code}: {message}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class RemoteHandle(EventHandle):
    """One streaming request to an external engine, read like a `LoopHandle`."""

    def __init__(self, tag, sink: queue.Queue | None = None):
        super().__init__(tag, sink)
        self._stop = threading.Event()
        self._cancel = threading.Event()

    def stop(self) -> None:
        """End now with a final event (finish_reason "stopped"): the stream is closed, which cancels it there."""
        self._stop.set()

    def cancel(self) -> None:
        """End now with no final event."""
        self._cancel.set()
        self.done = True


def submit_remote(url: str, model: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int | None = None, api_key: str | None = None, tag=None,
                  sink: queue.Queue | None = None) -> RemoteHandle:
    """Start streaming `messages` to the external engine's /v1/chat/completions in a thread."""
    handle = RemoteHandle(tag, sink)
    body = {"model": model, "messages": messages, "max_tokens": int(max_tokens), "temperature": float(temperature),
            "top_p": float(top_p), "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = int(seed)
    thread = threading.Thread(target=_stream, args=(handle, _base(url), body, api_key), daemon=True,
                              name="external-engine")
    thread.start()
    return handle


def _stream(handle: RemoteHandle, base: str, body: dict, api_key: str | None) -> None:
    sent = time.perf_counter()
    text, index, first_at, last_at, usage, reason = "", 0, None, sent, None, None
    try:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        with httpx.stream("POST", base + "/chat/completions", json=body, headers=_headers(api_key),
                          timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                response.raise_for_status()
            for line in response.iter_lines():
                if handle._cancel.is_set():
                    return
                if handle._stop.is_set():
                    reason = "stopped"
                    break
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ConfigError(f"the external engine failed: {chunk['error'].get('message', chunk['error'])}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    reason = choice.get("finish_reason") or reason
                    delta = (choice.get("delta") or {}).get("content") or ""
                    if not delta:
                        continue
                    now = time.perf_counter()
                    first_at = first_at or now
                    handle.queue.put((handle, TokenEvent(-1, delta, index, now - sent, (now - last_at) * 1e3,
                                                         cached_prompt_tokens=None)))
                    text, index, last_at = text + delta, index + 1, now
    except Exception as error:  # unreachable server, HTTP error, malformed stream: the lane says why
        if not handle._cancel.is_set():
            handle.queue.put((handle, ConfigError(f"the external engine at {base} failed: {_why(error)}")))
        return
    if handle._cancel.is_set():
        return
    generated = (usage or {}).get("completion_tokens") or index
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    ttft_ms = ((first_at or last_at) - sent) * 1e3
    decode_s = last_at - first_at if first_at else 0.0
    stats = GenerationStats(
        kv_mode="external", prompt_tokens=(usage or {}).get("prompt_tokens", 0), cached_prompt_tokens=cached,
        generated_tokens=generated, finish_reason=reason if reason == "stopped" else FINISH_REASONS.get(reason, "eos"),
        ttft_ms=ttft_ms, prefill_tokens_per_s=0.0,
        decode_tokens_per_s=(generated - 1) / decode_s if decode_s > 0 and generated > 1 else 0.0,
        total_ms=(last_at - sent) * 1e3, kv_bytes_in_use=0, kv_bytes_reserved=0)
    handle.queue.put((handle, FinishEvent(text, [], stats)))
