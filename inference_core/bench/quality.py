"""What a configuration costs in quality, measured: `python -m inference_core quality`.

This module owns two measurements and the table that sets configurations side by side, the unquantized reference
first:
- `perplexity`: exp of the mean negative log-likelihood of every predicted token of an eval text, the text cut into
  chunks of the context window, each chunk forwarded through the engine's own runner and KV cache (so a KV-cache
  setting such as an int8 cache shows in the number: attention reads K and V back from the cache even in a prefill).
- `greedy_agreement`: the same prompts generated greedily by the reference and by a candidate; how much of the
  reference's output the candidate reproduces before its first different token.
A row with a quantized KV cache also carries `kv_kl`: the mean KL divergence of the model-dtype cache's next-token
distributions to its own, both caches run side by side over the same slices. `--eval-text` scores any plain text
file, `--slice-tokens` sets how much of a chunk each step forwards (a smaller slice reads more of the chunk back from
the cache, as decoding does), and `--sliding-window N --attention-sinks S` apply a window (and sinks) to every row.
A table row also carries the weights' size (`quant.weight_bytes`), the KV cache's bytes per token and the dtype
the projections compute in: a quantized projection's activation dtype is picked by timing on a CPU
(`quant.compute_dtype`), and an int8 row scores differently with bf16 activations than with fp32 ones.

The eval text, `data/eval_text.txt`: the first 39,608 characters (12,065 SmolLM2 tokens, so one chunk fills
SmolLM2's 8,192-token context) of "tinyshakespeare", the file `data/tinyshakespeare/input.txt` of Andrej Karpathy's
char-rnn repository (github.com/karpathy/char-rnn), copied unchanged: the opening of William Shakespeare's
*The Tragedy of Coriolanus* (Act 1 to Act 2, scene 1) with speaker names and without stage directions. Shakespeare's
text is in the public domain.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from inference_core.bench.prompts import DEFAULT_PROMPTS, load_prompts
from inference_core.config import KV_DTYPES, ConfigError, EngineConfig
from inference_core.engine.engine import Engine, make_kv_cache
from inference_core.engine.runner import ModelRunner
from inference_core.model.loader import LoadedModel, add_model_arguments, load_model
from inference_core.model.paths import DATA_DIR
from inference_core.quant.linear import INT4_SCHEMES, SCHEMES, QuantConfig, weight_bytes
from inference_core.quant.quantize import quantize
from inference_core.sampling import SamplingParams
from inference_core.sequence import Sequence

EVAL_TEXT = DATA_DIR / "eval_text.txt"
# Tokens forwarded per runner call while measuring perplexity. Their fp32 logits are [512, vocab]: 96 MiB for
# SmolLM2's 49,152 ids, where a whole 8,192-token chunk's would be 1.5 GiB.
SLICE_TOKENS = 512
COLUMNS = ("name", "quant", "kv_dtype", "activations", "weights_mib", "kv_bytes_per_token", "perplexity", "delta_pct",
           "kv_kl", "greedy_agreement", "diverged", "first_divergence", "seconds")


@dataclass(frozen=True, slots=True)
class Perplexity:
    """One perplexity measurement over a token sequence."""

    perplexity: float  # exp(mean_nll)
    mean_nll: float  # nats per predicted token
    num_predicted: int  # every token of every chunk but the chunk's first (nothing before it to predict from)
    num_chunks: int
    window: int  # tokens per chunk
    kv_bytes_per_token: int  # bytes one token's K and V took in the cache the text went through
    seconds: float
    # With a reference config: mean KL divergence (nats a predicted token) of this cache's next-token distribution
    # from the reference cache's, the same model and slices
    kl: float | None = None


@dataclass(frozen=True, slots=True)
class Agreement:
    """A candidate's greedy ids against the reference's, prompt by prompt (see `greedy_agreement`)."""

    greedy_agreement: float  # matched reference ids / all reference ids, over all prompts
    first_divergence: list[int | None]  # per prompt: index of the first differing generated id; None: identical


@dataclass(frozen=True, slots=True)
class Variant:
    """One row of the table: a weight quantization and a KV-cache dtype."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    kv_dtype: str = "auto"

    @property
    def name(self) -> str:
        """e.g. 'reference', 'int4 g32', 'kv int8', 'int8 + kv int8'."""
        parts = ([self.quant.name] if self.quant.scheme != "none" else []) + (
            [f"kv {self.kv_dtype}"] if self.kv_dtype != "auto" else [])
        return " + ".join(parts) or "reference"


