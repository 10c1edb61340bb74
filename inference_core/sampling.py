"""Choosing the next token from logits: greedy, temperature, top-k, top-p, with a per-request seeded generator.

`SamplingParams` holds one request's settings and validates them; `sample` turns a [vocab] fp32 logits row into a
token id, and `sample_batch` a [batch, vocab] block of rows, each with its own request's settings and generator.
Greedy is `temperature == 0` and is an argmax, so it is exactly what Hugging Face `generate` picks with
`do_sample=False`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_core.config import ConfigError

MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (not included in the output)
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks want a fixed token count)

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    """logits: [..., vocab] fp32 -> the distribution sampling draws from (temperature, then top-k, then top-p), per
    row. Speculative sampling needs it for several positions at once."""
    logits = logits / params.temperature
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
    chosen = logits.argmax(dim=-1).tolist()  # one host sync for the whole batch
    groups: dict[tuple, list[int]] = {}
    for row, row_params in enumerate(params):
        if not row_params.greedy:
            groups.setdefault((row_params.temperature, row_params.top_k, row_params.top_p), []).append(row)
    for rows in groups.values():
        distributions = probabilities(logits[rows], params[rows[0]])  # [rows, vocab]
        for distribution, row in zip(distributions, rows):
            chosen[row] = int(torch.multinomial(distribution, 1, generator=generators[row]))
    return chosen
