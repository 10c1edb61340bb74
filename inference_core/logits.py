"""What happens to a row of logits between the forward and the chosen token, and what the row says about that token.

Shaping (`shape_logits`), per row, in vLLM's order: the logit bias is added; while fewer than `min_tokens` are
generated, end-of-sequence and the stop token ids are masked; the repetition penalty divides a positive logit (and
multiplies a negative one) of every token in the prompt or the output; the frequency and presence penalties subtract
from the logits of tokens already generated; the grammar's mask (`allowed`) leaves only the tokens the constraint
permits. Temperature, top-k, top-p and min-p come after, in `sampling.probabilities`. A row whose settings shape
nothing is not copied: requests that ask for none of this pay nothing.

Log-probabilities (`token_logprobs`): the chosen token's log-probability, the top-k alternatives' and the entropy (in
nats) of the distribution, from the raw logits (the model's own distribution, as vLLM and OpenAI return by default)
or, with `logprobs_mode="processed"`, from the distribution the token was drawn from. Computed only for the rows of
requests that ask, with one host transfer for the whole batch. A log-probability of minus infinity (a token masked
out) is reported as `LOGPROB_FLOOR`, as vLLM does, so that it stays a JSON number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_core.sampling import SamplingParams, probabilities

LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class RowContext:
    """What shaping one row needs: the request's settings, its text so far (prompt then output, and in a speculative
    verification the drafts before this row's position), the ids min_tokens masks (end-of-sequence and the stop token
    ids), and the grammar's allowed ids."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    stop_ids: frozenset[int] = frozenset()
    allowed: torch.Tensor | None = None  # [vocab] bool, None: every token


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated (or prompt) token's log-probability, its top alternatives best first, and the entropy."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability)
    entropy: float


def shapes(row: RowContext | None) -> bool:
    return row is not None and (row.params.shapes_logits or row.allowed is not None)


def shape_logits(logits: torch.Tensor, rows: list[RowContext | None]) -> torch.Tensor:
    """logits: [rows, vocab] fp32 -> the shaped logits (the same tensor when no row shapes anything)."""
    if not any(shapes(row) for row in rows):
        return logits
    out = logits.clone()
    for index, row in enumerate(rows):
        if shapes(row):
            _shape_row(out[index], row)
    return out


def _shape_row(x: torch.Tensor, row: RowContext) -> None:
    """x: [vocab], shaped in place."""
    params, vocab = row.params, x.shape[-1]
    generated = row.token_ids[row.num_prompt_tokens:]
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x.index_add_(0, torch.tensor(ids, device=x.device), torch.tensor(bias, device=x.device, dtype=x.dtype))
    if len(generated) < params.min_tokens:
        stop = [token for token in row.stop_ids if token < vocab]
        if stop:
            x[stop] = float("-inf")
    if params.repetition_penalty != 1 and row.token_ids:
        ids = torch.tensor(sorted(set(row.token_ids)), device=x.device)
        seen = x[ids]
        x[ids] = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, device=x.device), minlength=vocab)[:vocab].to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)
    if row.allowed is not None:
        allowed = row.allowed[:vocab]
        if not (allowed & ~torch.isneginf(x)).any():
            # min_tokens masked the only tokens the grammar allows (it can only end here): the grammar wins
            x.masked_fill_(torch.isneginf(x), 0.0)
        x.masked_fill_(~allowed, float("-inf"))


def token_logprobs(raw: torch.Tensor, shaped: torch.Tensor, rows: list[RowContext | None],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """raw, shaped: [rows, vocab] fp32 logits before and after shaping; tokens: the chosen id per row. Returns, for
    each row whose request asked for log-probabilities, the chosen token's and its top alternatives' (None for the
    others). One log-softmax, one top-k and one host transfer for all the rows that ask."""
    asking = [i for i, row in enumerate(rows) if row is not None and row.params.logprobs is not None]
    if not asking:
        return [None] * len(rows)
    if all(rows[i].params.logprobs_mode == "raw" for i in asking):
        logprobs = (raw if len(asking) == len(rows) else raw[asking]).log_softmax(-1)  # [asking, vocab]
    else:
        logprobs = torch.stack([_distribution(raw[i], shaped[i], rows[i].params) for i in asking])
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in asking], device=raw.device)[:, None])[:, 0]
    entropy = -(logprobs.exp() * logprobs).nansum(-1)  # nansum: a masked token adds 0 x -inf = nan, taken as 0
    top_k = max(rows[i].params.logprobs for i in asking)
    top_values, top_ids = logprobs.topk(top_k) if top_k else (logprobs[:, :0], logprobs[:, :0].long())
    # -inf (a masked token) becomes the floor, a JSON number
    chosen, top_values = chosen.clamp(min=LOGPROB_FLOOR), top_values.clamp(min=LOGPROB_FLOOR)
    chosen, entropy, top_values, top_ids = chosen.tolist(), entropy.tolist(), top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(rows)
    for n, i in enumerate(asking):
        k = rows[i].params.logprobs
        out[i] = TokenLogprobs(chosen[n], tuple(zip(top_ids[n][:k], top_values[n][:k])), entropy[n])
    return out


def _distribution(raw: torch.Tensor, shaped: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[vocab] log-probabilities: the model's own (raw), or the distribution the token was drawn from."""
    if params.logprobs_mode == "raw":
        return raw.log_softmax(-1)
    if params.greedy:
        return shaped.log_softmax(-1)
    return probabilities(shaped, params).log()


def logprobs_of(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """Raw log-probabilities of `tokens[i]` under logits row i ([rows, vocab] fp32), with `num_top` alternatives."""
    params = SamplingParams(max_new_tokens=1, logprobs=num_top)
    rows = [RowContext(params, [], 0)] * len(tokens)
    return token_logprobs(logits, logits, rows, tokens)
