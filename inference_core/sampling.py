"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.

`SamplingParams` holds one request's settings and validates them: how to choose (above), what shapes the logits first
(logit bias, min_tokens, penalties, a grammar's constraint: `inference_core.logits`), when to stop, and which
log-probabilities to report. `sample` turns a [vocab] fp32 logits row into a token id, and `sample_batch` a
[batch, vocab] block of rows, each with its own request's settings and generator. Greedy is `temperature == 0` and is
an argmax, so it is exactly what Hugging Face `generate` picks with `do_sample=False`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_core.config import ConfigError
from inference_core.model.row_kernel import argmax_rows

MIN_TEMPERATURE = 1e-3
MAX_LOGPROBS = 20  # alternatives a token may report (OpenAI's top_logprobs limit)
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not included in the output)
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks want a fixed token count)
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one (0: off)
    # Penalties, with OpenAI's and vLLM's meanings: presence and frequency subtract from the logits of tokens already
    # generated (once, and once per occurrence); repetition divides a positive logit (multiplies a negative one) of
    # every token in the prompt or the output (1: off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted too
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many tokens are generated
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the output (like end-of-sequence, finish reason "stop")
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in its text
    skip_special_tokens: bool = True  # leave special tokens (chat-template markers) out of the text
    # Log-probabilities of each generated token and of its top `logprobs` alternatives (None: none computed; 0: the
    # chosen token's only), from the model's own distribution ("raw": log-softmax of the logits) or from the one the
    # token was drawn from ("processed": after penalties, bias, the constraint, temperature and top-k/top-p/min-p).
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    constraint: object | None = None  # `inference_core.structured.Constraint`: the output follows a grammar

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer of at least 1 ({{max_new_tokens}}), "
                              f"got {self.max_new_tokens!r}.")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (smaller ones overflow "
                              f"the logits in fp32), got {self.temperature}.")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}.")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty.")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be between -2 and 2 (0 turns it off), got {getattr(self, name)}.")
        if not 0 < self.repetition_penalty <= 10:
            raise ConfigError(f"repetition_penalty must be above 0 and at most 10 (1 turns it off), got "
                              f"{self.repetition_penalty}.")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((_token_id(t, "logit_bias"), float(b)) for t, b in bias)))
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ConfigError("logit_bias values must be between -100 and 100.")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), got "
                              f"{self.min_tokens!r}.")
        object.__setattr__(self, "stop_token_ids",
                           tuple(_token_id(t, "stop_token_ids") for t in self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (or None: off), got "
                                  f"{value!r}.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the logits before the token is chosen (`inference_core.logits`)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.constraint is not None)


def _token_id(value, field_name: str) -> int:
    """A token id from an int or (JSON object keys) a string of digits; the vocabulary bound is the engine's check."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{field_name} takes token ids (integers of at least 0), got {value!r}.")
    return value


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., vocab] fp32 -> the distribution sampling draws from (temperature, then min-p, top-k, top-p),
    per row. Speculative sampling needs it for several positions at once."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[..., 0] = False  # even when top_p rounds to 0 in fp32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32. Returns the chosen token id."""
    return sample_with_probabilities(logits, params, generator)[0]


def sample_with_probabilities(logits: torch.Tensor, params: SamplingParams,
                              generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """logits: [vocab] fp32. Returns the chosen token id and the [vocab] distribution it was drawn from (None when
    greedy: an argmax has none). A speculative draft model samples this way, since the acceptance rule needs q."""
    if params.greedy:
        return int(logits.argmax()), None
    distribution = probabilities(logits, params)
    return int(torch.multinomial(distribution, 1, generator=generator)), distribution


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """logits: [batch, vocab] fp32, one row per request. Greedy rows take one argmax over the whole block; sampled
    rows are grouped by identical settings, so each group's distribution is one batched `probabilities` call, and
    each row is drawn with its own request's seeded generator (the same draw as `sample` on that row alone)."""
    chosen = argmax_rows(logits).tolist()  # one host sync for the whole batch
    groups: dict[tuple, list[int]] = {}
    for row, row_params in enumerate(params):
        if not row_params.greedy:
            groups.setdefault((row_params.temperature, row_params.top_k, row_params.top_p, row_params.min_p),
                              []).append(row)
    for rows in groups.values():
        distributions = probabilities(logits[rows], params[rows[0]])  # [rows, vocab]
        for distribution, row in zip(distributions, rows):
            chosen[row] = int(torch.multinomial(distribution, 1, generator=generators[row]))
    return chosen
