"""Reading the model's distribution outside the decoding loop: the prompt's log-probabilities and the logit lens.

Both run one eager forward over a sequence with a throw-away KV cache (`RecomputeKVCache`, so nothing in the engine's
pool is touched), on the caller's thread: the engine calls `prompt_logprobs` inside its step, a front end runs
`logit_lens` through the engine loop (`EngineLoop.call`) so that it takes its turn on the device.

- `prompt_logprobs`: every prompt token's log-probability given the tokens before it (and the top alternatives),
  the LM head applied to the final-normed hidden states a chunk of rows at a time, so a long prompt never holds a
  [prompt, vocab] block of logits.
- `logit_lens`: for one token of a sequence, what each layer would predict there if it were the last: the final
  norm and the LM head applied to that layer's output at the position before it. The chosen token's probability
  and rank per layer show at which depth the answer forms (and why an early-exit draft at layer L is rejected as
  often as it is).
"""

from __future__ import annotations

import torch

from inference_core.engine.runner import ModelRunner
from inference_core.kv.cache import RecomputeKVCache
from inference_core.logits import TokenLogprobs, logprobs_of
from inference_core.sequence import Sequence

LOGIT_ROWS_PER_CHUNK = 256


def _fresh_runner(runner: ModelRunner) -> ModelRunner:
    return ModelRunner(runner.model, RecomputeKVCache(runner.kv_cache.sliding_window), runner.device)


@torch.inference_mode()
def prompt_logprobs(runner: ModelRunner, prompt_ids: list[int], num_top: int) -> tuple[TokenLogprobs | None, ...]:
    """One entry per prompt token: None for the first (nothing comes before it), then the raw log-probability of
    token i after tokens 0..i-1, with `num_top` alternatives."""
    fresh = _fresh_runner(runner)
    _, hidden = fresh.run([Sequence(list(prompt_ids))], return_hidden=True)
    hidden = hidden[0][:-1]  # [prompt - 1, hidden]: row i predicts token i + 1
    out: list[TokenLogprobs | None] = [None]
    for start in range(0, len(hidden), LOGIT_ROWS_PER_CHUNK):
        logits = runner.model.lm_head.forward(hidden[start:start + LOGIT_ROWS_PER_CHUNK]).float()
        out += logprobs_of(logits, prompt_ids[start + 1:start + 1 + len(logits)], num_top)
    return tuple(out)


@torch.inference_mode()
def logit_lens(runner: ModelRunner, token_ids: list[int], position: int, num_top: int = 5) -> list[dict]:
    """What each layer predicts for `token_ids[position]` (position >= 1) from the tokens before it: per layer,
    {"layer" (1-based), "token_prob", "token_rank" (0: the layer's top token), "top": [(token id, probability)],
    "entropy"}. The last layer's row is the model's own distribution."""
    if not 1 <= position < len(token_ids):
        raise ValueError(f"position must be between 1 and {len(token_ids) - 1}, got {position}.")
    fresh = _fresh_runner(runner)
    seq = Sequence(list(token_ids[:position]))
    fresh.kv_cache.ensure_capacity(seq)
    batch = fresh.prepare([seq], [position])
    states: list[torch.Tensor] = []
    model = runner.model
    model.forward(batch, fresh.kv_cache, layer_states=states)
    last = torch.stack([state[-1] for state in states])  # [layers, hidden]: each layer's output at position - 1
    logits = model.lm_head.forward(model.norm.forward(last)).float()  # [layers, vocab]
    logprobs = logits.log_softmax(-1)
    token = token_ids[position]
    token_logprob = logprobs[:, token]
    ranks = (logprobs > token_logprob[:, None]).sum(-1)
    top_values, top_ids = logprobs.topk(num_top)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return [{"layer": layer + 1, "token_prob": float(token_logprob[layer].exp()), "token_rank": int(ranks[layer]),
             "top": [(int(i), float(v.exp())) for i, v in zip(top_ids[layer], top_values[layer])],
             "entropy": float(entropy[layer])}
            for layer in range(len(states))]
