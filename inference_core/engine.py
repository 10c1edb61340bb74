"""The engine: turns a prompt into a stream of plain events, one per generated token and a final stats record.

`load_model` reads a checkpoint once (weights, config, tokenizer) onto a device and dtype; an `Engine` pairs a loaded
model with one `EngineConfig` (KV mode, block size, prefix cache) and owns that configuration's KV cache, so two
engines can race on one set of weights. `Engine.generate` validates the request and returns a generator; the
generator advances one model step per `next()`, which lets a caller interleave several requests fairly, and it
releases the request's KV memory however it ends: finished, failed, or closed early (cancelled).

Times are the request's own: the clock runs only while the generator is working, not while the caller holds it
suspended, so a request's numbers do not include time spent on someone else's work.

Two ways to end a request early: `close()` cancels it at once (no final event), while
`throw(StopGeneration)` stops it after the step in flight: the tokens that step already produced still arrive, then a
FinishEvent with finish_reason "stopped" and the stats of what was generated.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from inference_core.checkpoint import read_config, read_weights, resolve_model_dir
from inference_core.config import ConfigError, EngineConfig, ModelConfig, parse_device, parse_dtype
from inference_core.kv_cache import ContiguousKVCache, PagedKVCache
from inference_core.model import WEIGHT_LAYOUTS, CausalLM
from inference_core.runner import ModelRunner
from inference_core.sampling import SamplingParams, make_generator, sample
from inference_core.sequence import Sequence
from inference_core.speculative import (DraftModelDrafter, EarlyExitDrafter, NgramDrafter, SpecConfig, SpecStats,
                                        next_k, speculative_step)
from inference_core.tokenizer import IncrementalDetokenizer, Tokenizer


class StopGeneration(Exception):
    """Thrown into a running request's generator to stop it with a final event (finish_reason "stopped")."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    text: str  # text delta; "" while an incomplete character or a possible stop string is held back
    index: int  # 0 for the first generated token
    time_s: float  # the request's own busy time when this token was ready
    step_ms: float  # the forward pass + sampling that produced this token (0 for later tokens of a speculative step)
    # Speculative decoding: "accepted" (a draft the target agreed with), "replaced" (the target's token where it
    # rejected a draft), "bonus" (the target's token after a fully accepted draft), or None (a plain decode step).
    draft: str | None = None
    rejected_ids: tuple[int, ...] = ()  # on a "replaced" token: the drafts rejected from this position on
    # The first token's event only (None on later ones): prompt tokens whose KV came from the prefix cache.
    cached_prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationStats:
    kv_mode: str
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV came from the prefix cache
    generated_tokens: int
    finish_reason: str  # "eos" | "stop" | "length" | "stopped" (StopGeneration)
    ttft_ms: float  # tokenization + prefill + first sampling
    prefill_tokens_per_s: float  # computed (not cached) prompt tokens / the prefill step's time
    decode_tokens_per_s: float  # tokens after the first / busy time from the first token to the last
    total_ms: float
    kv_bytes_in_use: int  # KV of this request's tokens at its end
    kv_bytes_reserved: int  # KV memory set aside for this request (contiguous: its whole slot; paged: its blocks)
    spec: dict | None = None  # speculative decoding statistics (`SpecStats.as_dict`), None without speculation

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class FinishEvent:
    text: str
    token_ids: list[int]  # generated ids (an end-of-sequence token included)
    stats: GenerationStats


@dataclass(slots=True)
class LoadedModel:
    """Weights on a device plus the tokenizer: load once, share among engines."""

    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype

    @property
    def display_name(self) -> str:
        """The model as a person knows it: the bundled GGUF's own model name rather than 'bundled'."""
        if self.name != "bundled":
            return self.name
        from inference_core.bundled import BUNDLED_FILE

        model, quantization = BUNDLED_FILE.removesuffix(".gguf").rsplit(".", 1)
        return f"{model} (the bundled {quantization} GGUF)"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)


def load_model(model: str = "bundled", device: str | None = "auto", dtype: str = "float32",
               layout: str = "auto") -> LoadedModel:
    """Read a checkpoint onto `device` in `dtype`. `layout` picks how projection weights are stored (see
    `model.Linear`): 'auto' takes the measured-faster one for this device and dtype."""
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    if layout != "auto" and layout not in WEIGHT_LAYOUTS:
        raise ConfigError(f"unknown weight layout {layout!r}; use auto, out_in or in_out.")
    model_dir = resolve_model_dir(model)
    config = read_config(model_dir)
    tokenizer = Tokenizer(model_dir)
    weights = read_weights(model_dir, config)
    with torch.device("meta"):  # no random init: every parameter is assigned from the checkpoint below
        network = CausalLM(config)
    tensors = {name: w.to(device=torch_device, dtype=torch_dtype) for name, w in weights.items()}
    missing, unexpected = network.load_state_dict(tensors, strict=False, assign=True)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}.")
    if config.tie_word_embeddings:  # the LM head reads the embedding matrix (a copy only if it gets transposed)
        network.lm_head.weight = network.embed_tokens.weight
    network.configure_kernels(torch_device, torch_dtype, layout)
    network.rope_inv_freq = network.rope_inv_freq.to(torch_device)
    return LoadedModel(model, config, network.eval(), tokenizer, torch_device, torch_dtype)