def eval_token_ids(tokenizer, path: str | Path = EVAL_TEXT, max_tokens: int | None = None) -> list[int]:
    """The eval text's token ids (no special tokens added), the first `max_tokens` of them when given."""
    ids = tokenizer.encode(Path(path).read_text(), add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids


@torch.inference_mode()
def perplexity(loaded: LoadedModel, config: EngineConfig, token_ids: list[int], window: int | None = None,
               slice_tokens: int = SLICE_TOKENS, reference: EngineConfig | None = None) -> Perplexity:
    """Perplexity of `token_ids` under `loaded` (quantized or not) with `config`'s KV cache (mode, dtype, block size,
    sliding window and sinks).

    The ids are cut into chunks of `window` tokens (default: the engine's context, `config.context_length`); each
    chunk starts afresh at position 0 and forwards in slices of `slice_tokens` through the runner and a KV cache made
    by `engine.make_kv_cache`, so each slice attends to the K/V that earlier slices stored, read back as the engine
    reads them (a smaller slice reads more of its context back from the cache, as decoding does). Token i's logits
    score token i + 1 (log-softmax in fp32); the result is exp of the mean NLL over all predicted tokens of all
    chunks, each token counted once. With `reference` (another KV-cache config), the same slices also run through a
    cache of that config, and `kl` is the mean KL(reference || this) of the next-token distributions."""
    context = config.context_length(loaded.config)
    window = window or context
    if not 2 <= window <= context:
        raise ConfigError(f"the perplexity window must be 2 to {context} tokens (the engine's context), got {window}.")
    if config.kv_mode == "none":
        raise ConfigError("perplexity reads K and V back through a KV cache: use kv_mode contiguous or paged.")
    if len(token_ids) < 2:
        raise ConfigError(f"perplexity needs at least 2 tokens of text, got {len(token_ids)}.")
    if not slice_tokens >= 1:
        raise ConfigError(f"the perplexity slice must be at least 1 token, got {slice_tokens}.")

    def measuring(engine_config: EngineConfig):
        # A cache for one chunk: one sequence, no prefix cache (a hit would skip computing tokens we must score).
        cache = make_kv_cache(loaded, replace(engine_config, max_seq_len=window, kv_cache_tokens=None, max_num_seqs=1,
                                              prefix_cache=False, compile=False), window)
        return cache, ModelRunner(loaded.model, cache, loaded.device)

    caches = [measuring(config)] + ([measuring(reference)] if reference is not None else [])
    started = time.perf_counter()
    total_nll, total_kl, num_predicted, num_chunks = 0.0, 0.0, 0, 0
    for start in range(0, len(token_ids), window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:
            continue  # a last chunk of one token has nothing to predict
        targets = torch.tensor(chunk[1:], dtype=torch.long, device=loaded.device)  # [len(chunk) - 1]
        seqs = [Sequence(list(chunk)) for _ in caches]
        for (cache, _), seq in zip(caches, seqs):
            cache.allocate(seq)
        try:
            # Tokens 0 .. len - 2 predict tokens 1 .. len - 1; the last token is never forwarded.
            for first in range(0, len(chunk) - 1, slice_tokens):
                count = min(slice_tokens, len(chunk) - 1 - first)
                logits = [runner.run([seq], [count], num_logits=count).float()  # [count, vocab] each
                          for (_, runner), seq in zip(caches, seqs)]
                total_nll += F.cross_entropy(logits[0], targets[first:first + count], reduction="sum").item()
                if reference is not None:
                    total_kl += F.kl_div(F.log_softmax(logits[0], -1), F.log_softmax(logits[1], -1),
                                         reduction="sum", log_target=True).item()
        finally:
            for (cache, _), seq in zip(caches, seqs):
                cache.free(seq)
        num_predicted += len(chunk) - 1
        num_chunks += 1
    mean_nll = total_nll / num_predicted
    return Perplexity(math.exp(mean_nll), mean_nll, num_predicted, num_chunks, window, caches[0][0].bytes_per_token,
                      time.perf_counter() - started, total_kl / num_predicted if reference is not None else None)


def activation_dtype(loaded: LoadedModel) -> str:
    """The dtype the projections compute in: a quantized projection's (`QuantLinear.compute`), else the model's."""
    compute = next((module.compute for module in loaded.model.modules()
                    if isinstance(getattr(module, "compute", None), torch.dtype)), loaded.dtype)
    return str(compute).removeprefix("torch.")


def prompt_token_ids(loaded: LoadedModel, rows: list[dict]) -> list[list[int]]:
    """Benchmark prompt rows (`inference_core.bench.prompts`) -> prompt ids, through the chat template except for the
    `completion` kind, as the bench tokenizes them."""
    tokenizing = Engine(loaded, EngineConfig(kv_mode="none"))  # holds no KV memory
    return [tokenizing.prompt_ids(row["prompt"], row.get("system"), chat=row.get("kind") != "completion")
            for row in rows]


def greedy_generations(loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]],
                       max_new_tokens: int = 64) -> list[list[int]]:
    """Each prompt alone on one engine with `config`, greedy, up to `max_new_tokens` ids, stopping at an
    end-of-sequence id (which is kept); returns the generated ids per prompt."""
    longest = max(len(ids) for ids in prompts) + max_new_tokens
    engine = Engine(loaded, replace(config, max_seq_len=min(longest, config.context_length(loaded.config)),
                                    kv_cache_tokens=None))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [engine.complete(list(ids), params).token_ids for ids in prompts]


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> Agreement:
    """How far a candidate's greedy ids follow the reference's, prompt by prompt.

    Per prompt, `first_divergence` is the index (0 = the first generated id) of the first position where the two
    differ, a sequence that ended counting as different from one that goes on; None when both are identical. Up to
    that index the candidate reproduced the reference (after it, the texts have different contexts and are not
    compared). `greedy_agreement` = the reference ids matched before each prompt's first divergence, summed over the
    prompts, over all reference ids: 1.0 when every prompt is identical, 0.0 when every first id differs."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs but {len(candidate)} candidate outputs.")
    divergences: list[int | None] = []
    for ref, cand in zip(reference, candidate):
        shared = min(len(ref), len(cand))
        index = next((i for i in range(shared) if ref[i] != cand[i]), shared)
        divergences.append(None if index == len(ref) == len(cand) else index)
    matched = sum(len(ref) if index is None else min(index, len(ref)) for ref, index in zip(reference, divergences))
    total = sum(len(ref) for ref in reference)
    return Agreement(matched / total if total else 1.0, divergences)


def quality_table(loaded: LoadedModel, variants: list[Variant], token_ids: list[int],
                  prompts: list[list[int]] | None = None, window: int | None = None, max_new_tokens: int = 64,
                  base: EngineConfig | None = None, log=None, slice_tokens: int = SLICE_TOKENS):
    """One row per configuration, the reference (no quantization, KV cache in the model dtype) first, as a pandas
    DataFrame with `COLUMNS`; `delta_pct` is the perplexity's change against the reference in percent; a row with a
    quantized KV cache has `kv_kl`, the mean KL divergence of its next-token distributions from those of the same
    weights with the cache in the model dtype (one run of both, side by side). With
    `prompts` (prompt ids), each row's greedy generations are compared with the reference's (`greedy_agreement`;
    `diverged` counts the prompts that differ, `first_divergence` is their median first differing index);
    without, those columns are empty. Returns (table, per row name: each prompt's first divergence)."""
    base = base or EngineConfig()
    reference = Variant()
    rows, by_prompt, reference_ids, reference_ppl = [], {}, None, None
    for variant in [reference] + [v for v in variants if v != reference]:
        started = time.perf_counter()
        model = quantize(loaded, variant.quant)
        config = replace(base, kv_dtype=variant.kv_dtype)
        measured = perplexity(model, config, token_ids, window, slice_tokens,
                              reference=replace(base, kv_dtype="auto") if variant.kv_dtype != "auto" else None)
        reference_ppl = reference_ppl or measured.perplexity
        row = {"name": variant.name, "quant": variant.quant.name, "kv_dtype": variant.kv_dtype,
               "activations": activation_dtype(model),
               "weights_mib": round(weight_bytes(model.model) / 2**20, 1),
               "kv_bytes_per_token": measured.kv_bytes_per_token, "perplexity": round(measured.perplexity, 4),
               "delta_pct": round(100 * (measured.perplexity / reference_ppl - 1), 2),
               "kv_kl": None if measured.kl is None else round(measured.kl, 5),
               "greedy_agreement": None, "diverged": None, "first_divergence": None}
        if prompts:
            generated = greedy_generations(model, config, prompts, max_new_tokens)
            reference_ids = reference_ids or generated
            agreement = greedy_agreement(reference_ids, generated)
            diverged = [index for index in agreement.first_divergence if index is not None]
            row.update(greedy_agreement=round(agreement.greedy_agreement, 4), diverged=len(diverged),
                       first_divergence=statistics.median(diverged) if diverged else None)
            by_prompt[variant.name] = agreement.first_divergence
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        if log:
            log(f"  {row['name']}: perplexity {row['perplexity']} ({row['delta_pct']:+.2f}%), greedy agreement "
                f"{row['greedy_agreement']}, {row['seconds']} s")
    return pd.DataFrame(rows, columns=list(COLUMNS)), by_prompt


def _choices(flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated flag value -> its distinct items, each checked against `allowed`."""
    items = list(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ConfigError(f"{flag}: unknown value {unknown[0] if unknown else value!r}; use a comma-separated list "
                          f"of: {', '.join(allowed)}.")
    return items


def add_quality_arguments(parser: argparse.ArgumentParser) -> None:
    """`python -m inference_core quality`'s flags."""
    add_model_arguments(parser, dtype="float32")  # the reference is full precision unless asked otherwise
    parser.add_argument("--quant", default="none,int8,int4",
                        help=f"weight quantizations, comma-separated, from: {', '.join(SCHEMES)}; an int4 or int8 one "
                             f"with '+a8' for int8 activations (e.g. int4+a8, int8+a8)")
    parser.add_argument("--quant-group", type=int, default=32, help="int4: input features per scale and zero")
    parser.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=True,
                        help="quantize the LM head with the projections (--no-quant-lm-head: keep it in the model "
                             "dtype)")
    parser.add_argument("--kv-dtype", default="auto",
                        help=f"KV cache dtypes, comma-separated, from: {', '.join(KV_DTYPES)}")
    parser.add_argument("--window", type=int, help="perplexity chunk length (default: the model's context, at most "
                                                   "8192; smaller is faster)")
    parser.add_argument("--slice-tokens", type=int, default=SLICE_TOKENS,
                        help="tokens forwarded a step within a chunk: each step reads the earlier ones back from the "
                             "KV cache, so a smaller slice measures more of what decoding reads (default: %(default)s)")
    parser.add_argument("--eval-text", help="any plain text file to measure perplexity on (default: the shipped "
                                            f"{EVAL_TEXT.name})")
    parser.add_argument("--eval-tokens", type=int, help="use only the eval text's first N tokens")
    parser.add_argument("--sliding-window", type=int, help="every row attends to the last N tokens only")
    parser.add_argument("--attention-sinks", type=int, default=0,
                        help="with --sliding-window: every token also attends to its chunk's first N tokens")
    parser.add_argument("--kv", dest="kv_mode", default="paged", choices=("contiguous", "paged"),
                        help="the KV cache the text goes through (default: paged)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt for the agreement")
    parser.add_argument("--prompts", help="JSONL prompt file (default: the packaged benchmark prompts)")
    parser.add_argument("--prompt-ids", help="comma-separated prompt ids (default: every prompt of the file)")
    parser.add_argument("--no-agreement", action="store_true", help="perplexity only: no greedy generations")
    parser.add_argument("--json", dest="json_path", help="write the rows and the host here")


def run_quality(args) -> int:
    """`python -m inference_core quality`: the table printed, the rows and the host written to --json."""

    # 1. Every flag checked before the model loads.
    schemes = _choices("--quant", args.quant, SCHEMES + tuple(f"{scheme}+a8" for scheme in (*INT4_SCHEMES, "int8")))
    kv_dtypes = _choices("--kv-dtype", args.kv_dtype, KV_DTYPES)
    variants = [Variant(QuantConfig(scheme.removesuffix("+a8"), args.quant_group, args.quant_lm_head,
                                    "int8" if scheme.endswith("+a8") else "model") if scheme != "none"
                        else QuantConfig(), kv_dtype)
                for scheme in schemes for kv_dtype in kv_dtypes]
    for flag, value, least in (("--window", args.window, 2), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--eval-tokens", args.eval_tokens, 2), ("--slice-tokens", args.slice_tokens, 1),
                               ("--sliding-window", args.sliding_window, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}.")
    eval_text = Path(args.eval_text) if args.eval_text else EVAL_TEXT
    if not eval_text.is_file():
        raise ConfigError(f"--eval-text: no file at {eval_text}.")
    base = EngineConfig(kv_mode=args.kv_mode, sliding_window=args.sliding_window,
                        attention_sinks=args.attention_sinks)
    rows = []
    if not args.no_agreement:
        rows = load_prompts(args.prompts or DEFAULT_PROMPTS)
        if args.prompt_ids:
            by_id, wanted = {row["id"]: row for row in rows}, _choices("--prompt-ids", args.prompt_ids,
                                                                       tuple(row["id"] for row in rows))
            rows = [by_id[prompt_id] for prompt_id in wanted]
    # 2. The model, the text and the prompts as ids; then one row per configuration.
    loaded = load_model(args.model, args.device, args.dtype)
    try:
        token_ids = eval_token_ids(loaded.tokenizer, eval_text, args.eval_tokens)
    except UnicodeDecodeError as error:
        raise ConfigError(f"--eval-text: {eval_text} is not UTF-8 text ({error.reason}).") from None
    base.sink_tokens(loaded.config)  # sinks without a window say so before any row runs
    prompts = prompt_token_ids(loaded, rows) if rows else None
    window = args.window or EngineConfig().context_length(loaded.config)
    attending = (f", a sliding window of {args.sliding_window}" + (f" and {args.attention_sinks} sinks"
                                                                   if args.attention_sinks else "")
                 if args.sliding_window else "")
    print(f"quality: {loaded.display_name} on {loaded.device} in {loaded.dtype_name}, {len(token_ids)} tokens of "
          f"{eval_text.name} in chunks of {window} (slices of {args.slice_tokens}, {args.kv_mode} KV{attending}), "
          f"{len(rows)} prompts x {args.max_new_tokens} greedy tokens", flush=True)
    table, by_prompt = quality_table(loaded, variants, token_ids, prompts, window, args.max_new_tokens, base,
                                     log=lambda line: print(line, flush=True), slice_tokens=args.slice_tokens)
    print(table.to_string(index=False))
    if args.json_path:
        records = [{key: (None if isinstance(value, float) and math.isnan(value) else value)
                    for key, value in row.items()} for row in table.to_dict("records")]
        report = {"model": loaded.name, "model_name": loaded.display_name, "device": str(loaded.device),
                  "dtype": loaded.dtype_name, "torch": torch.__version__,
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                  "machine": platform.machine(), "eval_text": eval_text.name, "eval_tokens": len(token_ids),
                  "window": window, "slice_tokens": args.slice_tokens, "kv_mode": args.kv_mode,
                  "sliding_window": args.sliding_window, "attention_sinks": args.attention_sinks,
                  "max_new_tokens": args.max_new_tokens,
                  "prompts": [row["id"] for row in rows], "rows": records,
                  "first_divergence_by_prompt": {name: dict(zip([row["id"] for row in rows], indices))
                                                 for name, indices in by_prompt.items()}}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_path}")
    return 0
