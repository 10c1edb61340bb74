"""The engine: one configuration over a loaded model, serving any number of requests through one scheduler.

An `Engine` pairs a `LoadedModel` with one `EngineConfig` (KV mode, block size, prefix cache, batching mode and its
limits) and owns that configuration's KV cache, runner and scheduler, so two engines can race on one set of weights.

- `submit(prompt, params, ...)` validates a request (a clear `ConfigError` for one that can never run) and queues
  it; the returned `Request` collects its events (`Request.events`, or a `listener` callback).
- `step()` advances every running request by one scheduler step and reads like nano-vllm's: schedule, run,
  post-process, collect finished. It returns a `StepReport` of what ran, for timelines and benchmarks.
- `generate(prompt, ...)` is the single-request generator on top: it queues its request on the first `next()` and
  steps the engine until that request has an event to yield, so several generators over one engine (or the engine
  loop's callers, `inference_core.engine.loop`) are batched together.

Ending a request early: `cancel()` (or closing its generator) frees it at once with no final event;
`stop()` (or `throw(StopGeneration)` into its generator) ends it after the step in flight: the tokens that step
produced still arrive, then a FinishEvent with finish_reason "stopped". A finished request's KV is released in the
step that finishes it. A forward that fails fails the requests of that step (their generators re-raise the error)
and releases their KV; the engine stays usable. Not thread-safe: one thread drives an engine (see `engine_loop`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from inference_core.config import ConfigError, EngineConfig
from inference_core.engine.compiled import CompiledDecoder, compile_unavailable, default_options
from inference_core.engine.lens import prompt_logprobs
from inference_core.engine.request import FinishEvent, GenerationStats, Request, StopGeneration, TokenEvent
from inference_core.engine.runner import ModelRunner
from inference_core.engine.scheduler import ScheduledWork, Scheduler
from inference_core.kv.block_manager import FREED
from inference_core.kv.cache import ContiguousKVCache, PagedKVCache, RecomputeKVCache
from inference_core.logits import shape_logits, token_logprobs
from inference_core.model import kv_kernel, row_kernel
from inference_core.model.llama import profile_range
from inference_core.model.loader import LoadedModel, check_draft_model
from inference_core.model.tokenizer import IncrementalDetokenizer, Tokenizer
from inference_core.roofline import run_points, weights_read_per_step
from inference_core.sampling import SamplingParams, sample_batch
from inference_core.sequence import Sequence
from inference_core.spec.decoding import (HIDDEN_READERS, MAX_K, ChainDraft, DraftModelDrafter, EarlyExitDrafter,
                                          NgramDrafter, SpecConfig, TreeDraft, draft_chain, draft_tree, finish_chain,
                                          finish_tree, next_k)
from inference_core.spec import defaults as spec_defaults
from inference_core.spec.draft_heads import (DraftHeads, EagleDrafter, EagleDraftPool, MedusaDrafter, draft_together,
                                             find_heads, load_heads, medusa_together)
from inference_core.spec.pays import SpeculationPolicy
from inference_core.structured import Grammars


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one `Engine.step()` did, as plain values."""

    index: int
    started_at: float  # time.perf_counter() when the step began
    duration_ms: float
    # (request id, "prefill" | "decode" | "speculative", tokens forwarded: a decode's steps run back to back, where
    # the engine ran several, `EngineConfig.decode_steps`)
    work: tuple[tuple[int, str, int], ...]
    preempted: tuple[int, ...]  # request ids sent back to the queue to free KV blocks
    finished: tuple[int, ...]  # request ids that ended in this step
    num_waiting: int
    num_running: int
    blocks_in_use: int  # paged: blocks; contiguous: slots; none: 0
    padding_rows: int = 0  # static batching: finished members' rows this step computed and threw away
    prompt_padding_tokens: int = 0  # static batching: padding tokens computed after prompts (padded to the longest)
    compile_ms: float = 0.0  # compiled decode: time this step spent compiling a graph (a batch size's first use)

    @property
    def batch_size(self) -> int:
        return len(self.work)

    @property
    def num_tokens(self) -> int:
        return sum(tokens for _, _, tokens in self.work)


def make_kv_cache(loaded: LoadedModel, config: EngineConfig, max_seq_len: int):
    window, sinks = config.attention_window(loaded.config), config.sink_tokens(loaded.config)
    if config.kv_mode == "contiguous":
        cache = ContiguousKVCache(loaded.config, max_seq_len, config.max_num_seqs, loaded.dtype, loaded.device,
                                  config.kv_dtype, window, sinks)
    elif config.kv_mode == "paged":
        cache = PagedKVCache(loaded.config, config.num_kv_blocks(loaded.config), config.block_size,
                             config.prefix_cache, loaded.dtype, loaded.device, config.kv_dtype, window,
                             config.attention, sinks)
    else:
        return RecomputeKVCache(window, sinks)
    if cache.int4 is not None and loaded.device.type == "cpu" and loaded.dtype in (torch.float32, torch.bfloat16) \
            and row_kernel.unavailable() is None:
        cache.int4.fused = kv_kernel.read  # the int4 read in one op of ours (docs/benchmarks.md)
    return cache


