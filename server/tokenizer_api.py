"""vLLM's tokenizer endpoints, in vLLM's request and response shapes, on the API's port: what a scoring client such as
lm-evaluation-harness (`tokenizer_backend=remote`) reads instead of a local copy of the tokenizer.

    POST /tokenize        {"prompt": text, "add_special_tokens": true} or {"messages": [...],
                          "add_generation_prompt": true, "add_special_tokens": false}; optional "model",
                          "return_token_strs" -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]}; optional "model" -> {"prompt"}
    GET  /tokenizer_info  the special tokens, the chat template and the context length

The served model's own tokenizer (the one the engine encodes prompts with) answers; nothing runs on the device. Bad
input is a 400 in OpenAI's error shape naming the field; in public mode each call counts against the caller's
requests per minute, as a completion does (`serving.policy.CallerLimits`), and the body has the API's size limit.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from inference_core.config import ConfigError
from server.api_body import APIError, bad, error_response, flag, read_body, read_messages
from serving.policy import LimitExceeded

FIELDS = {"tokenize": {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                       "return_token_strs"},
          "detokenize": {"model", "tokens"}}


class TokenizerAPI:
    def __init__(self, api):
        """`api`: the `OpenAIAPI` beside it (its pool, model names, caller identity, metrics and error shape)."""
        self.api, self.pool = api, api.pool
        self.tokenizer = self.pool.loaded.tokenizer
        self.router = APIRouter()
        self.router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        self.router.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        self.router.add_api_route("/tokenizer_info", self.tokenizer_info, methods=["GET"])

    async def tokenize(self, http: Request):
        return await self._serve(http, "tokenize", self._tokenize)

    async def detokenize(self, http: Request):
        return await self._serve(http, "detokenize", self._detokenize)

    async def tokenizer_info(self):
        tokenizer = self.tokenizer
        self.api.metrics.http.labels("/tokenizer_info", "200").inc()
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
                "chat_template": tokenizer.chat_template, "model_max_length": self.pool.max_seq_len,
                "vocab_size": tokenizer.vocab_size}

    async def _serve(self, http: Request, name: str, answer):
        try:
            body = await read_body(http)
            unknown = sorted(set(body) - FIELDS[name])
            if unknown:
                raise bad(f"unrecognized request argument supplied: {unknown[0]} (/{name} accepts "
                          f"{', '.join(sorted(FIELDS[name]))}).", unknown[0])
            if body.get("model") is not None:
                self.api.check_model(body["model"])
            try:
                self.pool.limits.admit(self.api.caller(http), 0)
            except LimitExceeded as error:
                raise APIError(429, str(error), code="rate_limited", retry_after_s=error.retry_after_s) from None
            response = JSONResponse(answer(body))
        except APIError as error:
            response = error_response(error)
        self.api.metrics.http.labels(f"/{name}", str(response.status_code)).inc()
        return response

    def _tokenize(self, body: dict) -> dict:
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise bad("give 'prompt' (a string) or 'messages' (a chat), one of them.",
                      "messages" if has_messages else "prompt")
        if has_prompt:
            if not isinstance(body["prompt"], str):
                raise bad(f"'prompt' must be a string, got {json.dumps(body['prompt'])[:40]}.", "prompt")
            special = body.get("add_special_tokens") is None or flag(body, "add_special_tokens")
            if body.get("add_generation_prompt") is not None:
                raise bad("'add_generation_prompt' goes with 'messages'.", "add_generation_prompt")
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=special)
        else:
            messages = read_messages(body)
            generation = body.get("add_generation_prompt") is None or flag(body, "add_generation_prompt")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation)
            except ConfigError as error:
                raise bad(str(error), "messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=flag(body, "add_special_tokens"))
        strs = [self.tokenizer.token_string(i) for i in ids] if flag(body, "return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.pool.max_seq_len, "tokens": ids, "token_strs": strs}

    def _detokenize(self, body: dict) -> dict:
        tokens, size = body.get("tokens"), self.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad("'tokens' must be a list of token ids (integers).", "tokens")
        outside = next((t for t in tokens if not 0 <= t < size), None)
        if outside is not None:
            raise bad(f"'tokens' holds {outside}, outside this tokenizer's ids 0 to {size - 1}.", "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}

