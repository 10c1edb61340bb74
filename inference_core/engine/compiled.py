"""Compiled decode: the decode step with static shapes, compiled by inductor (CPU: C++ code, ahead of time into a
package kept on disk; CUDA: `torch.compile`, captured in CUDA graphs, one per batch bucket).

The eager step (`model.CausalLM.forward`) is written for any mix of prefills and decodes, and its shapes change
every step. This module's step does one thing, a token for each of B sequences that already have their context in
the KV cache, and is written so that a compiler can turn it into a few fused kernels:

- The batch is padded to a bucket (1, 2, 4, 8, ... up to `max_num_seqs`), so one graph serves every batch size up
  to its bucket; padding rows attend only to themselves and their output is dropped.
- The inputs (token ids, positions, the KV read index, a key mask) live in persistent buffers per bucket, filled in
  place each step; a step passes views of them.
- The KV cache is read, never written, inside the graph: contiguous reads each slot's buffer up to the key width,
  paged gathers whole blocks through the block table; a [batch, width] mask hides keys at or past each sequence's
  position, and the new token's own key is scored separately (softmax over [cached keys, own key]). The graph
  returns the logits and every layer's new k and v, which `store` writes into the cache with one indexed copy each
  (an in-place write inside the graph measured slower than eager: the compiler copied whole cache buffers). Between
  the CPU package's greedy steps back to back (`run_greedy`), one op of ours does that write, the argmax and the next
  step's inputs (`model.step_kernel`).
- The key width is the batch's longest context (paged: whole blocks), marked dynamic so that one compiled graph
  serves every length. On CUDA, where a CUDA graph is recorded for each shape it meets, the attention is one Triton
  kernel a layer (`triton_attention`) that reads each sequence up to its own position: the graph then takes the
  buffers' whole width, so one recording a bucket serves every length. Where the ATen ops run instead, which read
  the whole width they are given, the width is rounded up to a power of two (of blocks, or positions), so a few
  recordings serve every length and a short context never reads the cache's whole width. The batch dimension is
  dynamic there too (buckets above 1), so one inductor compile serves every bucket and each bucket records its own
  CUDA graph.

Nothing inside the step syncs with the host or loops over sequences. Two more steps run beside it by the same
machinery (`query_graph`): the query step (AOTInductor only), several tokens a sequence padded to one count
(speculative verification, trained draft heads' steps, which read hidden states), and the flat step, every other
step over a paged pool (prompts, prefill chunks, mixed steps of chunks and decodes, a static batch's prompts): any
number of new tokens a sequence, one after another, in one package whose token count and key width are dynamic. On
CUDA the flat step is compiled by torch.compile with its token count dynamic, padded to token buckets (`flat_tokens`)
that each record a CUDA graph, its attention our Triton kernel (`triton_attention.flat_attention`); it takes the
verifications (a draft tree's too: `TritonFlatGraph`) and hidden-state steps there. What none of them takes runs
eager (`refusal` and `flat_refusal` say why, and the stats count it).

Two ways to compile it (`CompiledDecoder(backend=...)`):

- `aoti` (the CPU's default): `torch.export` of the step, with the key width as a dynamic dimension, compiled ahead of
  time by AOTInductor with the same inductor options (freezing, max-autotune) into a package on disk
  (`compile_cache_dir()`), one per model, dtype, KV layout and batch bucket. With the options `row_kernel` and
  `attention_kernel` (`default_options`: the first for bf16 and quantized models, the second for every model), the bf16
  projections of steps of up to `row_kernel.max_rows` rows (16 where the weights are in pairs, else 8) run through our
  kernel (`model.row_kernel`) instead of the matmul inductor picks, and the attention over a bf16 or fp32 paged pool
  (the decode step's and the query step's) through our attention kernel (`model.attention_kernel`), with a bf16 model's
  MLP activation (`model.mlp_kernel`). A second start loads the package in a few seconds instead of compiling again:
  `torch.compile` cannot keep a frozen graph in its own caches (its prepacked oneDNN weights do not pickle), so it
  rebuilt the graph each start (about 70% of a first compile). Measured on the bundled model, fp32, batch 1: the same
  step time as `torch.compile` with those options (23.7 vs 23.6 ms). The package keeps its weights beside its library,
  and loading places them in huge pages (`package_weights`).
- `torch.compile` (CUDA's default, with CUDA graphs through `mode="reduce-overhead"`): compiled in the process, on
  the first step of each bucket; inductor's disk cache keeps its generated kernels between starts.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import os
import shutil
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from inference_core.config import ConfigError
from inference_core.config import int4_value_group
from inference_core.engine import package_weights, query_graph, triton_attention
from inference_core.engine.query_graph import (MAX_QUERIES, FlatGraph, QueryGraph, TritonFlatGraph, forward_layers,
                                               layer_pool, silu_mul)
from inference_core.engine.query_graph import read_context as _read_context
from inference_core.engine.runner import window_mask
from inference_core.model import attention_kernel, row_kernel, w4a8_kernel
from inference_core.model.llama import CausalLM, model_fingerprint
from inference_core.model.paths import cache_root
from inference_core.quant import linear as quant_linear

# Inductor options for the CPU decode step, the fastest of those measured by
# `python -m inference_core compile-options`
# (docs/benchmarks.md, "Compiled decode"): freezing makes the weights constants that are prepacked, and max-autotune
# then benchmarks inductor's C++ GEMM template against oneDNN/MKL per projection and keeps the faster (the template,
# for one-row decode matmuls). Bundled model, fp32, batch 1: eager 38.9 ms/step, default 38.3, freezing alone 44.8,
# max-autotune alone 38.9, both 20.8, both with the C++ wrapper 23.2.
CPU_OPTIONS = {"freezing": True, "max_autotune": True}


# With int8 weights max-autotune chooses, per projection, between ATen's `_weight_int8pack_mm` and inductor's C++
# GEMM template, by one timing of each at compile time with the weight in cache. The choice was not stable: one
# compile of the bundled model took ATen's kernel for every layer's gate/up projection, which costs about 3 ms of a 6
# ms step. Streamed from memory, as decode reads them (bf16, one row, 2 threads, the best of 5 passes over 96 MB of
# weights), ATen's kernel reads 10-16 GB/s at every projection shape of the bundled model (gate/up 154 us, LM head
# 2.6 ms); the template, in the compiled step's kernel profile, 24-29 GB/s (gate/up about 72 us, LM head about 1 ms).
# So the choice is made here, by that measurement: the template alone (where it cannot take a projection, the step
# compiles again with every backend: `CompiledDecoder._build_package`).
INT8_CPU_OPTIONS = {"max_autotune_gemm_backends": "CPP"}


# Options the flat step (`query_graph.FlatGraph`) is compiled without: max-autotune times each projection's
# candidates at the one token count it is exported with, a choice for every count the package serves (and the bundled
# model's flat package compiled in 142 s with it against 84 without, on the 2-core AVX2 host).
FLAT_DROPPED_OPTIONS = ("max_autotune", "max_autotune_gemm_backends")


RECOMPILE_LIMIT = 256  # graphs of the decode step one process may hold (engines x buckets)


CACHE_LIMIT_GB = 8.0  # AOTInductor packages kept on disk (the least recently used go first); env COMPILE_CACHE_GB


def compile_cache_dir() -> Path:
    """Where compiled decode steps are kept between starts (AOTInductor packages and inductor's own cache):
    env INFERENCE_CORE_COMPILE_CACHE, else `compiled/` in the local cache."""
    return Path(os.environ.get("INFERENCE_CORE_COMPILE_CACHE") or cache_root() / "compiled")


def compile_unavailable(device: torch.device) -> str | None:
    """Why compiled decode cannot run on `device` (None: it can)."""
    if os.environ.get("SPACES_ZERO_GPU"):
        return "ZeroGPU does not support torch.compile"
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler found (inductor generates C++ for the CPU; install g++)"
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not set up for {device.type} here"
    return None


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a graph is compiled for: powers of two below max_num_seqs, and max_num_seqs itself."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_seqs]


FLAT_LEAST_TOKENS = 16  # the least token bucket of the flat step on CUDA


def flat_tokens(count: int) -> int:
    """The token bucket of a flat step of `count` tokens on CUDA (a CUDA graph each): at least FLAT_LEAST_TOKENS, then
    four a doubling (20, 24, 28, 32, 40, ...), so that padding adds at most a quarter."""
    count = max(count, FLAT_LEAST_TOKENS)
    step = 1 << max(0, (count - 1).bit_length() - 3)
    return -(-count // step) * step


class DecodeGraph(nn.Module):
    """The decode step as a pure function of its inputs (see the module docstring). `paged` selects how the KV pool is
    read. Attention runs in each layer's `attention_dtype` as an opaque op (`decode_attention`), else in fp32: through
    our CPU kernel (`model.attention_kernel`) where `our_attention` asks for it and it takes the layer, else inline
    (`_attend_one_fused`), for inductor to compile."""

    def __init__(self, model: CausalLM, paged: bool, block_size: int, opaque_attention: bool = False,
                 our_attention: bool = False):
        super().__init__()
        self.model = model
        self.paged = paged
        self.block_size = block_size
        # Attention as one custom op the compiler does not look into (`decode_attention`): the key width, the only
        # size that changes from step to step, then reaches no kernel inductor generates, so no lowering decision
        # can specialize it (on CUDA inductor split the softmax over the width and fixed the width to a constant).
        self.opaque_attention = opaque_attention
        # Our CPU ops where they take a layer: the attention (`model.attention_kernel`) and a bf16 model's MLP
        # activation (`model.mlp_kernel`, as the flat step's and the query step's).
        self.our_attention = our_attention
        self.group = int4_value_group(model.config.head_dim)  # an int4 pool's (`query_graph.layer_pool`)

    def width_dims(self) -> dict[int, int]:
        """The dimension of each input that is the key width (dynamic in a package): the block table's (paged) and
        the key mask's."""
        return {2: 1, 3: 1} if self.paged else {3: 1}

    def forward(self, input_ids, positions, read_index, key_mask, *pool):
        """input_ids, positions: [B]; read_index: contiguous [B] slots, paged [B, blocks] int32 block table;
        key_mask: [B, width] bool, True where a cached key is attended. pool: the cache's whole tensors
        (`query_graph.layer_pool`). Returns fp32 logits [B, vocab] and the new k, v [layers, B, kv_heads, head_dim]."""
        width = key_mask.shape[1]

        def attend(index, attn, q, k, v):  # q: [B, heads, d]; k, v: [B, kv_heads, d]
            k_layer, v_layer = layer_pool(pool, index, self.group)
            if self.opaque_attention:
                dtype = attn.attention_dtype
                return decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), k_layer, v_layer, read_index,
                                        key_mask, positions, attn.scale, self.paged)
            if self.paged and self.our_attention and attention_kernel.takes(q, k, k_layer):
                return attention_kernel.attend(q, k, v, k_layer, v_layer, read_index, key_mask, attn.scale)
            k_ctx, v_ctx = _read_context(k_layer, v_layer, read_index, width, self.paged)
            return _attend_one_fused(q, k, v, k_ctx, v_ctx, key_mask, attn.scale)

        x, new_k, new_v = forward_layers(self.model, input_ids, positions, attend,
                                         activation=silu_mul if self.our_attention else None)
        return self.model.lm_head.forward(self.model.norm.forward(x)).float(), new_k, new_v