class Engine:
    """One configuration over a loaded model: owns its KV cache, runner and scheduler and, with a `draft_model` for
    speculative decoding, the draft's own cache of the same kind."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 draft_model: LoadedModel | None = None):
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.max_seq_len = config.context_length(loaded.config)
        self.kv_cache = make_kv_cache(loaded, config, self.max_seq_len)
        self.decoder: CompiledDecoder | None = None
        if config.compile:
            if (reason := compile_unavailable(loaded.device)) is not None:
                raise ConfigError(f"compiled decode is not available here: {reason}; run without compile.")
            options = default_options(loaded.device, loaded.model)
            if not config.row_kernel:
                options.pop("row_kernel", None)
            if not config.attention_kernel:
                options.pop("attention_kernel", None)
            self.decoder = CompiledDecoder(loaded.model, self.kv_cache, loaded.device, config.max_num_seqs,
                                           self.max_seq_len, options)
        self.runner = ModelRunner(loaded.model, self.kv_cache, loaded.device, self.decoder)
        # The rows a compiled verification's projections take at about one decode row's cost (bf16 weights through
        # our op's wide pass; None: not measured here): several speculating requests draft at most what fits them.
        # 16 grounded requests with prompt lookup, 4 a step (docs/benchmarks.md): k=1 (8 rows) 1.33x plain, k=2 (12)
        # 1.12x, k=3 (16) 1.06x.
        self.verify_rows = (row_kernel.rows_at_one_row_cost() if self.decoder is not None and loaded.quant is None
                            and "row_kernel" in self.decoder.options and loaded.dtype == torch.bfloat16 else None)
        self.scheduler = Scheduler(self.kv_cache, config.batching, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.chunked_prefill, config.batch_window_ms, config.join_every)
        self.steps_taken = 0
        self.speculation = SpeculationPolicy()  # whether a step's greedy speculating requests draft (`spec.pays`)
        self._grammars = None
        self.draft_model = draft_model
        self.draft_runner: ModelRunner | None = None  # the draft model's, built by its first request
        self.draft_heads: dict[str, DraftHeads] = {}  # trained heads by kind ("medusa", "eagle"), loaded when asked
        self._draft_pool: EagleDraftPool | None = None  # a compiled engine's EAGLE drafting (`_eagle_pool`)
        if draft_model is not None:
            check_draft_model(loaded, draft_model)
            if draft_model.config.max_position_embeddings < self.max_seq_len:
                raise ConfigError(f"the draft model's context ({draft_model.config.max_position_embeddings} tokens) "
                                  f"is shorter than this engine's ({self.max_seq_len}); lower --max-seq-len.")

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    # --- requests -------------------------------------------------------------------------------------------------

    def prompt_ids(self, prompt: str | list[dict], system: str | None = None, chat: bool = True) -> list[int]:
        """Text (or chat messages) -> prompt token ids, through the chat template unless chat=False."""
        return self.tokenizer.prompt_ids(prompt, system, chat)

    def make_request(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
                     system: str | None = None, chat: bool = True, spec: SpecConfig | None = None,
                     priority: int = 0, cache_salt: str | None = None) -> Request:
        """Validate and tokenize a request without queueing it (`submit` queues it). Raises ConfigError, saying what
        to change, for a request that could never run on this engine."""
        params, spec = params or SamplingParams(), spec or SpecConfig()
        spec = self.resolve_spec(spec, greedy=params.greedy)
        if spec.tree_width > 1 and not params.greedy:
            raise ConfigError("tree verification ({spec_tree_width} > 1) keeps greedy decoding's tokens only; set the "
                              "temperature to 0 or the tree width to 1 (a chain, which keeps the sampled "
                              "distribution).")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigError(f"priority must be an integer (lower runs first), got {priority!r}.")
        started = time.perf_counter()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.prompt_ids(prompt, system, chat)
        self._check_fits(prompt_ids, params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        request = Request(prompt_ids, params, spec, detokenizer=detokenizer,
                          eos_ids=self.loaded.eos_token_ids, device=self.loaded.device, priority=priority,
                          cache_salt=cache_salt, tokenize_s=time.perf_counter() - started)
        if params.constraint is not None:
            request.grammar = self.grammars().matcher(params.constraint)
        return request

    def grammars(self):
        """The compiled grammars for this model's tokenizer (`structured.Grammars`), built on first use (the grammar
        library loads only when a request asks for a constraint)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.loaded.config.vocab_size, self.loaded.eos_token_ids)
        return self._grammars

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ConfigError("the prompt encodes to no tokens; type some text.")
        vocab_size = self.loaded.config.vocab_size
        for what, ids in (("prompt token id", prompt_ids),
                          ("logit_bias: token id", [token for token, _ in params.logit_bias]),
                          ("stop_token_ids: token id", params.stop_token_ids)):
            outside = [token for token in ids if not 0 <= token < vocab_size]
            if outside:
                raise ConfigError(f"{what} {outside[0]} is outside the model's vocabulary (0..{vocab_size - 1}).")
        if len(prompt_ids) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len}; "
                              f"shorten the prompt by at least {len(prompt_ids) - self.max_seq_len + 1} tokens"
                              "{longer_context}.")
        room = self.max_seq_len - len(prompt_ids)
        if params.max_new_tokens > room:
            raise ConfigError(f"{params.max_new_tokens} new tokens do not fit: the prompt has {len(prompt_ids)} tokens "
                              f"and the context holds {self.max_seq_len}; set {{max_new_tokens}} to {room} or less.")
        if isinstance(self.kv_cache, PagedKVCache):
            # KV is written for every token but the last generated one: prompt + max_new_tokens - 1 slots. A request
            # that fits the pool alone always finishes: the scheduler preempts others to make room for it.
            pool_tokens = self.kv_cache.num_tokens
            if len(prompt_ids) + params.max_new_tokens - 1 > pool_tokens:
                raise ConfigError(f"the KV pool holds {pool_tokens} tokens but this request needs up to "
                                  f"{len(prompt_ids) + params.max_new_tokens - 1} ({len(prompt_ids)} prompt + "
                                  f"{params.max_new_tokens} new - 1); raise {{kv_cache_tokens}} or lower "
                                  "{max_new_tokens}.")

    @property
    def shares_prompts(self) -> bool:
        """Whether copies of one prompt (n > 1) can share its KV blocks: the paged cache with its prefix cache, and a
        batching mode that admits a copy as soon as the first one's prompt is computed."""
        config = self.config
        return config.kv_mode == "paged" and config.prefix_cache and config.batching == "continuous"

    def make_copies(self, prompt, params: list[SamplingParams], **kwargs) -> list[Request]:
        """One request per `params` on the same prompt (the API's `n`); where the engine `shares_prompts`, every copy
        after the first waits for the first one's prompt and then takes its full blocks from the prefix cache."""
        requests = [self.make_request(prompt, one, **kwargs) for one in params]
        if self.shares_prompts:
            for copy in requests[1:]:
                copy.prompt_source = requests[0]
        return requests

    def submit(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None,
               **kwargs) -> Request:
        """Validate and queue a request (keywords as `make_request`); its events arrive as the engine steps."""
        return self.enqueue(self.make_request(prompt, params, **kwargs))

    def enqueue(self, request: Request) -> Request:
        request.submitted_at = time.perf_counter()
        self.scheduler.add(request)
        return request

    def cancel(self, request: Request) -> None:
        """End a request now, wherever it is, with no final event; its KV goes back to the pool."""
        if not request.finished:
            self._release(request)

    def stop(self, request: Request) -> None:
        """End a request after the step in flight, with a final event (finish_reason "stopped")."""
        request.stop_requested = True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def seconds_until_ready(self) -> float:
        """0 when a step would make progress now; else how long until it would (dynamic batching's window), or inf
        when only another request or `drain()` can start it (a static batch that is not full)."""
        if self.scheduler.running or any(r.stop_requested for r in self.scheduler.waiting):
            return 0.0  # a step runs, or ends the requests asked to stop
        return self.scheduler.seconds_until_admission()

    def drain(self) -> None:
        """No more requests are coming (static batching may start a partial batch)."""
        self.scheduler.drain()

    def load_draft_heads(self, kind: str, path=None) -> DraftHeads:
        """The engine's trained `kind` heads: from `path`, else (once) from where `train-draft` writes or the shipped
        ones for the bundled model; quantized as the target's weights are (`DraftHeads.quantize`). A ConfigError says
        how to train them where there are none."""
        if path is None and kind in self.draft_heads:
            return self.draft_heads[kind]
        if path is None:
            path = find_heads(self.loaded.name, self.loaded.config, kind)
        if path is None:
            raise ConfigError(f"no trained {kind} heads for {self.loaded.name}; train them with `python -m "
                              f"inference_core train-draft --kind {kind} --model {self.loaded.name}`.")
        heads = load_heads(path, self.loaded.config, self.loaded.device, self.loaded.dtype)
        if self.decoder is not None and "row_kernel" in self.decoder.options:
            heads.use_row_kernel()  # our projection op is built and runs here: bf16 drafts take it too
        if self.loaded.quant is not None:
            heads.quantize(self.loaded.quant)  # the target's weights quantized: the heads' projections alike
        self.draft_heads[kind] = heads
        return heads

    def resolve_spec(self, spec: SpecConfig, greedy: bool = True) -> SpecConfig:
        """Settle what the speculative settings leave to the engine (early exit's default depth, a tree width and a
        draft length measured for this setup: `spec.defaults`), or refuse them. `greedy`: the request's sampling
        (a sampled one verifies a chain)."""
        num_layers = self.loaded.config.num_layers
        if spec.enabled and spec.method == "early-exit" and spec.draft_layers is None and num_layers >= 2:
            spec = replace(spec, draft_layers=num_layers // 2)
        if spec.tree_width is None:
            spec = replace(spec, tree_width=self.default_tree_width(spec, greedy)[0])
        if spec.enabled and spec.k is None:
            spec = replace(spec, k=self.default_k(spec)[0])
        if spec.method in ("medusa", "eagle"):
            heads = self.load_draft_heads(spec.method)
            if heads.num_heads and spec.k > heads.num_heads:
                raise ConfigError(f"these Medusa heads draft at most {heads.num_heads} tokens ahead: draft length k "
                                  f"({{spec_k}}) must be 1 to {heads.num_heads}, got {spec.k}.")
        if spec.method == "draft" and self.draft_model is None:
            raise ConfigError("speculative method 'draft' needs a draft model: {draft_model} (the engine's "
                              "draft_model).")
        if spec.method == "early-exit":
            if num_layers < 2:
                raise ConfigError("early-exit drafting needs a model of at least 2 layers.")
            if spec.draft_layers >= num_layers:
                raise ConfigError(f"{{draft_layers}} must be below the model's {num_layers} layers (1 to "
                                  f"{num_layers - 1}), got {spec.draft_layers}.")
        return spec

    def default_tree_width(self, spec: SpecConfig, greedy: bool = True) -> tuple[int, str]:
        """The tree width `spec` gets on this engine when the request leaves it open, and why: a chain for a source
        that does not rank its candidates, a sampled request or an adaptive k; for a greedy request of Medusa or
        EAGLE the width measured fastest for the setup (at `spec.k` where the request names it)."""
        if spec.method not in HIDDEN_READERS:
            return 1, "a chain: this draft source does not rank its candidates"
        if not greedy or spec.adaptive:
            return 1, "a chain: " + ("a sampled request keeps its distribution through one draft a position"
                                     if not greedy else "an adaptive k drafts a chain")
        setup = spec_defaults.setup_key(self.loaded, self.config.kv_mode, self.decoder is not None)
        return spec_defaults.default_tree_width(setup, spec.method, spec.k, self.decoder is not None)

    def default_k(self, spec: SpecConfig) -> tuple[int, str]:
        """The draft length `spec`'s source gets on this engine when the request leaves it open, and where it came
        from (this host's measurement of the setup, kept by `spec-bench --keep`, or the project's)."""
        setup = spec_defaults.setup_key(self.loaded, self.config.kv_mode, self.decoder is not None)
        k, where = spec_defaults.default_k(setup, spec.method, spec.tree_width or 1, spec.draft_layers)
        if spec.method in ("medusa", "eagle") and (heads := self.load_draft_heads(spec.method)).num_heads:
            k = min(k, heads.num_heads)
        return k, where

    # --- the step -------------------------------------------------------------------------------------------------

    def step(self) -> StepReport:
        """Schedule, run, post-process, collect finished. Returns what ran; the tokens go to each request's events."""
        started = time.perf_counter()
        finished: list[Request] = []
        # 1. Requests asked to stop end before anything else runs (after the step that was in flight for them).
        for request in [r for r in self.scheduler.running + self.scheduler.waiting if r.stop_requested]:
            self._finish(request, finished)
        # 2. Schedule. Dynamic batching may have to wait for its window: sleep until then, untimed by any request.
        if 0 < (wait_s := self.seconds_until_ready()) < math.inf:
            time.sleep(wait_s)
        output = self.scheduler.schedule()
        for request in output.preempted:
            self._close_drafter(request)
        plain = [w for w in output.work if w.kind != "speculative"]
        speculative = [w for w in output.work if w.kind == "speculative"]
        # 3. One forward for every plain sequence (prefill chunks and decodes), then one for the speculative
        # requests (each drafts, all verify together, each rolls back).
        padding_rows = len(self.scheduler.padding) if plain else 0
        compiled_before = self._compile_seconds()
        prompt_padding, burst = 0, 1
        if plain and (burst := self._burst_steps(plain)) > 1:
            self._run_burst(plain, burst, len(output.work), finished)
        elif plain:
            prompt_padding = self._run_plain(plain, len(output.work), finished)
        if speculative:
            self._run_speculative(speculative, len(output.work), finished)
        if not self.scheduler.running:
            self.scheduler.free_padding()  # a static batch has ended: its padding rows' KV goes back
        self.steps_taken += 1
        return StepReport(self.steps_taken, started, (time.perf_counter() - started) * 1e3,
                          tuple((w.request.request_id, w.kind, w.num_tokens * (burst if w.kind == "decode" else 1))
                                for w in output.work),
                          tuple(r.request_id for r in output.preempted), tuple(r.request_id for r in finished),
                          len(self.scheduler.waiting), len(self.scheduler.running), self.kv_cache.blocks_in_use(),
                          padding_rows, prompt_padding,
                          (self._compile_seconds() - compiled_before) * 1e3)

    def _run_plain(self, work: list[ScheduledWork], batch_size: int, finished: list[Request]) -> int:
        """One forward for the step's prefill chunks and decodes (and a static batch's padding); returns the prompt
        padding tokens it computed."""
        requests = [w.request for w in work]
        for request in requests:
            self._mark_scheduled(request)
        step_start = time.perf_counter()
        padding = self.scheduler.pad_rows()  # static batching: finished members' rows, computed and thrown away
        prompt_padding = [self._reserve_prompt_padding(w) for w in work]
        compiled_before = self._compile_seconds()
        # Trained draft heads read the target's hidden states: they see every position it computes for them.
        readers = [i for i, request in enumerate(requests) if request.spec.reads_hidden]
        firsts = [request.seq.num_computed_tokens for request in requests]
        try:
            logits = self.runner.run([r.seq for r in requests] + padding,
                                     [w.num_tokens for w in work] + [len(s) - s.num_computed_tokens for s in padding],
                                     num_padding=prompt_padding + [0] * len(padding), return_hidden=bool(readers))
            if readers:
                logits, hidden = logits
                for i in readers:
                    if requests[i].drafter is None:
                        requests[i].drafter = self._drafter(requests[i].spec)
                    requests[i].drafter.observe(firsts[i], hidden[i])
            # Sequences whose whole text is now computed get a new token; a prefill chunk that is not the prompt's
            # last waits for the next step.
            done = [i for i, request in enumerate(requests) if self._completes(request)]
            if done:  # (every row of a decode step: the logits as they are, not a copy of them)
                rows = logits if len(done) == logits.shape[0] else logits[done]
                tokens, logprobs = self._choose(rows, [requests[i] for i in done])
            else:
                tokens, logprobs = [], []
        except BaseException as error:
            for request in requests:
                self._fail(request, error)
            raise
        step_s = time.perf_counter() - step_start
        compile_s = self._compile_seconds() - compiled_before
        sampled = dict(zip(done, zip(tokens, logprobs)))
        for index, (request, item) in enumerate(zip(requests, work)):
            prompt_tokens = item.num_tokens if request.seq.num_generated_tokens == 0 else 0
            request.account_step(step_s, batch_size, prompt_tokens, compile_s)
            if prompt_padding[index] or index in sampled:
                request.prompt_padding = 0  # computed (or, where the pool had no room for it, given up)
            if index in sampled:
                token, token_logprobs_ = sampled[index]
                self._emit_token(request, token, step_s, batch_size, finished, logprobs=token_logprobs_)
        return sum(prompt_padding)

    def _burst_steps(self, work: list[ScheduledWork]) -> int:
        """How many compiled decode steps this step's work runs back to back (`_run_burst`): up to
        `config.decode_steps` where every request is a greedy decode that reads nothing of its logits but the
        argmax, no request waits to be admitted (it would wait for the whole burst), no static batch pads its rows,
        and the KV pool has room for every request's tokens; fewer where a request has fewer tokens left. 1: a plain
        step."""
        steps = self.config.decode_steps
        if steps <= 1 or self.scheduler.waiting or self.scheduler.padding or self.scheduler.keeps_row():
            return 1
        requests = [w.request for w in work]
        if any(w.kind != "decode" or not w.request.params.greedy or w.request.reads_logits
               or w.request.stop_requested for w in work):
            return 1
        steps = min(steps, *(request.room() for request in requests))
        seqs = [request.seq for request in requests]
        if steps <= 1 or not self.decoder.fits(seqs, steps):
            return 1
        for seq in seqs:  # room for every request (blocks taken for the first ones stay theirs: they need them next)
            if not self.kv_cache.can_append(seq, seq.num_computed_tokens + steps):
                return 1
            self.kv_cache.ensure_capacity(seq, seq.num_computed_tokens + steps)
        return steps

    def _run_burst(self, work: list[ScheduledWork], steps: int, batch_size: int, finished: list[Request]) -> None:
        """`steps` greedy decode steps of the work's requests back to back (`CompiledDecoder.run_greedy`, in the KV
        room `_burst_steps` made), then each step's tokens in order, as `steps` plain steps would have given them: a
        request that ends at one of them (end of sequence, a stop string) drops the rest, whose KV goes back with its
        blocks. Each token is charged an equal share of the burst's time."""
        requests = [w.request for w in work]
        for request in requests:
            self._mark_scheduled(request)
        started = time.perf_counter()
        compiled_before = self._compile_seconds()
        try:
            tokens = self.decoder.run_greedy([request.seq for request in requests], steps)
        except BaseException as error:
            for request in requests:
                self._fail(request, error)
            raise
        step_s = (time.perf_counter() - started) / steps
        compile_s = (self._compile_seconds() - compiled_before) / steps
        for row in tokens:
            for request, token in zip(requests, row):
                if request.finished:
                    continue
                self.kv_cache.commit(request.seq, request.seq.num_computed_tokens + 1)  # the token it was fed
                request.account_step(step_s, batch_size, 0, compile_s)
                self._emit_token(request, token, step_s, batch_size, finished)

    def _choose(self, logits, requests: list[Request]) -> tuple[list[int], list]:
        """logits: [len(requests), vocab] fp32, a row per request. Shape the rows that ask, choose each token with its
        request's settings and generator, and compute the log-probabilities asked for."""
        with profile_range("ic::sampling"):
            rows = [request.row_contexts()[1][0] if request.reads_logits else None for request in requests]
            shaped = shape_logits(logits, rows)
            tokens = sample_batch(shaped, [r.params for r in requests], [r.generator for r in requests])
            return tokens, token_logprobs(logits, shaped, rows, tokens)

    def _reserve_prompt_padding(self, work: ScheduledWork) -> int:
        """Static batching: the padding (up to the batch's longest prompt) that rides with a prompt's last chunk, its
        KV room taken now; 0 for other work, or where the pool has no room for it (the padding is then skipped)."""
        seq, padding = work.request.seq, work.request.prompt_padding
        if not padding or seq.num_computed_tokens + work.num_tokens != len(seq) \
                or not self.kv_cache.can_append(seq, len(seq) + padding):
            return 0
        self.kv_cache.ensure_capacity(seq, len(seq) + padding)
        return padding

    def _completes(self, request: Request) -> bool:
        """After a forward: whether it reached the end of the request's text (so a new token is sampled). Mode none
        always forwards the whole text."""
        seq = request.seq
        return isinstance(self.kv_cache, RecomputeKVCache) or seq.num_computed_tokens == len(seq)

    def _run_speculative(self, work: list[ScheduledWork], batch_size: int, finished: list[Request]) -> None:
        """The step's speculating requests: each drafts (`draft_chain`, or `draft_tree`), then one forward verifies
        every chain and tree (`ModelRunner.verify`; where the compiled query step does not take the trees, each tree
        has a forward of its own), beside a plain token for each request that drafted nothing, and each request keeps
        what the target accepted and rolls the rest back (`finish_chain`, `finish_tree`). Where plain steps measured
        faster for a greedy group of this size (`spec.pays.SpeculationPolicy`), none drafts: one plain token each."""
        requests = [w.request for w in work if not w.request.finished]
        for request in requests:
            self._mark_scheduled(request)
        plain_reason = self.speculation.plain_reason(len(requests)) if (
            self.config.speculate_when_it_pays and requests and all(r.params.greedy for r in requests)) else None
        step_start = time.perf_counter()
        compiled_before = self._compile_seconds()  # a query step's first use compiles (or loads) its package
        drafts: list[ChainDraft | TreeDraft | None] = []  # each request's (None: a plain token)
        try:
            rooms, held = [], []  # each request's drafts (a tree's levels) and tree width (1: a chain); its blocks
            for request in requests:
                if request.drafter is None:
                    request.drafter = self._drafter(request.spec)
                rooms.append((0, 1) if plain_reason else self._draft_room(request, len(requests)))
                if plain_reason:
                    request.spec_stats.plain_steps += 1
                    request.spec_stats.plain_reason = plain_reason
                # Its drafts' room, taken before the next request asks for its own.
                held.append(len(getattr(request.seq, "block_table", ())))
                self.kv_cache.ensure_capacity(request.seq, len(request.seq) + rooms[-1][0] * rooms[-1][1])
            proposals, catch_up_s = self._draft_together(requests, rooms)
            for index, (request, (k, width)) in enumerate(zip(requests, rooms)):
                seq, shaping = request.seq, request if request.reads_logits else None
                if k <= 0:
                    drafts.append(None)
                elif width > 1:
                    drafts.append(draft_tree(seq, request.drafter, k, width, request.spec_stats, request.eos_ids,
                                             shaping, request.spec.tree_prune, proposals.get(index)))
                else:
                    drafts.append(draft_chain(seq, request.drafter, k, request.spec_stats, request.params,
                                              request.generator, request.eos_ids,
                                              request.row_contexts if shaping is not None else None,
                                              proposals.get(index)))
                self._give_back_room(seq, held[index])
            steps = dict(enumerate(self._verify_drafts(requests, drafts)))
        except BaseException as error:
            for request, draft in zip(requests, drafts):
                if draft is not None:
                    del request.seq.token_ids[draft.num_before:]
            for request in requests:
                self._fail(request, error)
            raise
        step_s = time.perf_counter() - step_start
        compile_s = self._compile_seconds() - compiled_before
        if not compile_s:  # a step that compiled or loaded a package measures that, not the step
            # (nor the drafters' catch-up on what plain steps computed: a group that always drafts has none)
            self.speculation.record(len(requests), plain_reason is None, sum(map(len, steps.values())),
                                    step_s - catch_up_s)
        for index, request in enumerate(requests):
            tokens = steps[index]
            if request.spec.adaptive and tokens[0][1] is not None:  # a verification: its acceptance moves k
                accepted = len(tokens) - 1
                request.draft_k = next_k(request.draft_k, accepted + len(tokens[-1][2]), accepted,
                                         request.spec.max_k)
            request.account_step(step_s, batch_size, 0, compile_s)
            for position, (token, kind, rejected, logprobs, rejected_logprobs) in enumerate(tokens):
                self._emit_token(request, token, step_s if position == 0 else 0.0, batch_size, finished, kind,
                                 rejected, logprobs, rejected_logprobs)
                if request.finished:
                    break

    def _draft_room(self, request: Request, group: int = 1) -> tuple[int, int]:
        """How many drafts `request` may propose this step, one of a `group` of speculating requests, and its tree's
        width (1: a chain): its draft length, shortened to the tokens it may still produce, to what the free KV
        blocks hold (a tree holds k * width drafts while it is verified) and, in a group of several, to a
        verification whose rows all cost about one row's (`drafts_that_fit`, which the request's stats count and
        explain)."""
        wanted = min(request.draft_k, request.room() - 1)
        k, width = self.drafts_that_fit(wanted, request.spec.tree_width, group)
        if k < wanted or width < request.spec.tree_width:
            request.spec_stats.fitted_steps += 1
            drafts = f"{k} draft{'s' if k > 1 else ''} each" + (" (a chain, not a tree)"
                                                                   if width < request.spec.tree_width else "")
            request.spec_stats.fitted_reason = (
                f"{group} speculating requests verified together, and {drafts} kept their verification within the "
                f"{self.verify_rows} rows that cost about one row's time here")
        while k > 0 and not self.kv_cache.can_append(request.seq, len(request.seq) + k * width):
            k -= 1
        return k, width

    def _give_back_room(self, seq: Sequence, held: int) -> None:
        """Paged: the blocks this step took for drafts that were not proposed go back to the pool (fresh ones at the
        end of `seq`'s table, past what it held before and what its tokens now need): a request holds the blocks its
        tokens need, and no more."""
        if isinstance(self.kv_cache, PagedKVCache):
            keep = max(held, self.kv_cache.manager.blocks_needed(len(seq)))
            if len(seq.block_table) > keep:
                self.kv_cache.rollback(seq, keep * self.kv_cache.block_size)

    def _verify_drafts(self, requests: list[Request],
                       drafts: list[ChainDraft | TreeDraft | None]) -> list[list[tuple]]:
        """One forward over `requests` (`ModelRunner.verify`): each one's last token and its drafts (`drafts[i]`, a
        chain or a tree), or one plain token where it drafted nothing. Returns each request's tokens."""
        readers = [request.spec.reads_hidden for request in requests]
        seqs = [request.seq for request in requests]
        firsts = [seq.num_computed_tokens for seq in seqs]
        needed = [1 if draft is None else draft.num_rows for draft in drafts]  # logits rows each reads
        trees = [(draft.tree.depths, draft.tree.mask()) if isinstance(draft, TreeDraft) else None
                 for draft in drafts]
        logits, hidden = self.runner.verify(seqs, needed, trees, return_hidden=any(readers))
        steps = []
        for index, (request, draft, rows) in enumerate(zip(requests, drafts, logits)):
            mine = hidden[index] if readers[index] else None
            if isinstance(draft, TreeDraft):
                steps.append(finish_tree(self.runner, request.seq, request.drafter, draft, rows, mine,
                                         request.spec_stats, request.params))
                continue
            if draft is not None:
                steps.append(finish_chain(self.runner, request.seq, request.drafter, draft, rows, mine,
                                          request.spec_stats, request.params, request.generator))
                continue
            if mine is not None:  # a plain step's hidden states, every position it computed
                request.drafter.observe(firsts[index], mine)
            chosen, logprobs = self._choose(rows, [request])
            steps.append([(chosen[0], None, (), logprobs[0], ())])
        return steps

    def _mark_scheduled(self, request: Request) -> None:
        if request.first_scheduled_at is None:
            request.first_scheduled_at = time.perf_counter()
        if request.cached_prompt_tokens is None:
            request.cached_prompt_tokens = request.seq.num_cached_tokens

    def _emit_token(self, request: Request, token: int, step_s: float, batch_size: int, finished: list[Request],
                    draft: str | None = None, rejected: tuple[int, ...] = (), logprobs=None,
                    rejected_logprobs: tuple[float, ...] = ()) -> None:
        if request.params.prompt_logprobs is not None and request.seq.num_generated_tokens == 0:
            # An extra forward over the prompt, once, for the requests that ask (the cache may hold its KV, and a
            # chunked prefill's rows are gone: recomputing is the simple exact way).
            request.prompt_logprobs = prompt_logprobs(self.runner, request.seq.token_ids,
                                                      request.params.prompt_logprobs)
        request.emit(request.record(token, step_s, batch_size, draft, rejected, logprobs, rejected_logprobs))
        if request.finish_reason is not None:
            self._finish(request, finished)

    def _finish(self, request: Request, finished: list[Request]) -> None:
        """The request's final event (with its KV usage at the end), then its KV goes back."""
        if request.keep_final_kv_snapshot:
            request.final_kv_snapshot = self.kv_snapshot()
        request.emit(request.finish_event(self.config.kv_mode, self.kv_cache.usage(request.seq),
                                          self.compile_stats()))
        self._release(request)
        finished.append(request)

    def _fail(self, request: Request, error: BaseException) -> None:
        request.error = error
        if request.listener is not None:  # the engine loop's caller re-raises it from the request's events
            request.listener(request, error)
        self._release(request)

    def _release(self, request: Request) -> None:
        if request.finish_reason is not None and request.error is None and self.scheduler.keeps_row() \
                and request in self.scheduler.running:
            self.scheduler.retire_to_padding(request)  # a padded static batch keeps computing the row
        else:
            self.scheduler.remove(request)
        self._close_drafter(request)
        request.state = "finished"

    def _close_drafter(self, request: Request) -> None:
        if request.drafter is not None:
            request.drafter.close()
            request.drafter = None

    def _drafter(self, spec: SpecConfig):
        if spec.method == "ngram":
            return NgramDrafter(spec)
        if spec.method == "early-exit":
            return EarlyExitDrafter(self.runner, spec.draft_layers)
        if spec.method == "medusa":
            return MedusaDrafter(self.load_draft_heads("medusa"), self.loaded.model)
        if spec.method == "eagle":
            heads = self.load_draft_heads("eagle")
            return EagleDrafter(heads, self.loaded.model, self.max_seq_len + 2 * MAX_K, self._eagle_pool(heads))
        if self.draft_runner is None:
            draft_config = replace(self.config, max_seq_len=self.max_seq_len)
            self.draft_runner = ModelRunner(self.draft_model.model,
                                             make_kv_cache(self.draft_model, draft_config, self.max_seq_len),
                                             self.draft_model.device)
        return DraftModelDrafter(self.draft_runner, self.loaded.config.vocab_size)

    def _eagle_pool(self, heads: DraftHeads) -> EagleDraftPool | None:
        """A compiled engine's EAGLE drafting with `heads`: its drafters' keys and values in one pool, a slot for
        each request that can run at once, stepped by the draft step's packages (`EagleDraftPool`), or None where
        drafts run eager: an eager engine, CUDA's backend, quantized heads, or without our attention op (the drafter
        also checks that the op takes its cache)."""
        decoder = self.decoder
        if decoder is None or decoder.backend != "aoti" or heads.quant is not None \
                or "attention_kernel" not in decoder.options:
            return None
        if self._draft_pool is None or self._draft_pool.heads is not heads:  # (drafters keep the pool they have)
            self._draft_pool = EagleDraftPool(heads, self.loaded.model, self.max_seq_len + 2 * MAX_K,
                                              self.config.max_num_seqs + 1, decoder.buckets, decoder.run_draft)
        return self._draft_pool

    def _warm_up_drafts(self, spec: SpecConfig, batch_sizes: tuple[int, ...]) -> None:
        """Build (or load) the EAGLE draft step's packages that requests with `spec` run in groups of up to the
        largest of `batch_sizes`: every bucket of sequences up to that group's, each with every bucket of tokens (a
        catch-up reads up to k + 1 positions after a verification, but any number after plain steps: a group the
        engine keeps plain where that pays, a request with no room to draft). Left to a request's first use, a
        package's build (about 10 s on a 2-core CPU) once landed in a batch's timed run and read as batched EAGLE at
        0.40x plain batching."""
        drafter = self._drafter(spec)
        try:
            pool = getattr(drafter, "pool", None)
            if pool is None:
                return
            for sequences in pool.buckets:
                pool.warm_up(sequences)
                if sequences >= max(batch_sizes):
                    return
        finally:
            drafter.close()

    def _draft_together(self, requests: list[Request],
                        rooms: list[tuple[int, int]]) -> tuple[dict[int, tuple | list], float]:
        """The proposals of a step's speculating requests whose drafters are trained heads, drafted together by
        request index: EAGLE's drafters in the engine's pool (`draft_together`: each layer step one package call for
        all of them), Medusa's of the same heads (`medusa_together`: one pass of the heads and one of the scoring
        rows); each request's stats are charged an equal share of the time. A kind with fewer than two such
        requests drafts request by request. Also the seconds spent catching up on positions past EAGLE's largest
        package (after plain steps), which a step of a group that drafts every step does not spend."""
        eagle, medusa = {}, {}
        for index, (request, (k, width)) in enumerate(zip(requests, rooms)):
            drafter = request.drafter
            if k > 0 and (getattr(drafter, "pool", None) is not None or isinstance(drafter, MedusaDrafter)):
                jobs = medusa if isinstance(drafter, MedusaDrafter) else eagle
                jobs[index] = (drafter.tree_job(request.seq, k, width, request.spec.tree_prune) if width > 1
                               else drafter.chain_job(request.seq, k, request.params, request.generator))
        if medusa:  # (heads loaded again since a request began: that request drafts alone)
            heads = next(iter(medusa.values())).drafter.heads
            medusa = {index: job for index, job in medusa.items() if job.drafter.heads is heads}
        proposals, catch_up_s = {}, 0.0
        for jobs, together in ((eagle, draft_together), (medusa, medusa_together)):
            if len(jobs) < 2:
                continue
            started = time.perf_counter()
            proposals.update(zip(jobs, together(list(jobs.values()))))
            share_ms = (time.perf_counter() - started) * 1e3 / len(jobs)
            for index in jobs:
                requests[index].spec_stats.draft_ms += share_ms
            catch_up_s += sum(getattr(job, "catch_up_s", 0.0) for job in jobs.values())
        return proposals, catch_up_s

    # --- single-request use ---------------------------------------------------------------------------------------

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None,
                 **kwargs) -> Iterator[TokenEvent | FinishEvent]:
        """Validate now (keywords as `make_request`); return a generator of this request's events that queues the
        request on its first next() and steps the engine whenever it has no event to give. Other requests on this
        engine advance in the same steps."""
        return self._stream(self.make_request(prompt, params, **kwargs))

    def _stream(self, request: Request) -> Iterator[TokenEvent | FinishEvent]:
        self.enqueue(request)
        try:
            while True:
                while request.events:
                    event = request.events.popleft()
                    try:
                        yield event
                    except StopGeneration:
                        self.stop(request)
                    if isinstance(event, FinishEvent):
                        return
                if request.error is not None:
                    raise request.error
                if request.finished:  # cancelled from elsewhere
                    return
                if self.seconds_until_ready() == math.inf:
                    self.drain()  # a static batch waits for more requests, and this caller is not sending any
                self.step()
        finally:
            self.cancel(request)  # closed early or failed: its KV goes back (nothing to do once finished)

    def complete(self, prompt, params: SamplingParams | None = None, **kwargs) -> FinishEvent:
        """Run a request to the end and return its final event."""
        for event in self.generate(prompt, params, **kwargs):
            pass
        return event

    # --- asking, not reaching -------------------------------------------------------------------------------------

    def _compile_seconds(self) -> float:
        """Seconds this engine has spent compiling decode graphs so far (0 for an eager engine)."""
        return self.decoder.stats.warmup_s if self.decoder is not None else 0.0

    def roofline_points(self, stats: GenerationStats) -> list[dict]:
        """A finished request's prefill and decode as roofline points (`inference_core.roofline.run_points`): FLOPs
        and bytes from this engine's model and KV cache, its measured times, its decode steps' mean batch."""
        decode_s = (stats.generated_tokens - 1) / stats.decode_tokens_per_s if stats.decode_tokens_per_s else 0.0
        return run_points(self.loaded.config, weights_read_per_step(self.loaded.model),
                          getattr(self.kv_cache, "bytes_per_token", 0), stats.prompt_tokens,
                          stats.cached_prompt_tokens, stats.generated_tokens, stats.ttft_ms / 1e3, decode_s,
                          max(stats.batch_size_mean, 1.0))

    def compile_stats(self) -> dict | None:
        """Compiled decode's totals (`compiled.CompileStats`: options, warm-up seconds, graphs, recompiles); None
        for an eager engine."""
        return self.decoder.stats.as_dict() if self.decoder is not None else None

    def warm_up_compiled(self, batch_sizes: tuple[int, ...] = (1,), spec: SpecConfig | None = None) -> float:
        """Compile the flat step (prompts, mixed steps) and the decode graph for the buckets of `batch_sizes` now (a
        compiled engine otherwise compiles each on its first step of that kind), and the query steps requests with
        `spec` verify through (`compiled_queries`). Returns the seconds it took; 0 for an eager engine."""
        if self.decoder is None:
            return 0.0
        started = time.perf_counter()
        if self.decoder.flat_off is None:  # prompts and mixed steps
            self.decoder.warm_up_flat()
        for size in batch_sizes:
            self.decoder.warm_up(size)
            for queries in self.compiled_queries(spec, size):
                self.decoder.warm_up_queries(size, queries)
        if spec is not None and spec.enabled and spec.method == "eagle":
            self._warm_up_drafts(self.resolve_spec(spec), batch_sizes)
        return time.perf_counter() - started

    def compiled_queries(self, spec: SpecConfig | None, group: int = 1) -> tuple[int, ...]:
        """The query steps (tokens a sequence) a compiled engine runs for `group` requests with `spec`: a chain's
        longest verification, the last token and `max_k` drafts (fewer in a group: `drafts_that_fit`), or a tree's,
        the last token and k nodes a level for each of its `tree_width` candidates. Shorter ones run in the same
        package, and so do trained heads' short prompts and, alone, their plain steps (one token, its hidden state
        read); in a group, those have a package of one query: in the verification's package, 4 EAGLE requests kept
        plain where that paid took 14.3 ms a step against a decode step's 11.7.
        EAGLE's draft layer runs through packages of its own (`_eagle_pool`); early exit's and a draft model's passes
        run eager. A pruned tree (`SpecConfig.tree_prune`) may be smaller than its most: it verifies in the least of
        a few packages that holds it (2, 3, 4, 5, 7, 9, 13 or 17 tokens, up to its most). CUDA's torch.compile
        backend has no query step: its verifications (chains and trees) and hidden-state steps run in the flat step
        (token buckets recorded on first use), over a paged cache."""
        if spec is None or not spec.enabled or self.decoder is None or self.decoder.backend != "aoti":
            return ()
        spec = self.resolve_spec(spec)
        k, width = self.drafts_that_fit(spec.max_k, spec.tree_width, group)
        nodes = k * width
        plain = (1,) if spec.method in HIDDEN_READERS and group > 1 else ()
        if width > 1 and spec.tree_prune:
            return plain + tuple(sorted({1 + min(count, nodes) for count in (1, 2, 3, 4, 6, 8, 12, 16)}))
        return plain + (1 + nodes,)

    def drafts_that_fit(self, k: int, tree_width: int, group: int) -> tuple[int, int]:
        """`k` drafts a request and its tree's `tree_width`, shortened for a `group` of several speculating requests
        to what a verification of at most `verify_rows` rows holds (at least 1 draft each; a tree's drafts take
        `tree_width` rows a level, and a tree without room for one level verifies a chain). 4 EAGLE requests at
        once, compiled, 16 chat prompts (docs/benchmarks.md): 1 level of 2-wide trees (12 rows) 0.85-0.92x plain
        continuous batching, chains of 1 (8 rows) 1.08x."""
        if group > 1 and self.verify_rows:
            room = self.verify_rows // group - 1  # draft rows a request
            width = tree_width if room >= tree_width else 1
            return min(k, max(1, room // width)), width
        return k, tree_width

    def num_requests(self) -> int:
        """Requests queued or running (0 whenever nothing is generating)."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def blocks_in_use(self) -> int:
        """KV held right now: paged blocks (the draft model's too) or contiguous slots; 0 in mode none."""
        draft = self.draft_runner.kv_cache.blocks_in_use() if self.draft_runner is not None else 0
        return self.kv_cache.blocks_in_use() + draft

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, the draft model's too (paged KV; nothing to do in the other modes)."""
        caches = [self.kv_cache] + ([self.draft_runner.kv_cache] if self.draft_runner is not None else [])
        for cache in caches:
            if isinstance(cache, PagedKVCache):
                cache.manager.reset_prefix_cache()

    def kv_snapshot(self) -> dict | None:
        """The paged pool as plain values for drawing (None for the other KV modes): the block manager's snapshot
        (each block's state, owners, reference count and fill; each sequence's block table; free list and eviction
        order), each block's `token_ids` (what its filled slots hold, also for cached blocks no request owns), and
        `requests`: per running request its prompt length, tokens whose KV is stored and prompt tokens from the
        cache (a viewer shows text only for its own requests, by `seq_id`).
        `bytes_per_token` and `context_length` let a caller compare with what a contiguous cache would reserve;
        `kv_dtype` and `sliding_window` say how the pool stores and reads. A block-table entry FREED (-1) is a block
        that fell out of the sliding window and went back to the pool; `stored_tokens` counts only tokens still held."""
        if not isinstance(self.kv_cache, PagedKVCache):
            return None
        manager, block_size = self.kv_cache.manager, self.config.block_size
        seqs = [request.seq for request in self.scheduler.running]
        snapshot = manager.snapshot(seqs)
        held = {}  # block id -> tokens of its owning request (a shared block holds the same tokens for every owner)
        for seq in seqs:
            for index, block_id in enumerate(seq.block_table):
                if block_id != FREED:
                    held[block_id] = seq.token_ids[index * block_size:(index + 1) * block_size]
        for block, info in zip(manager.blocks, snapshot["blocks"]):
            tokens = held.get(block.block_id, block.token_ids or ())
            info["token_ids"] = list(tokens[:block.num_filled])
        snapshot["requests"] = [
            {"seq_id": seq.seq_id, "prompt_tokens": seq.num_prompt_tokens,
             "stored_tokens": self.kv_cache.held_tokens(seq),
             "cached_prompt_tokens": seq.num_cached_tokens, "block_table": list(seq.block_table)}
            for seq in seqs]
        snapshot["bytes_per_token"] = self.kv_cache.bytes_per_token
        snapshot["context_length"] = self.max_seq_len
        snapshot["kv_dtype"] = self.kv_cache.kv_dtype
        snapshot["sliding_window"] = self.kv_cache.sliding_window
        snapshot["attention_sinks"] = self.kv_cache.attention_sinks
        if self.kv_cache.int4 is not None:
            for info in snapshot["blocks"]:
                info["storage"] = self.kv_cache.int4.storage(info["id"])
        return snapshot
