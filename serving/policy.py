"""What one deployment lets its callers do: the caps every request meets (prompt length, new tokens, the queue) and,
in public mode, the allowlists and per-caller limits that keep strangers sharing one engine from starving or reading
each other.

`ServePolicy` is chosen at launch (`app.py` flags) and shared by the page and the HTTP API, so both refuse the same
things with the same words. `CallerLimits` counts each caller's requests per minute and tokens per hour; a caller is
a client address (the page's visitors and the API's callers alike: an API key is not an identity a stranger cannot
make up, so in public mode the limits follow the address and the key only salts the prefix cache).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from inference_core import ConfigError


class LimitExceeded(ConfigError):
    """A caller is over a cap that frees with time (the API answers 429 with `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def looks_like_path(value: str) -> bool:
    """Whether a model name is a local path rather than a Hub id ('org/name') or a served name."""
    return (value.startswith(("/", "~", ".", "\\")) or value.endswith((".gguf", ".safetensors"))
            or "\\" in value or value.count("/") > 1 or (len(value) > 1 and value[1] == ":")
            or Path(value).expanduser().exists())


@dataclass(frozen=True)
class ServePolicy:
    public: bool = False
    allowed_models: tuple[str, ...] = ()  # public mode: what may be loaded and named (empty: the served model only)
    allowed_endpoints: tuple[str, ...] = ()  # external-engine URLs a lane may target (public mode: only these)
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512
    max_queue: int = 32  # requests waiting or running on the engines before new ones get 429
    requests_per_minute: int = 0  # per caller; 0: unlimited
    tokens_per_hour: int = 0  # prompt + generated tokens per caller; 0: unlimited
    n_max: int = 4  # completions per API request

    @classmethod
    def public_defaults(cls, **overrides) -> "ServePolicy":
        """Public mode's defaults (a Space): a stranger may ask for 20 requests a minute and 20,000 tokens an hour."""
        values = dict(public=True, max_prompt_tokens=2048, max_new_tokens=256, requests_per_minute=20,
                      tokens_per_hour=20_000, n_max=2)
        values.update(overrides)
        return cls(**values)

    def check_model_spec(self, spec: str, served: str) -> None:
        """At launch: public mode serves only an allowlisted model, never one from a local path."""
        if not self.public:
            return
        if spec != "bundled" and looks_like_path(spec):
            raise ConfigError(f"public mode does not load models from local paths ({spec!r}); name a Hub id from "
                              "the allowlist (--allow-model) or 'bundled'.")
        allowed = self.allowed_models or (served,)
        if spec not in allowed and served not in allowed:
            raise ConfigError(f"public mode: model {spec!r} is not in the allowlist ({', '.join(allowed)}).")

    def check_endpoint(self, url: str) -> None:
        """An external-engine URL: http(s) only; in public mode, only one chosen at launch (so a visitor cannot make
        the server fetch arbitrary addresses)."""
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"the external engine's URL must start with http:// or https://, got {url!r}.")
        if self.public and url.rstrip("/") not in {u.rstrip("/") for u in self.allowed_endpoints}:
            allowed = ", ".join(self.allowed_endpoints) or "none were allowed at launch"
            raise ConfigError(f"public mode: {url} is not an allowed external engine ({allowed}).")

    def check_sizes(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """The caps on one request (a ConfigError naming `{max_new_tokens}` in each surface's words)."""
        if prompt_tokens > self.max_prompt_tokens:
            raise ConfigError(f"the prompt has {prompt_tokens} tokens; this deployment accepts up to "
                              f"{self.max_prompt_tokens}.")
        if max_new_tokens > self.max_new_tokens:
            raise ConfigError(f"{{max_new_tokens}} is {max_new_tokens}; this deployment allows up to "
                              f"{self.max_new_tokens}.")


@dataclass
class CallerLimits:
    """Requests per minute and tokens per hour, per caller, over sliding windows; thread-safe."""

    policy: ServePolicy
    _requests: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    _tokens: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, caller: str, tokens: int, now: float | None = None) -> None:
        """Count one request of `caller` that may use up to `tokens` tokens, or raise LimitExceeded (nothing
        counted) saying when to retry."""
        now = time.monotonic() if now is None else now
        per_minute, per_hour = self.policy.requests_per_minute, self.policy.tokens_per_hour
        with self._lock:
            requests, spent = self._requests[caller], self._tokens[caller]
            while requests and requests[0] <= now - 60:
                requests.popleft()
            while spent and spent[0][0] <= now - 3600:
                spent.popleft()
            if per_minute and len(requests) >= per_minute:
                raise LimitExceeded(f"this caller sent {len(requests)} requests in the last minute; the limit is "
                                    f"{per_minute} a minute.", math.ceil(requests[0] + 60 - now))
            used = sum(count for _, count in spent)
            if per_hour and used + tokens > per_hour:
                if tokens > per_hour:
                    raise ConfigError(f"this request may use {tokens} tokens, over this deployment's "
                                      f"{per_hour} tokens per hour per caller; lower {{max_new_tokens}}.")
                free_at, freed = spent[0][0] + 3600 if spent else now, 0
                for at, count in spent:  # the earliest time enough of the window has expired
                    freed += count
                    free_at = at + 3600
                    if used - freed + tokens <= per_hour:
                        break
                raise LimitExceeded(f"this caller used {used} of its {per_hour} tokens in the last hour.",
                                    max(1, math.ceil(free_at - now)))
            if per_minute:
                requests.append(now)
            if per_hour:
                spent.append((now, tokens))

    def refund(self, caller: str, tokens: int) -> None:
        """Give back tokens admitted but not used (a request that generated fewer than it asked for)."""
        if tokens <= 0 or not self.policy.tokens_per_hour:
            return
        with self._lock:
            self._tokens[caller].append((time.monotonic(), -tokens))


def client_address(headers, peer: str | None, behind_proxy: bool) -> str | None:
    """Who a caller is, for the per-caller limits: behind a proxy (a Space) the first X-Forwarded-For hop, else the
    socket's peer address."""
    forwarded = headers.get("x-forwarded-for", "") if behind_proxy else ""
    return forwarded.split(",")[0].strip() if forwarded else peer


def cache_salt(api_key: str | None, caller: str) -> str:
    """The prefix-cache salt of an API caller: one per API key (a key's requests reuse each other's prefixes, no one
    else's), else one per client address. It is a hash, so the key never sits in engine state."""
    identity = f"key:{api_key}" if api_key else f"addr:{caller}"
    return "api-" + hashlib.sha256(identity.encode()).hexdigest()[:24]