@torch.library.custom_op("inference_core::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     read_index: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor, scale: float,
                     paged: bool) -> torch.Tensor:
    """`_attend_one` over the context `_read_context` reads, as one op (q, k, v already in the attention dtype). On
    CUDA one Triton kernel (`triton_attention`) where it takes the layout, which reads each sequence's keys up to its
    position only; elsewhere the ATen ops, over the key mask's whole width."""
    if triton_attention.used(q.device, q.dtype, k_pool, paged):
        return triton_attention.decode_attention(q, k, v, k_pool, v_pool, read_index, key_mask, positions, scale,
                                                 paged)
    k_ctx, v_ctx = _read_context(k_pool, v_pool, read_index, key_mask.shape[1], paged)
    return _attend_one(q, k, v, k_ctx.to(q.dtype), v_ctx.to(q.dtype), key_mask, scale)


@decode_attention.register_fake
def _decode_attention_shape(q, k, v, k_pool, v_pool, read_index, key_mask, positions, scale, paged):
    batch, kv_heads, head_dim = k.shape
    return q.new_empty(batch, kv_heads, q.shape[1] // kv_heads, head_dim)


def _attend_one(q, k, v, k_ctx, v_ctx, key_mask, scale: float) -> torch.Tensor:
    """One query per sequence against its cached keys and its own new key, with grouped-query heads, in the inputs'
    dtype. q: [B, heads, d]; k, v: [B, kv_heads, d]; k_ctx, v_ctx: [B, kv_heads, width, d]; key_mask: [B, width].
    Returns [B, kv_heads, group, d]."""
    batch, kv_heads, head_dim = k.shape
    q = q.view(batch, kv_heads, -1, head_dim)  # [B, kv_heads, group, d]
    scores = (q @ k_ctx.transpose(-1, -2)) * scale  # [B, kv_heads, group, width]
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    own = (q * k[:, :, None, :]).sum(-1, keepdim=True) * scale  # [B, kv_heads, group, 1]
    probs = torch.softmax(torch.cat([scores, own], -1), dim=-1)
    return probs[..., :-1] @ v_ctx + probs[..., -1:] * v[:, :, None, :]


def _attend_one_fused(q, k, v, k_ctx, v_ctx, key_mask, scale: float) -> torch.Tensor:
    """`_attend_one` in fp32 written as products and sums instead of matmuls, for a graph that inductor compiles: it
    fuses each sum with the block-table read and the cast to fp32 into one loop over the cache, where the matmul
    form called two small ATen bmms a layer on copies of the context cast to fp32. Bundled model, batch 1, compiled
    steps interleaved with the matmul form's: fp32 14.3 against 16.6 ms a step (the same greedy ids), bf16 11.0
    against 12.0 ms."""
    batch, kv_heads, head_dim = k.shape
    q = q.view(batch, kv_heads, -1, head_dim).float()  # [B, kv_heads, group, d]
    scores = (q[:, :, :, None, :] * k_ctx[:, :, None, :, :].float()).sum(-1) * scale  # [B, kv_heads, group, width]
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    own = (q * k[:, :, None, :].float()).sum(-1, keepdim=True) * scale  # [B, kv_heads, group, 1]
    probs = torch.softmax(torch.cat([scores, own], -1), dim=-1)
    context = (probs[..., :-1, None] * v_ctx[:, :, None, :, :].float()).sum(-2)  # [B, kv_heads, group, d]
    return context + probs[..., -1:] * v[:, :, None, :].float()


@dataclass
class CompileStats:
    """What compilation cost and did, for `GenerationStats.compile` and the playground."""

    mode: str  # the backend and options in words, e.g. "AOTInductor on cpu (freezing, max-autotune)"
    warmup_s: float = 0.0  # seconds spent in the steps that compiled or loaded a graph (first use of each bucket)
    graphs: int = 0  # graphs this engine compiled or loaded (one per batch bucket used; 0 where another engine with
    # the same shapes had them in this process first)
    from_disk: int = 0  # of those, graphs loaded from the disk cache (a second start) instead of compiled
    recompiles: int = 0  # compiles of a bucket that already had a graph (should stay 0)
    compiled_steps: int = 0  # steps run through an already compiled graph
    # Of those, by bucket: "Bx1", the decode step of B sequences; "BxT query", the query step of B sequences of T new
    # tokens each (`query_graph`); "flat", the flat step (prefill chunks, mixed steps: `query_graph.FlatGraph`).
    steps_by_bucket: dict[str, int] = field(default_factory=dict)
    # Forwards of a compiled engine that ran eager, by the reason (`CompiledDecoder.refusal`).
    fallbacks: dict[str, int] = field(default_factory=dict)
    # EAGLE's draft layer steps run through its packages (`spec.draft_heads.EagleDraftStep`), by bucket: "2-token"
    # for one sequence, "4x2-token" for 4 sequences of up to 2 tokens; not forwards of the model, so not in the
    # counts above.
    draft_steps: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {name: dict(value) if isinstance(value, dict) else value for name, value in self.__dict__.items()}

    def since(self, before: dict) -> dict:
        """What the forwards since `before` (an earlier `as_dict()` of these stats) did: {"by_package": counts by
        package ("Bx1", "BxT query", "flat"), "eager": counts of the forwards that ran eager, by reason, "drafts":
        EAGLE's compiled draft steps by token bucket}."""
        def grown(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
            return {key: count - then.get(key, 0) for key, count in now.items() if count > then.get(key, 0)}

        return {"by_package": grown(self.steps_by_bucket, before["steps_by_bucket"]),
                "eager": grown(self.fallbacks, before["fallbacks"]),
                "drafts": grown(self.draft_steps, before["draft_steps"])}


def forwards_words(forwards: dict) -> str:
    """Compiled forwards (`CompileStats.since`) in a few words, by kind of step: 'all 27 compiled (1 flat, 16
    decode, 10 query)', with EAGLE's compiled draft steps beside them where there were any, or how many ran eager
    and why (the Stack tab's column, `profile`'s report)."""
    kinds: dict[str, int] = {}
    for package, count in forwards["by_package"].items():
        kind = "flat" if package == "flat" else "query" if package.endswith("query") else "decode"
        kinds[kind] = kinds.get(kind, 0) + count
    compiled, eager = sum(kinds.values()), sum(forwards["eager"].values())
    parts = f" ({', '.join(f'{count} {kind}' for kind, count in kinds.items())})" if kinds else ""
    drafts = sum(forwards["drafts"].values())
    drafted = f"; {drafts} EAGLE draft steps compiled" if drafts else ""
    if not eager:
        return f"all {compiled} compiled{parts}{drafted}"
    why = "; ".join(f"{count}: {reason}" for reason, count in forwards["eager"].items())
    return f"{compiled} of {compiled + eager} compiled{parts}{drafted}, eager: {why}"


class CompiledDecoder:
    """Runs decode steps through a compiled `DecodeGraph` for one engine's model and KV cache (contiguous or paged):
    pads the batch to its bucket, fills the bucket's persistent input buffers, calls the graph, and writes the new
    k/v into the cache. `ModelRunner` sends it every step that is only decodes."""

    def __init__(self, model: CausalLM, kv_cache, device: torch.device, max_num_seqs: int, max_seq_len: int,
                 options: dict | None = None, backend: str | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.paged = kv_cache.kv_mode == "paged"
        self.block_size = kv_cache.block_size if self.paged else 1
        # The most a sequence can read: blocks (paged) or positions (contiguous).
        self.max_width = (min(kv_cache.manager.num_blocks, -(-max_seq_len // self.block_size)) if self.paged
                          else kv_cache.max_seq_len)
        self.buckets = batch_buckets(max_num_seqs)
        self.backend = backend or default_backend(device)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown compile backend {self.backend!r}; one of {', '.join(BACKENDS)}")
        if kv_cache.int4 is not None and (reason := self._int4_unavailable()) is not None:
            raise ConfigError(f"the compiled steps cannot read this int4 KV cache: {reason}; turn compile off, or "
                              "use another KV dtype.")
        # The key width the graph takes. torch.compile (CUDA's backend) records a CUDA graph per shape: with the
        # Triton attention, which reads each sequence up to its own position only, the graph takes the buffers'
        # whole width (one recording a bucket, whatever the contexts); with the ATen ops, which read the whole width
        # they are given, the width the batch needs rounded up to a power of two. AOTInductor: the width needed.
        attention = (device, model.layers[0].self_attn.attention_dtype, self._layer_pool(), self.paged)
        self.whole_width = self.backend == "torch.compile" and triton_attention.used(*attention)
        self.width_buckets = self.backend == "torch.compile" and not self.whole_width
        self.options = dict(options if options is not None else default_options(device, model))
        # Our kernels (projections, paged attention), where asked and where they run (AOTInductor only: they are
        # chosen while exporting). Their build, on a machine's first start (about 35 s), counts as warm-up.
        started = time.perf_counter()
        ours = [name for name in ("row_kernel", "attention_kernel") if self.options.get(name)]
        if not ours:
            self.row_kernel_off = "not asked for"
        elif self.backend != "aoti":
            self.row_kernel_off = "it is chosen while exporting (the aoti backend)"
        else:
            self.row_kernel_off = row_kernel.unavailable()
        if self.row_kernel_off is not None:
            for name in ours:
                self.options.pop(name)
        # Greedy steps back to back (`run_greedy`): the host's work between two packages' calls in one op of ours
        # (`model.step_kernel`), where the extension builds; else the same work from Python (`_step`).
        self.host_advance = self.backend == "aoti" and device.type == "cpu" and row_kernel.unavailable() is None \
            and kv_cache.int4 is None  # its op writes the pool; an int4 cache is written through its tail
        self.stats = CompileStats(mode=describe_options(device, self.options, self.backend),
                                  warmup_s=time.perf_counter() - started)
        if self.backend == "torch.compile" and device.type == "cuda":  # its attention: `decode_attention`
            self.stats.mode += ", " + triton_attention.describe(*attention)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir() / "inductor"))
        model.rope_tables(model.embed_tokens.weight.dtype)  # built now: a graph traced before would be rebuilt after
        self.step = DecodeGraph(model, self.paged, self.block_size, opaque_attention=self.backend == "torch.compile",
                                our_attention="attention_kernel" in self.options).eval()
        self.query_step = QueryGraph(model, self.paged, self.block_size,  # several tokens a sequence
                                     our_attention="attention_kernel" in self.options).eval()
        # Any mix of sequences and new tokens (prefill chunks, mixed steps); on CUDA its attention our Triton kernel,
        # which takes a draft tree's verification too.
        self.flat_step = (FlatGraph if self.backend == "aoti" else TritonFlatGraph)(model).eval()
        self.flat_off = self._flat_unavailable()
        self.flat_trees = self.flat_off is None and self.backend != "aoti"  # a draft tree's verification in it too
        self._window = torch.tensor([kv_cache.sliding_window or 0, kv_cache.attention_sinks], dtype=torch.int32,
                                    device=device)
        # Inductor options are applied as a config patch around each call, not through torch.compile(options=...):
        # freezing (weights as constants, prepacked for oneDNN) is decided outside what `options` patches, and
        # measured no faster than no freezing when passed that way.
        self._inductor_config = {name: value for name, value in self.options.items()
                                 if name not in ("mode", "row_kernel", "attention_kernel")}
        if self.backend == "torch.compile":
            # Dynamo keeps the graphs of one function together and stops compiling past `recompile_limit` of them;
            # each model's step is a function of its own (`own_step_function`), with a graph per bucket class.
            # (torch._dynamo is read as an attribute: torch loads it on first use, a second's import at start-up.)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self._graph_counter = torch._dynamo.utils.counters["stats"]  # "unique_graphs": graphs dynamo has traced
            mode = self.options.get("mode")  # as options: torch.compile takes a mode or options, and the guards' filter
            # is an option
            options = dict(torch._inductor.list_mode_options(mode)) if mode else {}
            if module_guards_kept() is None:  # this model's graphs alone in their cache (`own_step_function`)
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
                self.stats.mode += ", module guards skipped"
            self.graph = torch.compile(own_step_function(self.step), fullgraph=True, dynamic=False, options=options)
            # The flat step: one compile whose token count is dynamic, a CUDA graph recorded for each token bucket
            # (`flat_tokens`) on its first use.
            self.flat_graph = torch.compile(own_step_function(self.flat_step), fullgraph=True, dynamic=False,
                                            options=options)
        # The KV pool keeps its address: a CUDA graph reads it in place. An input not marked so is copied into the
        # graph's own buffer before every replay (both pools, whole: 9.4 GB a step for 256 requests at Qwen3-0.6B's
        # shape) and held twice. Unguarded: another engine's pool (a race's other lane) is a recording of its own
        # under the same compile. Not where inductor freezes (the CPU's options): it makes static inputs constants.
        self.static_inputs = self.backend == "torch.compile" and not self._inductor_config.get("freezing")
        if self.static_inputs:
            for pool in (kv_cache.k, kv_cache.v):
                torch._dynamo.mark_static_address(pool, guard=False)
        self._programs: dict = {}  # aoti: bucket (or ("queries", bucket, query bucket)) -> loaded package
        self._new_masks: dict = {}  # `_new_mask`'s masks by shape
        self._ready_buckets: set[int] = set()  # buckets whose graph has run in this engine
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._key_positions = torch.arange(self.max_width * self.block_size, device=device)  # for the key masks

    def record_kernels(self) -> None:
        """Compile with inductor's kernel profiling, before the first step: each generated kernel then records itself
        on the torch profiler's timeline (`profile --kernels`; a package of its own, a few microseconds a kernel).
        The CPU's AOTInductor backend only."""
        if self.backend != "aoti":
            raise ConfigError(f"--kernels reads the kernels of the CPU's compiled step (AOTInductor); on "
                              f"{self.device.type} the {self.backend} backend's kernels show without it.")
        self.options["cpp.enable_kernel_profile"] = self._inductor_config["cpp.enable_kernel_profile"] = True
        self.stats.mode = describe_options(self.device, self.options, self.backend)

    def _bucket_buffers(self, bucket: int) -> dict[str, torch.Tensor]:
        buffers = self._buffers.get(bucket)
        if buffers is None:
            width = self.max_width
            index_shape = (bucket, width) if self.paged else (bucket,)
            index_dtype = torch.int32 if self.paged else torch.long
            buffers = self._buffers[bucket] = {
                "input_ids": torch.zeros(bucket, dtype=torch.long, device=self.device),
                "positions": torch.zeros(bucket, dtype=torch.long, device=self.device),
                "read_index": torch.zeros(index_shape, dtype=index_dtype, device=self.device),
                "key_mask": torch.zeros(bucket, width * self.block_size, dtype=torch.bool, device=self.device),
            }
            if self.static_inputs:
                # Filled in place before each step: the bucket's CUDA graph reads them where they are, as it reads
                # the KV pool, instead of copying them in (the width views of the ATen attention's steps are other
                # tensors, and are copied).
                for buffer in buffers.values():
                    torch._dynamo.mark_static_address(buffer, guard=False)
        return buffers

    def bucket_for(self, batch_size: int) -> int | None:
        return next((bucket for bucket in self.buckets if bucket >= batch_size), None)

    def handles(self, seqs, num_new_tokens: list[int]) -> bool:
        """Whether a forward is a compiled decode step: one new token per sequence, each with a cached context. (An
        exported step reads less than the cache's whole width: the last positions a sequence can reach run eager.)"""
        return all(count == 1 for count in num_new_tokens) and self.fits(seqs, 1)

    def fits(self, seqs, steps: int) -> bool:
        """Whether `steps` decode steps back to back (`run_greedy`) stay within what the graph reads."""
        last = (self.max_width - 1) * self.block_size if self.backend == "aoti" else float("inf")
        return 0 < len(seqs) <= self.buckets[-1] and all(
            0 < seq.num_computed_tokens and seq.num_computed_tokens + steps - 1 < last for seq in seqs)

    def refusal(self, seqs, num_new_tokens: list[int], padded: bool = False) -> str | None:
        """Why a forward of `num_new_tokens[i]` new tokens for each of `seqs` that the decode step does not take
        cannot run in the query step (None: it can). The reasons are what the stats' `fallbacks` count."""
        if self.backend != "aoti":
            return "the query step (several tokens a sequence, or hidden states) is the aoti backend's only"
        if padded:
            return "a static batch's padding"
        if len(seqs) > self.buckets[-1]:
            return f"more than {self.buckets[-1]} sequences"
        if max(num_new_tokens) > MAX_QUERIES:
            return f"more than {MAX_QUERIES} new tokens (a prefill chunk)"
        last = (self.max_width - 1) * self.block_size
        if any(seq.num_computed_tokens + count - 1 >= last for seq, count in zip(seqs, num_new_tokens)):
            return "the end of the compiled key width"
        return None

    def _int4_unavailable(self) -> str | None:
        """Why the compiled steps cannot read this engine's int4 KV cache (None: they can, through our op)."""
        if not self.paged:
            return "they read an int4 cache over a paged KV cache only"
        if self.backend != "aoti":
            return "they read it through our CPU op (the aoti backend's)"
        if self.kv_cache.int4.fused is None:
            return "our CPU op that reads it is not built here" + (
                f" ({row_kernel.unavailable()})" if row_kernel.unavailable() else "")
        return None

    def _layer_pool(self) -> torch.Tensor:
        """A layer's keys as the compiled attention reads them, for the checks of what takes it: the pool's (an int4
        cache's are read into the model dtype, as its full-precision tail holds them)."""
        int4 = self.kv_cache.int4
        return self.kv_cache.k[0] if int4 is None else int4.tail_k[0]

    def _pool_inputs(self, table: torch.Tensor) -> tuple:
        """The pool tensors a step's graph takes (`query_graph.layer_pool`): the cache's two pools; for an int4 cache
        its tensors and the blocks the step reads, each once (`Int4Blocks.read_plan`), with `table` (the step's block
        tables, int32) renumbered in place to index them. Call after `settle` and the step's tables are filled."""
        cache = self.kv_cache
        if cache.int4 is None:
            return cache.k, cache.v
        renumbered, blocks, tails = cache.int4.read_plan(table)
        table.copy_(renumbered)
        return cache.int4.codes, cache.int4.ranges, cache.int4.tail_k, cache.int4.tail_v, blocks, tails

    def _flat_unavailable(self) -> str | None:
        """Why this engine has no flat step (None: it has one)."""
        if not self.paged:
            return "prefill chunks and mixed steps compile over a paged KV cache only"
        if self.backend != "aoti":  # torch.compile: our Triton kernel is the flat step's attention
            reason = triton_attention.flat_unavailable(self.device, self.model.layers[0].self_attn.attention_dtype,
                                                       self._layer_pool())
            return None if reason is None else ("prefill chunks and mixed steps compile under torch.compile with our "
                                                f"Triton attention only ({reason})")
        if self.max_width < 3:
            return "prefill chunks and mixed steps compile for a KV pool of 3 blocks a sequence or more"
        reason = row_kernel.unavailable()
        if reason is not None:
            return f"prefill chunks and mixed steps compile with our attention op only ({reason})"
        attn = self.model.layers[0].self_attn
        q = torch.empty(1, attn.num_heads, attn.head_dim)
        if not attention_kernel.takes_flat(q, q[:, :attn.num_kv_heads], self._layer_pool()):
            return (f"prefill chunks and mixed steps compile for bf16 or fp32 KV pools, head_dim "
                    f"{', '.join(map(str, attention_kernel.HEAD_DIMS))} and at most "
                    f"{attention_kernel.MAX_GROUP} query heads a KV head only")
        return None

    def flat_refusal(self, seqs, num_new_tokens: list[int]) -> str | None:
        """Why a forward of `num_new_tokens[i]` new tokens for each of `seqs` cannot run in the flat step (None: it
        can). The reasons are what the stats' `fallbacks` count."""
        if self.flat_off is not None:
            return self.flat_off
        # aoti: a step of a single token needs a padding sequence (`run_flat`); torch.compile has a row for one.
        if len(seqs) > self.buckets[-1] or (sum(num_new_tokens) < 2 and len(seqs) == self.buckets[-1]
                                            and self.backend == "aoti"):
            return f"more than {self.buckets[-1]} sequences"
        if any(-(-seq.num_computed_tokens // self.block_size) >= self.max_width for seq in seqs):
            return "the end of the compiled key width"
        return None

    def _block_rows(self, seqs, rows: int, width: int) -> torch.Tensor:
        """The sequences' block tables, `width` blocks each, as [rows, width] int32 (rows past the sequences', and
        blocks past a table's end, block 0; so are blocks a sliding window gave back, FREED: the graphs read none of
        them)."""
        table = torch.zeros(rows, width, dtype=torch.int32)
        for row, seq in enumerate(seqs):
            blocks = [max(block, 0) for block in seq.block_table[:width]]
            table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    @torch.inference_mode()
    def run_flat(self, seqs, num_new_tokens: list[int], num_logits: int = 1, hidden_states: bool = True,
                 trees=None):
        """Forward `num_new_tokens[i]` new tokens of each of `seqs` after its cached ones through the flat step
        (`query_graph.FlatGraph`), where `flat_refusal` found none. Returns what `run_queries` does: the fp32 logits
        of each sequence's last `num_logits` new tokens, [rows, vocab], and per sequence the final-normed hidden
        states of its new tokens (None without `hidden_states`: the last layer then finishes only the rows whose
        logits are read). Writes the new KV (the caller has made room, and commits).

        AOTInductor: a package whose token count is dynamic (at least 2), over the block tables as wide as the step
        needs. torch.compile (CUDA): the tokens padded to a bucket (`flat_tokens`) by a padding sequence in a row of
        its own, the block tables whole and every row finished by the last layer, so that each bucket is one CUDA
        graph; there `trees[i]` = (depths, mask), or None, makes sequence i's new tokens a draft tree, as
        `run_queries` takes them (node j at position first + depths[j], seeing the nodes mask[j] marks; its KV written
        at slot first + j)."""
        self.kv_cache.settle()
        graphed = self.backend != "aoti"
        rows = self.buckets[-1] + graphed  # the padding sequence's row (aoti: a free row, `flat_refusal`)
        firsts = [seq.num_computed_tokens for seq in seqs]
        input_ids, positions, starts = [], [], [0]
        for seq, first, new in zip(seqs, firsts, num_new_tokens):
            input_ids += seq.token_ids[first:first + new]
            positions += range(first, first + new)
            starts.append(len(input_ids))
        real = len(input_ids)
        slots, seen = positions[:], [0] * real  # where each token's KV goes; a tree node's ancestors (bits)
        for index, tree in enumerate(trees or ()):
            if tree is not None:  # the sequence's new tokens a tree: positions by depth
                start, end = starts[index], starts[index + 1]
                positions[start:end] = [firsts[index] + depth for depth in tree[0]]
                seen[start:end] = [sum(1 << node for node, sees in enumerate(row) if sees) for row in tree[1].tolist()]
        tokens = flat_tokens(real) if graphed else max(real, 2)  # the package's token count is at least 2
        if tokens > real:  # a padding sequence, at positions from 0 with nothing cached
            input_ids += [0] * (tokens - real)
            positions += range(tokens - real)
            seen += [0] * (tokens - real)
            starts.append(tokens)
        starts += [tokens] * (rows + 1 - len(starts))
        width = self.max_width if graphed else self._width(max(-(-first // self.block_size) for first in firsts))
        table = self._block_rows(seqs, rows, width)
        pool = self._pool_inputs(table)
        logit_rows = [row for start, new in zip(starts, num_new_tokens)
                      for row in range(start + new - min(num_logits, new), start + new)]
        # The rows the last layer finishes: every token's where hidden states are read (or a bucket's graph is), else
        # the logits' (at least 2, the package's least: the last one again).
        keep = list(range(tokens)) if hidden_states or graphed else logit_rows + logit_rows[-1:] * (2 - len(logit_rows))
        args = (torch.tensor(input_ids), torch.tensor(positions), table, torch.tensor(starts, dtype=torch.int32),
                torch.tensor(firsts + [0] * (rows - len(seqs)), dtype=torch.int32), self._window, torch.tensor(keep))
        hidden, new_k, new_v = self._call_flat(tokens, args, seen, pool)
        token_seqs = [seq for seq, new in zip(seqs, num_new_tokens) for _ in range(new)]
        self._store(new_k[:, :real], new_v[:, :real], token_seqs, slots, None, None)
        if not hidden_states:
            return self.model.lm_head.forward(hidden[logit_rows if graphed else slice(len(logit_rows))]).float(), None
        logits = self.model.lm_head.forward(hidden[logit_rows]).float()
        if graphed:  # a CUDA graph's output, which its next replay overwrites
            hidden = hidden[:real].clone()
        return logits, [hidden[start:start + new] for start, new in zip(starts, num_new_tokens)]

    @torch.inference_mode()
    def warm_up_flat(self) -> None:
        """Compile (or load) the flat step with a step of one padding sequence of 2 tokens (torch.compile: of its
        least bucket's tokens, which records that bucket's graph); the cache is read, not written."""
        graphed = self.backend != "aoti"
        rows, tokens = self.buckets[-1] + graphed, flat_tokens(1) if graphed else 2
        table = torch.zeros(rows, self.max_width if graphed else 2, dtype=torch.int32)
        pool = self._pool_inputs(table)
        args = (torch.zeros(tokens, dtype=torch.long), torch.arange(tokens), table,
                torch.tensor([0] + [tokens] * rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                self._window, torch.arange(tokens))
        self._call_flat(tokens, args, [0] * tokens, pool)  # no tree

    @torch.inference_mode()
    def run_queries(self, seqs, num_new_tokens: list[int], num_logits: int = 1, trees=None):
        """Forward `num_new_tokens[i]` new tokens of each of `seqs` after its cached ones through the query step
        (`query_graph.QueryGraph`), where `refusal` found none. Returns (fp32 logits of each sequence's last
        `num_logits` new tokens, in the sequences' order, [rows, vocab]; per sequence the final-normed hidden states
        of its new tokens, [num_new_tokens[i], hidden]). Writes the new KV (the caller has made room, and commits).
        `trees[i]` = (depths, mask), or None: sequence i's new tokens are a draft tree (`ModelRunner.run_tree`), node
        j at position first + depths[j], seeing the nodes mask[j] marks ([nodes, nodes] bool) instead of the ones
        before it."""
        self.kv_cache.settle()
        count, bucket = len(seqs), self.bucket_for(len(seqs))
        # Queries a sequence: the fewest of a package already loaded that hold the step's, else the step's own.
        queries = min((key[2] for key in self._programs if isinstance(key, tuple) and key[0] == "queries"
                       and key[1] == bucket and key[2] >= max(num_new_tokens)), default=max(num_new_tokens))
        firsts = [seq.num_computed_tokens for seq in seqs]
        news, starts = num_new_tokens + [1] * (bucket - count), firsts + [0] * (bucket - count)
        # Each row's new tokens and their positions, its last one repeated up to `queries` (padding rows: token 0 at
        # position 0), built as lists: a verification's inputs were a dozen small tensor ops, a tenth of a
        # millisecond of a step, more with the caches cold after the forward before.
        trees = trees or [None] * count
        position_rows, id_rows = [], []
        for row, (first, new) in enumerate(zip(starts, news)):
            # a tree's nodes sit at their depths below node 0
            depths = trees[row][0] if row < count and trees[row] is not None else range(queries)
            steps = [min(offset, new - 1) for offset in range(queries)]
            position_rows.append([first + depths[step] for step in steps])
            tokens = seqs[row].token_ids[first:first + new] if row < count else [0]
            id_rows.append([tokens[step] for step in steps])
        positions, input_ids = torch.tensor(position_rows), torch.tensor(id_rows)
        width = self._width_needed(max(firsts) - 1)  # the cached keys: positions before each first new token
        if self.paged:  # the mask hides the padding blocks and those a sliding window gave back
            read_index = self._block_rows(seqs, bucket, width)
        else:
            read_index = torch.tensor([seq.cache_slot for seq in seqs] + [seqs[0].cache_slot] * (bucket - count))
        slot_rows = None if self.paged else read_index[[row for row, new in enumerate(num_new_tokens)
                                                        for _ in range(new)]]
        pool = self._pool_inputs(read_index)
        key_positions = self._key_positions[:width * self.block_size]
        # [B, T, width], whole (a package exported with one shape reads the strides of that shape: a mask broadcast
        # over T here gave every query after the first another query's row).
        key_mask = key_positions.expand(bucket, queries, -1) < torch.tensor(starts)[:, None, None]
        new_mask = self._new_mask(queries, news, trees)
        window, sinks = self.kv_cache.sliding_window, self.kv_cache.attention_sinks
        if window is not None:  # a query at position p sees keys at positions p - window + 1 .. p, and the sinks
            key_mask = key_mask & window_mask(key_positions[None, None, :], positions[:, :, None], window, sinks)
            new_mask = new_mask & window_mask(positions[:, None, :], positions[:, :, None], window, sinks)
        args = (input_ids, positions, read_index, key_mask, new_mask, *pool)
        logits, hidden, new_k, new_v = self._call_package(("queries", bucket, queries), args, self.query_step)
        # The real queries' rows of the flat [B * T] outputs, in the sequences' order.
        rows = [row * queries + offset for row, new in enumerate(num_new_tokens) for offset in range(new)]
        token_seqs = [seq for seq, new in zip(seqs, num_new_tokens) for _ in range(new)]
        token_positions = [first + offset for first, new in zip(firsts, num_new_tokens) for offset in range(new)]
        if len(rows) < new_k.shape[1]:  # padding queries or rows: the real ones' KV only
            index = torch.tensor(rows)
            new_k, new_v = new_k.index_select(1, index), new_v.index_select(1, index)
        self._store(new_k, new_v, token_seqs, token_positions, torch.tensor(token_positions), slot_rows)
        logit_rows = [row * queries + offset for row, new in enumerate(num_new_tokens)
                      for offset in range(new - min(num_logits, new), new)]
        # Consecutive rows (one sequence's verification) as a view: indexing copied 0.8 MB of fresh memory, 0.17 ms.
        # (The rows only ever increase, so they are consecutive where they span no more than their count.)
        consecutive = logit_rows[-1] - logit_rows[0] + 1 == len(logit_rows)
        return (logits[logit_rows[0]:logit_rows[-1] + 1] if consecutive else logits[logit_rows],
                [hidden[row * queries:row * queries + new] for row, new in enumerate(num_new_tokens)])

    def _new_mask(self, queries: int, news: list[int], trees: list) -> torch.Tensor:
        """[B, T, T] bool: which of its row's new keys each query sees (causal within the row's `news[b]` new tokens,
        or the row's tree's mask, `trees[b]`; every query, padding too, sees its own key). Kept by shape: a step of
        the same shape reads the same tensor (the packages never write their inputs)."""
        key = (queries, tuple(news), tuple(None if tree is None else (tuple(tree[0]), tree[1].numpy().tobytes())
                                          for tree in trees))
        mask = self._new_masks.get(key)
        if mask is None:
            offsets = torch.arange(queries)
            mask = (offsets[:, None] >= offsets[None, :]) & (offsets[None, None, :] < torch.tensor(news)[:, None, None])
            for row, tree in enumerate(trees):
                if tree is not None:
                    mask[row, :news[row], :news[row]] = tree[1]
            mask |= torch.eye(queries, dtype=torch.bool)
            if len(self._new_masks) >= 256:  # batches of every mix of lengths: keep the most recent shapes
                self._new_masks.pop(next(iter(self._new_masks)))
            self._new_masks[key] = mask
        return mask

    @torch.inference_mode()
    def run(self, seqs) -> torch.Tensor:
        """One decode token for each of `seqs` (each has its whole context but the last token cached). Returns fp32
        logits [len(seqs), vocab]; writes the new KV (the caller commits)."""
        self.kv_cache.settle()
        logits = self._step(seqs, [seq.num_computed_tokens for seq in seqs])
        # A CUDA graph's output is overwritten by its next replay; an exported program's is new at every call.
        return logits if self.backend == "aoti" else logits.clone()

    @torch.inference_mode()
    def run_greedy(self, seqs, steps: int) -> list[list[int]]:
        """`steps` decode steps back to back, each step's greedy token (the argmax of its fp32 logits, as the
        sampler takes it) fed to the next step on the device, so the host reads the tokens once, after the last
        step, instead of once a step: on a GPU the host's work between steps (this runner's, the scheduler's, the
        sampler's, the read itself) then no longer leaves the device idle. Returns the ids, [steps][len(seqs)].
        Writes the KV of each sequence's next `steps` positions (the caller has made room, and commits each position
        once the token at it is in the sequence)."""
        self.kv_cache.settle()
        if self.host_advance:
            return self._run_greedy_advancing(seqs, steps)
        firsts = [seq.num_computed_tokens for seq in seqs]
        tokens, ids = [], None
        for step in range(steps):
            ids = self._step(seqs, [first + step for first in firsts], ids).argmax(dim=-1)
            tokens.append(ids)
        return torch.stack(tokens).tolist()

    def _run_greedy_advancing(self, seqs, steps: int) -> list[list[int]]:
        """`run_greedy` with the host's work between two steps in one op of ours (`model.step_kernel`): it writes
        the new KV, takes the argmax and sets the next step's inputs in the bucket's buffers, in place. The inputs
        come from the sequences only where the key width the step reads grows."""
        count, firsts = len(seqs), [seq.num_computed_tokens for seq in seqs]
        bucket = self.bucket_for(count)
        tokens = torch.empty(steps, count, dtype=torch.long)
        window, sinks = self.kv_cache.sliding_window or 0, self.kv_cache.attention_sinks
        width = None
        for step in range(steps):
            if self._width_needed(max(firsts) + step) != width:
                buffers, read_index, key_mask, width, pool = self._prepare(
                    seqs, [first + step for first in firsts], tokens[step - 1] if step else None)
            logits, new_k, new_v = self._call(bucket, buffers, read_index, key_mask, pool)
            torch.ops.inference_core.greedy_advance(
                logits, new_k, new_v, self.kv_cache.k, self.kv_cache.v, read_index, buffers["input_ids"],
                buffers["positions"], key_mask, tokens, step, count, self.block_size, window, sinks, self.paged)
        return tokens.tolist()

    def _step(self, seqs, positions: list[int], input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of `seqs` at `positions`, their input tokens read from the sequences, or `input_ids` (a
        device tensor: the previous step's tokens). Returns the logits of the bucket's real rows (a view of the
        graph's output)."""
        count = len(seqs)
        buffers, read_index, key_mask, _, pool = self._prepare(seqs, positions, input_ids)
        logits, new_k, new_v = self._call(self.bucket_for(count), buffers, read_index, key_mask, pool)
        self._store(new_k[:, :count], new_v[:, :count], seqs, positions, buffers["positions"][:count],
                    read_index[:count])
        return logits[:count]

    def _prepare(self, seqs, positions: list[int], input_ids: torch.Tensor | None):
        """Fill the bucket's buffers for a step of `seqs` at `positions` (padding rows after them). Returns the
        buffers, the read index and key mask the graph takes, the key width (blocks, or positions) and the pool
        tensors (`_pool_inputs`)."""
        count = len(seqs)
        bucket = self.bucket_for(count)
        buffers = self._bucket_buffers(bucket)
        # The host's inputs go to the device as one tensor (positions, then the input ids where the sequences give
        # them, then the read index): on CUDA one copy that does not wait for the device (`_to_device`).
        host = list(positions)
        if input_ids is None:
            host += [seq.token_ids[p] for seq, p in zip(seqs, positions)]
        width = self._width_needed(max(positions))
        if self.paged:
            # Padded with block 0; so are blocks released from a sliding window (FREED, -1): the key mask hides both.
            for seq in seqs:
                host += ([max(block, 0) for block in seq.block_table[:width]] + [0] * width)[:width]
        else:
            host += [seq.cache_slot for seq in seqs]
        staged = self._to_device(torch.tensor(host, dtype=torch.long))
        position_tensor, staged = staged[:count], staged[count:]
        if input_ids is None:
            input_ids, staged = staged[:count], staged[count:]
        read_index, key_mask = self._graph_inputs(buffers, width)
        keys = width * self.block_size  # what this step fills (`whole_width`: the graph reads no further)
        if self.paged:
            read_index[:count, :width] = staged.view(count, width)
        else:
            read_index[:count] = staged
        buffers["input_ids"][:count] = input_ids
        buffers["positions"][:count] = position_tensor
        key_positions = self._key_positions[:keys]
        torch.lt(key_positions, position_tensor[:, None], out=key_mask[:count, :keys])
        if self.kv_cache.sliding_window is not None:  # the own key (scored apart) is the window's last one
            key_mask[:count, :keys] &= window_mask(key_positions, position_tensor[:, None],
                                                   self.kv_cache.sliding_window, self.kv_cache.attention_sinks)
        if count < bucket:  # padding rows: token 0 at position 0 in block 0 (or the first row's slot), no cached key
            read_index[count:] = 0 if self.paged else read_index[0]
            buffers["input_ids"][count:] = 0
            buffers["positions"][count:] = 0
            key_mask[count:] = False
        return buffers, read_index, key_mask, width, self._pool_inputs(read_index)

    def _width_needed(self, last_position: int) -> int:
        """The key width (`_width`) of a step whose furthest sequence is at `last_position`."""
        return self._width(-(-(last_position + 1) // self.block_size) if self.paged else last_position + 1)

    @torch.inference_mode()
    def warm_up(self, batch_size: int) -> None:
        """Compile (or load from the disk cache) the graph of `batch_size`'s bucket with a step of padding rows only;
        the cache is read, not written."""
        bucket = self.bucket_for(batch_size)
        buffers = self._bucket_buffers(bucket)
        for buffer in buffers.values():
            buffer.zero_()
        read_index, key_mask = self._graph_inputs(buffers, self._width(2))
        self._call(bucket, buffers, read_index, key_mask, self._pool_inputs(read_index))

    def _graph_inputs(self, buffers: dict[str, torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The read index and the key mask the graph takes: views of the bucket's buffers `width` wide (blocks, or
        positions), or the buffers themselves (`whole_width`: the static inputs their graph reads in place)."""
        if self.whole_width:
            return buffers["read_index"], buffers["key_mask"]
        read_index = buffers["read_index"][:, :width] if self.paged else buffers["read_index"]
        return read_index, buffers["key_mask"][:, :width * self.block_size]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on this decoder's device. On CUDA through pinned memory, a copy the host does not wait for (a copy
        from pageable memory waits for the device to finish its queue, so the host could not prepare the next step,
        or the next of `run_greedy`'s steps, while the device runs this one); torch's pinned-memory cache keeps the
        block until the copy is done."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _width(self, needed: int) -> int:
        """The key width a step reads (positions, or blocks when paged): what the batch needs but at least 2 (a
        dynamic size of 1 would be specialized to 1 by the compiler), rounded up to a power of two on CUDA, at most
        the cache's whole width."""
        if self.max_width < 2:
            return self.max_width
        width = max(needed, 2)
        if self.width_buckets:
            width = 1 << (width - 1).bit_length()
        return min(width, self.max_width)

    def _call(self, bucket: int, buffers: dict[str, torch.Tensor], read_index, key_mask, pool: tuple):
        args = (buffers["input_ids"], buffers["positions"], read_index, key_mask, *pool)
        if self.backend == "aoti":
            return self._call_package(bucket, args)
        return self._call_compiled(bucket, args)

    def run_draft(self, graph: nn.Module, sequences: int, tokens: int, args: tuple):
        """EAGLE's draft layer step of `sequences` sequences (a batch bucket) and `tokens` tokens (`sequences` times
        one of `spec.draft_heads.DRAFT_TOKENS`) through its package (`graph`: an `EagleDraftStep`, whose heads'
        identity keys it: an engine may load other heads), loaded or built on first use (AOTInductor only)."""
        return self._call_package(("draft", sequences, tokens, graph.identity), args, graph)

    def _call_package(self, bucket, args: tuple, graph: nn.Module | None = None):
        """Call the package of `bucket` (a batch bucket of the decode step, ("queries", batch bucket, query bucket)
        of `graph`, the query step, ("flat",) of the flat step or ("draft", sequences, tokens, heads) of EAGLE's
        draft step), loading or building it on first use."""
        # An exported program takes its inputs with the strides it was traced with (dense): the width views of the
        # bucket's buffers are not.
        args = tuple(arg.contiguous() for arg in args)
        started = time.perf_counter()
        program = self._programs.get(bucket)
        if program is None:
            program = self._programs[bucket] = self._load_or_build(args, self.step if graph is None else graph)
            self.stats.warmup_s += time.perf_counter() - started
        elif isinstance(bucket, tuple) and bucket[0] == "draft" and bucket in self._ready_buckets:
            name = f"{bucket[2]}-token" if bucket[1] == 1 else f"{bucket[1]}x{bucket[2] // bucket[1]}-token"
            self.stats.draft_steps[name] = self.stats.draft_steps.get(name, 0) + 1
        elif bucket in self._ready_buckets:
            self.stats.compiled_steps += 1
            name = (f"{bucket}x1" if not isinstance(bucket, tuple) else "flat" if bucket[0] == "flat"
                    else f"{bucket[1]}x{bucket[2]} query")
            self.stats.steps_by_bucket[name] = self.stats.steps_by_bucket.get(name, 0) + 1
        self._ready_buckets.add(bucket)
        # The package's loader, called with the flat list of inputs, as the package's own __call__ does after
        # flattening them through the export's input spec, which it parses from JSON at every call: 0.2 ms a step.
        return program.loader.boxed_run(list(args))

    def _call_compiled(self, bucket: int, args: tuple):
        input_ids, positions, read_index, key_mask = args[:4]
        # maybe_mark_dynamic: where the compiler specializes a size after all, it compiles again (counted in
        # `recompiles`, which the tests hold at 0) instead of failing the step.
        if self.max_width >= 2 and not self.whole_width:
            torch._dynamo.maybe_mark_dynamic(key_mask, 1)
            if self.paged:
                torch._dynamo.maybe_mark_dynamic(read_index, 1)
        if bucket > 1:  # one compile for every bucket above 1; each records its own graph
            for tensor in (input_ids, positions, read_index, key_mask):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return self._run_traced(self.graph, bucket, f"{bucket}x1", args)

    def _call_flat(self, tokens: int, args: tuple, seen: list[int], pool: tuple):
        """The flat step of `tokens` tokens on `args` (its inputs before the pool, on the host) and `pool`: its package
        (AOTInductor), or its torch.compile graph with `seen` (each token's tree bits) after them, all on the device."""
        if self.backend == "aoti":
            return self._call_package(("flat",), (*args, *pool), self.flat_step)
        inputs = tuple(arg if arg is self._window else self._to_device(arg) for arg in (*args, torch.tensor(seen)))
        return self._call_flat_compiled(tokens, (*inputs, *pool))

    def _call_flat_compiled(self, tokens: int, args: tuple):
        """The flat step through torch.compile: one graph whose token count (inputs 0, 1, `keep` and `seen`) is
        dynamic, a CUDA graph recorded for each bucket of `tokens` on its first call (counted as warm-up)."""
        for index in (0, 1, FlatGraph.KEEP, TritonFlatGraph.SEEN):
            torch._dynamo.maybe_mark_dynamic(args[index], 0)
        return self._run_traced(self.flat_graph, ("flat", tokens), "flat", args)

    def _run_traced(self, graph, bucket, name: str, args: tuple):
        """Call `graph` (compiled by torch.compile) for `bucket`, counting what it cost: a graph dynamo traced (a
        recompile where the bucket had run), warm-up for a bucket's first call, else a compiled step of `name`."""
        graphs_before = self._graph_counter["unique_graphs"]
        started = time.perf_counter()
        with torch._inductor.config.patch(self._inductor_config):
            outputs = graph(*args)
        if self._graph_counter["unique_graphs"] != graphs_before:
            if bucket in self._ready_buckets:
                self.stats.recompiles += 1
            self.stats.graphs += 1
            self.stats.warmup_s += time.perf_counter() - started
        elif bucket in self._ready_buckets:
            self.stats.compiled_steps += 1
            self.stats.steps_by_bucket[name] = self.stats.steps_by_bucket.get(name, 0) + 1
        else:  # another engine with the same shapes compiled this graph already (or a new CUDA graph's recording)
            self.stats.warmup_s += time.perf_counter() - started
        self._ready_buckets.add(bucket)
        return outputs

    def _load_or_build(self, args: tuple, graph: nn.Module):
        """The AOTInductor package of `graph` (the decode step or the query step) for these inputs' shapes (one
        bucket): already loaded in this process (by another engine with the same model and shapes), loaded from the
        disk cache, or exported, compiled and written there first."""
        key = self._package_key(args, graph)
        path = compile_cache_dir() / f"decode-{key}.pt2"
        with _PACKAGE_LOCK:
            program = _LOADED_PACKAGES.get(key)
            if program is not None:
                return program
            if path.exists():
                self.stats.from_disk += 1
                os.utime(path)  # recently used: kept when the cache is trimmed
            else:
                self._build_package(args, path, graph)
            program = torch._inductor.aoti_load_package(str(path))
            # Its weights in huge pages, kept alive with the package (`package_weights`).
            program.weights = package_weights.load(program, path)
            self.stats.graphs += 1
            _LOADED_PACKAGES[key] = program
            return program

    def _build_package(self, args: tuple, path: Path, graph: nn.Module) -> None:
        flat = isinstance(graph, FlatGraph)
        dynamic = self._dynamic_sizes(graph, len(args))
        if any(dynamic):  # as the forward's signature nests them: its named inputs, then the pool's (`*pool`)
            dynamic = [sizes or None for sizes in dynamic]
            fixed = _fixed_inputs(graph)
            dynamic = tuple(dynamic[:fixed]) + ((tuple(dynamic[fixed:]),) if fixed < len(dynamic) else ())
        else:
            dynamic = None
        with torch.inference_mode(False), torch.no_grad():
            # Shapes are what export needs: the values are not read, the cache tensors are not copied.
            example = tuple(torch.zeros_like(t) if t.numel() < 1 << 20 else torch.empty_like(t) for t in args)
            # The flat step's projections take any number of rows: inductor's matmuls, not our op (for 8 or 16 rows).
            with row_kernel.tracing("row_kernel" in self.options and not flat):
                program = torch.export.export(graph, example, dynamic_shapes=dynamic)
            configs = dict(self._inductor_config)
            if flat:
                for name in FLAT_DROPPED_OPTIONS:
                    configs.pop(name, None)
            if "row_kernel" in self.options or "attention_kernel" in self.options or flat:  # our ops as C functions
                configs["aot_inductor.custom_ops_to_c_shims"] = row_kernel.c_shims()
            if package_weights.can_keep_beside(program):  # its constants beside its library, for huge pages
                configs.update(package_weights.PACKAGE_OPTIONS)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"partial-{os.getpid()}-{path.name}")
            try:
                # A copy: the call adds its own entries to the dict it is given (the retry below starts from ours).
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                         inductor_configs=dict(configs))
            except Exception:  # a projection the template alone cannot take: every backend
                if "max_autotune_gemm_backends" not in configs:
                    raise
                configs.pop("max_autotune_gemm_backends")
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=configs)
        os.replace(partial, path)
        trim_compile_cache()

    def _dynamic_sizes(self, graph: nn.Module, count: int) -> list[dict]:
        """For each of the first `count` inputs of `graph`, its dynamic dimensions and their export sizes: the key
        width where the cache is 3 or more wide (blocks in the block table, input 2; positions in a key mask; up to the
        cache's whole width less one, which export's shape reasoning treats as a special case), the flat step's
        token count, and the slots of EAGLE's draft pool. The buckets and the cache tensors are fixed."""
        sizes = [{} for _ in range(count)]
        if self.max_width >= 3:
            width = torch.export.Dim("width", min=2, max=self.max_width - 1)
            for index, dim in graph.width_dims().items():
                if index < count:
                    sizes[index][dim] = width if index == 2 else width * self.block_size
        if isinstance(graph, FlatGraph):
            tokens = torch.export.Dim("tokens", min=2)
            for index, dim in graph.token_dims().items():
                if index < count:
                    sizes[index][dim] = tokens
            if count > FlatGraph.KEEP:
                sizes[FlatGraph.KEEP][0] = torch.export.Dim("keep", min=2)
        if hasattr(graph, "slot_dims"):  # EAGLE's draft pool: its slots, however many requests an engine runs
            slots = torch.export.Dim("slots", min=2)
            for index, dim in graph.slot_dims().items():
                sizes[index][dim] = slots
        if count - _fixed_inputs(graph) == INT4_POOL_INPUTS:  # an int4 pool: its tail's blocks, the blocks read
            first, tail, read = _fixed_inputs(graph), torch.export.Dim("tail", min=2), torch.export.Dim("read", min=2)
            sizes[first + 2][1] = sizes[first + 3][1] = tail
            sizes[first + 4][0] = sizes[first + 5][0] = read
        return sizes

    def _package_key(self, args: tuple, graph: nn.Module | None = None) -> str:
        """What the compiled step depends on: the weights and config, this code, the shapes, the options, torch,
        the CPU's instruction set and which int8 and int4 projections the export gives our op (`row_kernel.int8_form`,
        `int4_form`). The key width, a dynamic size of the package (`_build_package`), is left out: the width of the
        step that happens to build a bucket's package must not key it (an engine whose first step of a bucket met
        another width compiled the same step again)."""
        graph = self.step if graph is None else graph
        shapes = [(t.dtype, tuple(size for dim, size in enumerate(t.shape) if dim not in dynamic))
                  for t, dynamic in zip(args, self._dynamic_sizes(graph, len(args)))]
        digest = hashlib.blake2b(digest_size=12)
        for part in (type(graph).__name__, model_fingerprint(self.model), getattr(graph, "identity", None),
                     _CODE_FINGERPRINT, torch.__version__,
                     self.device.type, torch.backends.cpu.get_cpu_capability(), row_kernel.int8_form(),
                     row_kernel.int4_form(), row_kernel.pairs_form(), row_kernel.amx_rows(),
                     self.paged, self.block_size, self.max_width, sorted(self.options.items()), shapes):
            digest.update(repr(part).encode())
        return digest.hexdigest()

    def ready(self, batch_size: int, queries: int = 0) -> bool:
        """Whether the decode graph of `batch_size`'s bucket has run once (compiled, or found compiled) in this
        engine; with `queries`, the query step of that many tokens a sequence (or more) too."""
        bucket = self.bucket_for(batch_size)
        return bucket in self._ready_buckets and (not queries or any(
            isinstance(key, tuple) and key[0] == "queries" and key[1] == bucket and key[2] >= queries
            for key in self._ready_buckets))

    @torch.inference_mode()
    def warm_up_queries(self, batch_size: int, queries: int) -> None:
        """Compile (or load) the query step of `queries` tokens a sequence for `batch_size`'s bucket, with a step of
        padding rows only (the cache is read, not written)."""
        bucket = self.bucket_for(batch_size)
        width = self._width(2)
        mask = torch.eye(queries, dtype=torch.bool).expand(bucket, queries, queries).contiguous()
        read_index = (torch.zeros(bucket, width, dtype=torch.int32) if self.paged
                      else torch.zeros(bucket, dtype=torch.long))
        pool = self._pool_inputs(read_index)  # the cache's two pools, or an int4 cache's (paged only)
        args = (torch.zeros(bucket, queries, dtype=torch.long), torch.zeros(bucket, queries, dtype=torch.long),
                read_index, torch.zeros(bucket, queries, width * self.block_size, dtype=torch.bool), mask, *pool)
        self._call_package(("queries", bucket, queries), args, self.query_step)

    def weight_memory(self) -> list[torch.Tensor]:
        """The memory this engine's compiled steps read their weights from, in place: int64 views of the buffers that
        hold each loaded package's constants, the frozen (and packed) weights (`package_weights`). `bench` times a sum
        over them beside its 1 GiB probe: on the 2-core VM the two read up to about 25% apart at one moment. Empty
        before a package is loaded, and for the torch.compile backend (no package)."""
        return [program.weights.view(torch.int64) for program in self._programs.values()
                if getattr(program, "weights", None) is not None]

    def _store(self, new_k, new_v, seqs, positions: list[int], position_tensor, read_index) -> None:
        """Write each layer's new k/v ([layers, B, kv_heads, d]) at the sequences' positions."""
        cache = self.kv_cache
        if cache.int4 is not None:  # into the full-precision tail (`kv.int4`)
            size = self.block_size
            slots = cache.int4.write_slots((seq.block_table[p // size], p % size) for seq, p in zip(seqs, positions))
            cache.int4.write_layers(new_k, new_v, slots)
        elif self.paged:
            size = self.block_size
            slots = [seq.block_table[p // size] * size + p % size for seq, p in zip(seqs, positions)]
            k_flat = cache.k.view(cache.k.shape[0], -1, *cache.k.shape[3:])
            v_flat = cache.v.view(cache.v.shape[0], -1, *cache.v.shape[3:])
            if len(slots) == 1:  # batch 1: two plain copies (no index tensor to build)
                k_flat[:, slots[0]].copy_(new_k[:, 0])
                v_flat[:, slots[0]].copy_(new_v[:, 0])
            else:
                slots = self._to_device(torch.tensor(slots))
                k_flat.index_copy_(1, slots, new_k)
                v_flat.index_copy_(1, slots, new_v)
        else:
            cache.k[:, read_index, :, position_tensor] = new_k.transpose(0, 1)
            cache.v[:, read_index, :, position_tensor] = new_v.transpose(0, 1)


INT4_POOL_INPUTS = 6  # an int4 pool's tensors a graph takes (`query_graph.layer_pool`); the others take 2


def _fixed_inputs(graph: nn.Module) -> int:
    """How many inputs `graph`'s forward names before its pool's tensors (`*pool`)."""
    parameters = inspect.signature(graph.forward).parameters.values()
    return sum(parameter.kind == parameter.POSITIONAL_OR_KEYWORD for parameter in parameters)


_STEP_NUMBERS = itertools.count()
# model -> {(step class, paged, block size, opaque attention): the step function of its decoders}
_STEP_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STEP_FUNCTIONS_LOCK = threading.Lock()


def own_step_function(step: nn.Module):
    """`step.forward` (a `DecodeGraph`'s or a `FlatGraph`'s) as a method whose code object belongs to `step`'s model
    (and step layout) alone. Dynamo keeps compiled graphs by code object: were every decoder of a process to compile
    `DecodeGraph.forward` itself, all of their graphs would share one cache, and only dynamo's guards on the modules
    would tell one model from another (a quantized copy, say, whose step takes inputs of the same shapes). Those
    guards cost about 110 us a call on an H100's host and 100-170 us on a 2-core CPU (docs/benchmarks.md, "GPU").
    With a code object per model, its cache holds that model's graphs alone, so the guards on its modules can be
    skipped (`module_guards_kept`), and the engines of one model (a race's two lanes) still share their graphs."""
    kind = type(step)
    key = (kind, getattr(step, "paged", True), getattr(step, "block_size", None),
           getattr(step, "opaque_attention", None))
    with _STEP_FUNCTIONS_LOCK:
        functions = _STEP_FUNCTIONS.setdefault(step.model, {})
        if key not in functions:
            forward = kind.forward
            name = f"{'decode' if kind is DecodeGraph else 'flat'}_step_{next(_STEP_NUMBERS)}"
            code = forward.__code__.replace(co_name=name, **({"co_qualname": name} if sys.version_info >= (3, 11)
                                                             else {}))
            functions[key] = types.FunctionType(code, forward.__globals__, name, forward.__defaults__,
                                                forward.__closure__)
    return types.MethodType(functions[key], step)


def module_guards_kept() -> str | None:
    """Why dynamo keeps its guards on the compiled step's modules (None: they are skipped). The step's modules do not
    change after its decoders are built (the weights are the graph's inputs, read at each call), so those guards only
    cost time; `INFERENCE_CORE_MODULE_GUARDS=1` keeps them (for an A/B, or a torch where skipping them fails)."""
    if os.environ.get("INFERENCE_CORE_MODULE_GUARDS", "0") == "1":
        return "INFERENCE_CORE_MODULE_GUARDS=1"
    if not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        return f"torch {torch.__version__} cannot skip them"
    return None


BACKENDS = ("aoti", "torch.compile")
_PACKAGE_LOCK = threading.Lock()
# Loaded packages by key, shared by the engines of one process while any of them holds one.
_LOADED_PACKAGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_CODE_FINGERPRINT = hashlib.blake2b(  # the model, the quantized projections, this module and our kernels' (whose ops
    "".join(inspect.getsource(module) for module in (  # and packed weights a package holds)
        sys.modules[CausalLM.__module__], quant_linear, sys.modules[__name__], query_graph, row_kernel,
        attention_kernel, w4a8_kernel, package_weights)).encode(),
    digest_size=12).hexdigest()


def trim_compile_cache(limit_gb: float | None = None) -> None:
    """Delete the least recently used packages until the cache holds at most `limit_gb` (env COMPILE_CACHE_GB)."""
    limit = limit_gb if limit_gb is not None else float(os.environ.get("COMPILE_CACHE_GB", CACHE_LIMIT_GB))
    packages = sorted(compile_cache_dir().glob("decode-*.pt2"), key=lambda path: path.stat().st_mtime, reverse=True)
    total = packages[0].stat().st_size if packages else 0
    for path in packages[1:]:  # the newest stays, whatever its size
        total += path.stat().st_size
        if total > limit * 2**30:
            path.unlink(missing_ok=True)


def default_backend(device: torch.device) -> str:
    """AOTInductor packages on the CPU (cached on disk, same speed); `torch.compile` with CUDA graphs on CUDA."""
    return "aoti" if device.type == "cpu" else "torch.compile"


def default_options(device: torch.device, model: nn.Module | None = None) -> dict:
    """The compile options used unless asked otherwise: on the CPU the measured-fastest inductor options (with int8
    weights, inductor's C++ GEMM template only: `INT8_CPU_OPTIONS`), on CUDA CUDA graphs through
    `mode="reduce-overhead"` and coordinate-descent tuning."""
    if device.type == "cuda":
        # coordinate_descent_tuning (as gpt-fast sets it): inductor turns a one-row matmul into a fused multiply and
        # sum, so an int8 weight's cast to the activation dtype fuses into the same kernel (without it inductor may
        # pick ATen's fp32 int8 kernel: 429 us against 90 us for the fused form at [14336, 4096] on an H100).
        # split_reductions off: on CUDA inductor splits the softmax over the key width, and a split needs that width
        # as a constant (torch 2.11 on an H100 specialized it to 128 and refused the dynamic width).
        return {"mode": "reduce-overhead", "coordinate_descent_tuning": True, "split_reductions": False}
    options = dict(CPU_OPTIONS)
    schemes = {getattr(module, "scheme", None) for module in model.modules()} if model is not None else set()
    int8 = "int8" in schemes
    if int8:
        options.update(INT8_CPU_OPTIONS)
    # Our kernels, used where they run (`CompiledDecoder.row_kernel_off`: why not): attention over a paged pool, bf16
    # or fp32 (the bundled model's fp32 int4 x int8 step on the 2-core AVX2 Zen 1 host after a 277-token prompt: 9.3
    # ms against 12.1 with the attention inductor compiles; 8 such sequences 43.9 against 57.1 ms); bf16 projections;
    # int8 projections of bf16 activations (an fp32 model's too, where `QuantLinear` computes in bf16) on the CPUs
    # where that form measured faster (`row_kernel.int8_form`), and int4 ones where the CPU has BF16 dot products and
    # the loop measured no slower than ATen's int4 kernel (`row_kernel.int4_form`).
    options["attention_kernel"] = True
    if (model is not None and model.embed_tokens.weight.dtype == torch.bfloat16) or int8 or "int4" in schemes:
        options["row_kernel"] = True
    return options


def describe_options(device: torch.device, options: dict, backend: str) -> str:
    words = [name.replace("_", "-") if value is True else f"{name}={value}" for name, value in options.items()]
    name = "AOTInductor" if backend == "aoti" else "inductor"
    return f"{name} on {device.type}" + (f" ({', '.join(words)})" if words else "")