@torch.inference_mode()
def wake_device(loaded: LoadedModel) -> None:
    """One untimed single-token forward, to run just before timed work. After the device has sat idle for a second
    or more, its first forward runs slower: on a 2-core CPU, after 1.5 s idle a race's lanes reached their first
    token 25-70 ms later (TTFTs of 100-250 ms) than with one forward run just before."""
    ModelRunner(loaded.model, None, loaded.device).run([Sequence([0])])
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model that cannot draft for `target`: its token ids must mean the same text (the same
    tokenizer vocabulary), and it must live on the same device."""
    if draft.device != target.device:
        raise ConfigError(f"the draft model is on {draft.device} but the target is on {target.device}; load both on "
                          "one device.")
    if draft.tokenizer.vocabulary() != target.tokenizer.vocabulary():
        raise ConfigError(f"the draft model {draft.name!r} has a different tokenizer from {target.name!r} "
                          f"({draft.tokenizer.vocab_size} vs {target.tokenizer.vocab_size} tokens, or the same ids "
                          "for different text); a draft model must share the target's tokenizer.")


def _make_kv_cache(loaded: LoadedModel, config: EngineConfig, max_seq_len: int):
    if config.kv_mode == "contiguous":
        return ContiguousKVCache(loaded.config, max_seq_len, 1, loaded.dtype, loaded.device)
    if config.kv_mode == "paged":
        return PagedKVCache(loaded.config, config.num_kv_blocks(loaded.config), config.block_size,
                            config.prefix_cache, loaded.dtype, loaded.device)
    return None


class Engine:
    """One configuration over a loaded model: owns its KV cache (one contiguous slot, or a paged block pool) and its
    runner, and, with a `draft_model` for speculative decoding, the draft's own cache of the same kind. Not
    thread-safe: drive one engine from one thread; interleave requests by alternating `next()` calls."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft_model: LoadedModel | None = None):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.max_seq_len = self.config.context_length(loaded.config)
        self.kv_cache = _make_kv_cache(loaded, self.config, self.max_seq_len)
        self.runner = ModelRunner(loaded.model, self.kv_cache, loaded.device)
        self.active: dict[int, Sequence] = {}
        self.draft_model = draft_model
        self.draft_runner: ModelRunner | None = None  # the draft model's, built by its first request
        if draft_model is not None:
            check_draft_model(loaded, draft_model)
            if draft_model.config.max_position_embeddings < self.max_seq_len:
                raise ConfigError(f"the draft model's context ({draft_model.config.max_position_embeddings} tokens) "
                                  f"is shorter than this engine's ({self.max_seq_len}); lower --max-seq-len.")

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    def prompt_ids(self, prompt: str | list[dict], system: str | None = None, chat: bool = True) -> list[int]:
        """Text (or chat messages) -> prompt token ids, through the chat template unless chat=False."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty; type some text.")
            if not chat:
                return self.tokenizer.encode(prompt)
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
        else:
            messages = prompt
            if not messages or not any(str(m.get("content", "")).strip() for m in messages):
                raise ConfigError("the conversation is empty; type a message.")
        return self.tokenizer.encode_chat(messages)

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
                 system: str | None = None, chat: bool = True,
                 spec: SpecConfig | None = None) -> Iterator[TokenEvent | FinishEvent]:
        """Validate now; return a generator of events that runs one model step per next() (a speculative step
        yields its tokens one per next() after the one forward that verified them)."""
        params = params or SamplingParams()
        spec = self.resolve_spec(spec or SpecConfig())
        started = time.perf_counter()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.prompt_ids(prompt, system, chat)
        if not prompt_ids:
            raise ConfigError("the prompt encodes to no tokens; type some text.")
        vocab_size = self.loaded.config.vocab_size
        outside = [token for token in prompt_ids if not 0 <= token < vocab_size]
        if outside:
            raise ConfigError(f"prompt token id {outside[0]} is outside the model's vocabulary (0..{vocab_size - 1}).")
        if len(prompt_ids) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len}; "
                              f"shorten the prompt by at least {len(prompt_ids) - self.max_seq_len + 1} tokens"
                              "{longer_context}.")
        room = self.max_seq_len - len(prompt_ids)
        if params.max_new_tokens > room:
            raise ConfigError(f"{params.max_new_tokens} new tokens do not fit: the prompt has {len(prompt_ids)} tokens "
                              f"and the context holds {self.max_seq_len}; set {{max_new_tokens}} to {room} or less.")
        if isinstance(self.kv_cache, PagedKVCache):
            # KV is written for every token but the last generated one: prompt + max_new_tokens - 1 slots.
            pool_tokens = self.kv_cache.manager.num_blocks * self.config.block_size
            if len(prompt_ids) + params.max_new_tokens - 1 > pool_tokens:
                raise ConfigError(f"the KV pool holds {pool_tokens} tokens but this request needs up to "
                                  f"{len(prompt_ids) + params.max_new_tokens - 1} ({len(prompt_ids)} prompt + "
                                  f"{params.max_new_tokens} new - 1); raise kv_cache_tokens or lower max_new_tokens.")
        return self._run(prompt_ids, params, spec, time.perf_counter() - started)

    def resolve_spec(self, spec: SpecConfig) -> SpecConfig:
        """Settle what the speculative settings leave to the model (early exit's default depth), or refuse them."""
        num_layers = self.loaded.config.num_layers
        if spec.method == "draft" and self.draft_model is None:
            raise ConfigError("speculative method 'draft' needs a draft model: {draft_model} (the engine's "
                              "draft_model).")
        if spec.method == "early-exit":
            if num_layers < 2:
                raise ConfigError("early-exit drafting needs a model of at least 2 layers.")
            if spec.draft_layers is None:
                return replace(spec, draft_layers=num_layers // 2)
            if spec.draft_layers >= num_layers:
                raise ConfigError(f"{{draft_layers}} must be below the model's {num_layers} layers (1 to "
                                  f"{num_layers - 1}), got {spec.draft_layers}.")
        return spec

    def _drafter(self, spec: SpecConfig):
        if spec.method == "ngram":
            return NgramDrafter(spec)
        if spec.method == "early-exit":
            return EarlyExitDrafter(self.runner, spec.draft_layers)
        if self.draft_runner is None:
            draft_config = replace(self.config, max_seq_len=self.max_seq_len)
            self.draft_runner = ModelRunner(self.draft_model.model,
                                             _make_kv_cache(self.draft_model, draft_config, self.max_seq_len),
                                             self.draft_model.device)
        return DraftModelDrafter(self.draft_runner, self.loaded.config.vocab_size)

    def _run(self, prompt_ids: list[int], params: SamplingParams, spec: SpecConfig, busy: float):
        seq = Sequence(list(prompt_ids))
        eos_ids = () if params.ignore_eos else self.loaded.eos_token_ids
        generator = make_generator(params, self.loaded.device)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        longest_stop = max((len(s) for s in params.stop), default=0)
        text, emitted, finish_reason, stopping = "", 0, None, False
        drafter = self._drafter(spec) if spec.enabled else None
        resumed = time.perf_counter()
        try:
            # 1. Place the prompt's KV (paged: reuse cached prefix blocks), then prefill and sample the first token.
            if self.kv_cache is not None:
                self.kv_cache.allocate(seq)
            self.active[seq.seq_id] = seq
            cached_tokens = seq.num_cached_tokens
            step_start = time.perf_counter()
            token = sample(self.runner.run([seq])[0], params, generator)
            prefill_s = time.perf_counter() - step_start
            step_s = prefill_s
            first_token_busy = None
            spec_stats = SpecStats(spec.max_k) if spec.enabled else None
            k = spec.k  # the current draft length (changes step to step when adaptive)
            # Tokens a step produced and not yet recorded: (token, draft kind, rejected drafts).
            pending: deque[tuple[int, str | None, tuple[int, ...]]] = deque([(token, None, ())])
            while True:
                # 2. Record the token, extend the text, check the stop conditions.
                token, draft_kind, rejected_ids = pending.popleft()
                seq.append(token)
                delta = "" if token in eos_ids else detokenizer.add(token)
                text += delta
                if token in eos_ids:
                    finish_reason = "eos"
                elif params.stop and (hit := _find_stop(text, params.stop, max(0, emitted - longest_stop))) >= 0:
                    text, finish_reason = text[:hit], "stop"
                elif seq.num_generated_tokens >= params.max_new_tokens:
                    finish_reason = "length"
                # Hold back a tail that could still become a stop string.
                safe = len(text) if finish_reason else len(text) - _stop_prefix_len(text, params.stop)
                delta, emitted = text[emitted:safe], max(emitted, safe)
                busy += time.perf_counter() - resumed
                first_token_busy = busy if first_token_busy is None else first_token_busy
                first = seq.num_generated_tokens == 1
                try:
                    yield TokenEvent(token, delta, seq.num_generated_tokens - 1, busy, step_s * 1e3, draft_kind,
                                     rejected_ids, cached_tokens if first else None)
                except StopGeneration:
                    stopping = True
                resumed = time.perf_counter()
                step_s = 0.0
                if finish_reason:
                    break
                if pending:  # more tokens of the same speculative step: no forward needed
                    continue
                if stopping:  # asked to stop: the step in flight has delivered all its tokens
                    finish_reason = "stopped"
                    break
                # 3. One step: speculative (draft, verify, roll back) or plain (forward one token, sample).
                step_start = time.perf_counter()
                room = params.max_new_tokens - seq.num_generated_tokens - 1
                tokens = []
                if drafter is not None and room > 0:
                    tokens = speculative_step(self.runner, seq, drafter, min(k, room), spec_stats, params, generator,
                                              eos_ids)
                if tokens:
                    pending.extend(tokens)
                    if spec.adaptive:
                        accepted = len(tokens) - 1
                        k = next_k(k, accepted + len(tokens[-1][2]), accepted, spec.max_k)
                else:  # a plain step: no speculation, no room for a draft, or nothing drafted
                    pending.append((sample(self.runner.run([seq])[0], params, generator), None, ()))
                step_s = time.perf_counter() - step_start
            in_use, reserved = self.kv_cache.usage(seq) if self.kv_cache is not None else (0, 0)
            busy += time.perf_counter() - resumed
            decode_tokens = seq.num_generated_tokens - 1
            decode_s = busy - first_token_busy
            computed_prompt = len(prompt_ids) - cached_tokens
            stats = GenerationStats(
                kv_mode=self.config.kv_mode, prompt_tokens=len(prompt_ids), cached_prompt_tokens=cached_tokens,
                generated_tokens=seq.num_generated_tokens, finish_reason=finish_reason,
                ttft_ms=first_token_busy * 1e3, prefill_tokens_per_s=computed_prompt / prefill_s,
                decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
                total_ms=busy * 1e3, kv_bytes_in_use=in_use, kv_bytes_reserved=reserved,
                spec=spec_stats.as_dict() if spec_stats is not None else None)
            yield FinishEvent(text, seq.generated_token_ids, stats)
        finally:
            # Finished, failed or closed by the caller: the request's KV memory goes back either way.
            self.active.pop(seq.seq_id, None)
            if self.kv_cache is not None:
                self.kv_cache.free(seq)
            if drafter is not None:
                drafter.close()

    def complete(self, prompt, params: SamplingParams | None = None, **kwargs) -> FinishEvent:
        """Run a request to the end and return its final event."""
        for event in self.generate(prompt, params, **kwargs):
            pass
        return event

    def kv_snapshot(self) -> dict | None:
        """The paged pool as plain values for drawing (None for the other KV modes): the block manager's snapshot
        (each block's state, owners, reference count and fill; each sequence's block table; free list and eviction
        order), each block's `token_ids` (what its filled slots hold, also for cached blocks no request owns), and
        `requests`: per active request its prompt length, tokens whose KV is stored and prompt tokens from the cache.
        `bytes_per_token` and `context_length` let a caller compare with what a contiguous cache would reserve."""
        if not isinstance(self.kv_cache, PagedKVCache):
            return None
        manager, block_size = self.kv_cache.manager, self.config.block_size
        seqs = list(self.active.values())
        snapshot = manager.snapshot(seqs)
        held = {}  # block id -> tokens of its owning request (a shared block holds the same tokens for every owner)
        for seq in seqs:
            for index, block_id in enumerate(seq.block_table):
                held[block_id] = seq.token_ids[index * block_size:(index + 1) * block_size]
        for block, info in zip(manager.blocks, snapshot["blocks"]):
            tokens = held.get(block.block_id, block.token_ids or ())
            info["token_ids"] = list(tokens[:block.num_filled])
        snapshot["requests"] = [
            {"seq_id": seq.seq_id, "prompt_tokens": seq.num_prompt_tokens, "stored_tokens": seq.num_computed_tokens,
             "cached_prompt_tokens": seq.num_cached_tokens, "block_table": list(seq.block_table)}
            for seq in seqs]
        snapshot["bytes_per_token"] = self.kv_cache.bytes_per_token
        snapshot["context_length"] = self.max_seq_len
        return snapshot


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int:
    hits = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    return min(hits) if hits else -1


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best
