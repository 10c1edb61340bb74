"""OpenAI's response shapes for one request's choices: whole replies, streamed chunks, usage, log-probabilities, and
the playground's settings and measured timings under `playground`.

Log-probabilities follow OpenAI's two shapes: chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`
and completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with `echo`, the prompt's tokens come
first, the first with a null log-probability). Completions list every generated token, the one that ends the output
(end-of-sequence, a stop token id) included with an empty text, as vLLM does: a scoring client that sends `echo` and
`max_tokens: 1` reads the prompt's entries whatever the model would say next. Chat leaves that token out, as it is out
of the message. `max_tokens: 0` with `echo` (`Asked.prompt_only`) answers with the prompt alone: its text and its
entries, no generated token.
"""

from __future__ import annotations

import json
import time
import uuid

from inference_core.engine.request import FinishEvent, TokenEvent
from server.api_body import PLAYGROUND_FIELDS, Asked

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "stopped": "length"}


class Reply:
    """One request's replies: `whole` (not streamed) or `chunk`s, with log-probabilities where asked."""

    def __init__(self, kind: str, model: str, asked: Asked, tokenizer, prompt_ids: list[list[int]],
                 end_ids: frozenset[int]):
        self.kind, self.model, self.asked, self.settings = kind, model, asked, asked.settings
        self.tokenizer, self.prompt_ids, self.end_ids = tokenizer, prompt_ids, end_ids
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.generated: dict[int, int] = {}  # choice -> tokens so far (continuous usage)
        self.offsets: dict[int, int] = {}  # choice -> text offset of the next token (completions' logprobs)

    @property
    def wants_logprobs(self) -> bool:
        return self.asked.top_logprobs is not None

    # --- pieces ---------------------------------------------------------------------------------------------------

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompt_ids[choice // self.asked.n]

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

    def usage(self, finals: list[FinishEvent]) -> dict:
        prompt = sum(f.stats.prompt_tokens for f in finals)
        completion = 0 if self.asked.prompt_only else sum(f.stats.generated_tokens for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(f.stats.cached_prompt_tokens for f in finals)}}

    def finish_reason(self, final: FinishEvent) -> str:
        """OpenAI's word for how a choice ended ("length" for the prompt alone: nothing generated is shown)."""
        return "length" if self.asked.prompt_only else FINISH_REASONS.get(final.stats.finish_reason, "stop")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _chat_entry(self, event: TokenEvent) -> dict:
        top = [{"token": self.token_text(i), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(i))}
               for i, lp in event.top_logprobs]
        return {"token": self.token_text(event.token_id), "logprob": event.logprob,
                "bytes": list(self.tokenizer.token_bytes(event.token_id)), "top_logprobs": top}

    def logprobs(self, choice: int, events: list[TokenEvent], echo_prompt: bool = False) -> dict | None:
        """The log-probabilities of `events` (those that carry them) in this endpoint's shape, after the prompt's
        (carried by the first token's event) where `echo_prompt`; None if not asked."""
        if not self.wants_logprobs:
            return None
        if self.kind == "chat":
            shown = [e for e in events if e.logprob is not None and e.token_id not in self.end_ids]
            return {"content": [self._chat_entry(e) for e in shown], "refusal": None}
        entries = []  # (token id, logprob or None, top, its text)
        if echo_prompt and events and events[0].prompt_logprobs is not None:
            entries += [(token, None if lp is None else lp.logprob, None if lp is None else lp.top,
                         self.token_text(token))
                        for token, lp in zip(self.prompt_of(choice), events[0].prompt_logprobs)]
        if not self.asked.prompt_only:
            entries += [(e.token_id, e.logprob, e.top_logprobs, "" if e.token_id in self.end_ids
                         else self.token_text(e.token_id)) for e in events if e.logprob is not None]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top, text in entries:
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else {self.token_text(i): lp for i, lp in top})
            out["text_offset"].append(self.offsets.get(choice, 0))
            self.offsets[choice] = self.offsets.get(choice, 0) + len(text)
        return out

    def echo_text(self, choice: int) -> str:
        return self.tokenizer.decode(self.prompt_of(choice)) if self.asked.echo else ""

    # --- whole replies and chunks ---------------------------------------------------------------------------------

    def whole(self, finals: list[FinishEvent], events: list[list[TokenEvent]]) -> dict:
        choices = []
        for i, final in enumerate(finals):
            reason = self.finish_reason(final)
            logprobs = self.logprobs(i, events[i], echo_prompt=self.asked.echo)
            if self.kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": final.text},
                                "finish_reason": reason, "logprobs": logprobs})
            else:
                text = self.echo_text(i) + ("" if self.asked.prompt_only else final.text)
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals), "playground": self.playground(finals)}

    def wants_chunk(self, event: TokenEvent) -> bool:
        """A token event gets a chunk of its own when it carries text, or log-probabilities the client asked for (in
        completions an end token's too)."""
        if self.asked.prompt_only:
            return event.index == 0  # the echoed prompt
        return bool(event.text) or (self.wants_logprobs and (self.kind != "chat" or event.token_id not in self.end_ids))

    def chunk(self, index: int, event: TokenEvent | None = None, role: bool = False,
              final: FinishEvent | None = None) -> dict:
        text = event.text if event is not None and not self.asked.prompt_only else ""
        logprobs = None
        if event is not None:
            self.generated[index] = self.generated.get(index, 0) + 1
            first = event.index == 0
            if first and self.asked.echo:
                text = self.echo_text(index) + text
            logprobs = self.logprobs(index, [event], echo_prompt=first and self.asked.echo)
        reason = None if final is None else self.finish_reason(final)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        out = {"id": self.id, "object": self.object + ".chunk" if self.kind == "chat" else self.object,
               "created": self.created, "model": self.model, "choices": [choice]}
        if final is not None:
            out["playground"] = {"description": self.settings.describe(), "timings": [self.timings(final)]}
        if self.asked.continuous_usage:  # vLLM's: the choice's usage so far in every chunk
            prompt = len(self.prompt_of(index))
            completion = 0 if self.asked.prompt_only else self.generated.get(index, 0)
            out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
        elif self.asked.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, finals: list[FinishEvent]) -> dict:
        return {"id": self.id, "object": self.object + ".chunk" if self.kind == "chat" else self.object,
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(finals)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"
