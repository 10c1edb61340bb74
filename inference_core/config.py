"""Model and engine settings: `ModelConfig` (what a checkpoint's config.json says, normalized across the Llama family)
and `EngineConfig` (the switches a user flips: KV mode, block size, prefix cache, context length, device, dtype).

Both are checked when built, so a bad value fails here with a message that says what to change, never deep inside a
forward pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

# Hugging Face `architectures` entry -> our family member. Each differs from Llama only where noted.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # also SmolLM2
    "MistralForCausalLM": "mistral",  # Llama + an optional sliding window
    "Qwen2ForCausalLM": "qwen2",  # Llama + bias on q/k/v
    "Qwen3ForCausalLM": "qwen3",  # Llama + RMSNorm on q and k (per head) before RoPE
}
KV_MODES = ("none", "contiguous", "paged")
# auto: the model dtype; int8: per token and head scales (inference_core.kv.cache); int4: keys per channel and
# values per token in groups, the newest block in the model dtype (inference_core.kv.int4)
KV_DTYPES = ("auto", "int8", "int4")
INT4_KV_GROUP = 32  # an int4 KV cache's channels per value scale


def int4_value_group(head_dim: int) -> int:
    """Channels per value scale of an int4 KV cache: 32, or the whole head where 32 does not divide it."""
    return INT4_KV_GROUP if head_dim % INT4_KV_GROUP == 0 else head_dim
BATCHING_MODES = ("none", "static", "dynamic", "continuous")  # see inference_core.engine.scheduler
# How paged attention reads the pool: gather (a contiguous copy per step, the reference) or flex (FlexAttention through
# the block tables, no copy: inference_core.kv.flex). Gather is the default because it measured faster on this CPU and
# on an H100 (docs/benchmarks.md, "Paged attention: gather or FlexAttention").
ATTENTIONS = ("gather", "flex")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# How the command line words what a ConfigError tells the user to change, where that is not simply the flag named
# after the setting (`{spec_k}` reads --spec-k). Another surface (the playground's page, its API) passes its own words
# to `ConfigError.in_words` (`inference_core.settings.words`), so each names what to change in its own language.
CLI_WORDS = {"draft_model": "pass --draft-model",
             "longer_context": " (or raise --max-seq-len, up to the model's context)"}


class ConfigError(ValueError):
    """A setting or a checkpoint that we cannot run; the message says what to change.

    A message may name a setting as `{name}`: `str(error)` uses the command line's words (CLI_WORDS, else the flag
    --name), `error.in_words(words)` another surface's; a name missing from `words` falls back to the command
    line's."""

    def __init__(self, message: str):
        self.template = message
        super().__init__(self.in_words({}))

    def in_words(self, words: dict[str, str]) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: words.get(m[1], CLI_WORDS.get(m[1], "--" + m[1].replace("_", "-"))),
                      self.template)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None  # ("linear", factor) | ("llama3", factor, low, high, original_max)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None  # the checkpoint's own attention window (Mistral-style), None: full attention

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4 or 5 layout), refusing what we do not run."""
        if "auto_map" in hf:
            raise ConfigError(f"{source} needs trust_remote_code (it has an auto_map); this engine runs only its own "
                              f"code for {sorted(SUPPORTED_ARCHITECTURES)}. Choose a model of one of those types.")
        architectures = hf.get("architectures") or []
        names = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not names:
            raise ConfigError(f"unsupported architecture {architectures or hf.get('model_type')!r} in {source}; "
                              f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
        architecture = SUPPORTED_ARCHITECTURES[names[0]]
        if hf.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported.")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        max_positions = hf.get("max_position_embeddings", 2048)
        # Mistral-style sliding window: each token attends to itself and the window - 1 tokens before it.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", architecture == "mistral") else None
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            rope_scaling = None
        elif rope_type == "linear":
            rope_scaling = ("linear", float(rope["factor"]))
        elif rope_type == "llama3":
            rope_scaling = ("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                            float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        else:
            raise ConfigError(f"{source}: RoPE scaling type {rope_type!r} is not supported "
                              "(supported: default, linear, llama3).")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        config = cls(
            architecture=architecture, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=max_positions, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=architecture == "qwen3", eos_token_ids=eos_ids, bos_token_id=hf.get("bos_token_id"),
            sliding_window=int(window) if window and window < max_positions else None)
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(f"{source}: {config.num_heads} attention heads do not divide into "
                              f"{config.num_kv_heads} KV heads.")
        return config

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_dtype: str = "auto", block_size: int = 16) -> int:
        """Bytes of K and V that one token occupies across all layers: head_dim values in the model dtype per layer
        and KV head; with an int8 KV cache head_dim int8 values and one fp32 scale; with an int4 one (`kv.int4`) K
        and V's head_dim 4-bit codes each, the fp16 minimum and scale of each key channel over a block of
        `block_size` tokens, and those of each value group of the token (a full-precision last block per sequence
        aside)."""
        d, heads = self.head_dim, self.num_layers * self.num_kv_heads
        if kv_dtype == "int4":
            return math.ceil(heads * (d + 4 * d / block_size + 4 * (d // int4_value_group(d))))
        per_head = d + 4 if kv_dtype == "int8" else d * torch.finfo(dtype).bits // 8
        return 2 * heads * per_head


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        name = str(name)
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use one of: float32, bfloat16, float16.")
    return DTYPES[name]


def parse_device(name: str | torch.device | None) -> torch.device:
    """'auto' (or None) picks CUDA when present, else the CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto.") from error
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported; use cpu, cuda, cuda:N or auto.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but CUDA is not available here; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s).")
    return device


MAX_DECODE_STEPS = 16


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The switches of one engine. Two engines (two race lanes) may share one loaded model with different configs."""

    kv_mode: str = "paged"
    block_size: int = 16
    prefix_cache: bool = True
    max_seq_len: int | None = None  # None: the model's context, capped at 8192 tokens
    kv_cache_tokens: int | None = None  # paged pool size in tokens; None: room for one max_seq_len sequence
    # Batching (see inference_core.engine.scheduler): how requests share steps, and the limits of one step.
    batching: str = "continuous"
    max_num_seqs: int = 8  # sequences in one step (contiguous: also the number of cache slots)
    max_num_batched_tokens: int = 2048  # tokens one step forwards, prefill chunks and decodes together
    chunked_prefill: bool = True  # split a long prompt into chunks that share steps with running decodes
    batch_window_ms: float = 50.0  # dynamic batching: how long the oldest waiting request waits for company
    # Continuous batching: while a batch runs, waiting requests join it at most every this many steps (1: at any
    # step). A step that takes a prompt runs eager; where decode steps replay a CUDA graph (several times cheaper),
    # joining in groups runs fewer such steps, as TGI's max_waiting_tokens does.
    join_every: int = 1
    compile: bool = False  # decode steps through torch.compile (inference_core.engine.compiled); needs a KV cache
    kv_dtype: str = "auto"  # KV cache storage: "auto" (the model dtype) or "int8" (see inference_core.kv.cache)
    sliding_window: int | None = None  # attend to the last N tokens only; None: the checkpoint's own window, if any
    # StreamingLLM's attention sinks: with a sliding window, every token also attends to its sequence's first S tokens
    attention_sinks: int = 0
    attention: str = "gather"  # paged attention: "gather" or "flex" (see ATTENTIONS)
    # Compiled decode: up to this many steps back to back per host round trip for greedy requests, each step's token
    # fed to the next on the device (Engine._burst_steps says when); 1: one step, then the host reads its token.
    decode_steps: int = 1
    # Compiled decode on an AVX-512 CPU: bf16 projections of up to 8 rows through our kernel (model.row_kernel);
    # False: the matmuls inductor picks (the reference).
    row_kernel: bool = True
    # Compiled decode on a CPU: attention over a bf16 or fp32 paged pool through our kernel
    # (model.attention_kernel); False: the attention inductor compiles (the reference).
    attention_kernel: bool = True
    # Greedy speculating requests draft only where their speculative steps measured faster than plain ones at the
    # batch's size (`spec.pays`); False: they draft every step (what spec-bench's --always measures).
    speculate_when_it_pays: bool = True

    def __post_init__(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ConfigError(f"unknown KV mode {self.kv_mode!r}; use one of: {', '.join(KV_MODES)}.")
        if not _positive_int(self.block_size):
            raise ConfigError(f"block size must be a positive integer, got {self.block_size!r}.")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be at least 2, got {self.max_seq_len}.")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                              f"of {self.block_size} tokens.")
        if self.batching not in BATCHING_MODES:
            raise ConfigError(f"unknown batching mode {self.batching!r}; use one of: {', '.join(BATCHING_MODES)}.")
        if not _positive_int(self.max_num_seqs):
            raise ConfigError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}.")
        if not _positive_int(self.max_num_batched_tokens):
            raise ConfigError(f"max_num_batched_tokens must be a positive integer, got "
                              f"{self.max_num_batched_tokens!r}.")
        if self.compile and self.kv_mode == "none":
            raise ConfigError("compiled decode needs a KV cache (contiguous or paged): KV mode none recomputes the "
                              "whole text every step, which is a prefill, not a decode step.")
        if not _positive_int(self.decode_steps) or self.decode_steps > MAX_DECODE_STEPS:
            raise ConfigError(f"{{decode_steps}} must be a whole number from 1 to {MAX_DECODE_STEPS}, got "
                              f"{self.decode_steps!r}.")
        if self.decode_steps > 1 and not self.compile:
            raise ConfigError("{decode_steps} above 1 run through the compiled decode step: turn on {compile}, or "
                              "set {decode_steps} to 1.")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"unknown KV dtype {self.kv_dtype!r}; use one of: {', '.join(KV_DTYPES)}.")
        if self.kv_dtype != "auto" and self.kv_mode == "none":
            raise ConfigError(f"an {self.kv_dtype} KV cache needs a KV cache (contiguous or paged); KV mode none "
                              "keeps nothing.")
        if self.kv_dtype == "int8" and self.compile:
            raise ConfigError("compiled decode reads the KV cache in the model dtype or int4; an int8 KV cache runs "
                              "eager only (turn one of them off, or choose int4).")
        if self.kv_dtype == "int4" and self.compile and self.kv_mode != "paged":
            raise ConfigError("the compiled steps read an int4 KV cache over a paged KV cache only: set {kv_mode} to "
                              "paged, or turn {compile} off.")
        if self.sliding_window is not None and not _positive_int(self.sliding_window):
            raise ConfigError(f"the sliding window must be a positive number of tokens, got {self.sliding_window!r}.")
        if isinstance(self.attention_sinks, bool) or not isinstance(self.attention_sinks, int) \
                or self.attention_sinks < 0:
            raise ConfigError(f"attention sinks must be 0 or a positive number of tokens, got "
                              f"{self.attention_sinks!r}.")
        if self.attention_sinks and self.attention == "flex":
            raise ConfigError("flex attention's block masks know sliding windows but not attention sinks: set "
                              "{attention} to gather or {attention_sinks} to 0.")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"unknown attention {self.attention!r}; use one of: {', '.join(ATTENTIONS)}.")
        if self.attention == "flex" and self.kv_mode != "paged":
            raise ConfigError("flex attention reads the paged KV pool through its block tables; it needs the paged "
                              "cache: set {kv_mode} to paged or {attention} to gather.")
        if self.attention == "flex" and self.kv_dtype != "auto":
            raise ConfigError(f"flex attention reads the pool in the model dtype; an {self.kv_dtype} KV cache is "
                              "dequantized on a gathered copy: set {attention} to gather or {kv_dtype} to auto.")
        if not _positive_int(self.join_every):
            raise ConfigError(f"join_every must be a positive whole number of steps, got {self.join_every!r}.")
        if not self.batch_window_ms >= 0:
            raise ConfigError(f"batch_window_ms must be 0 or more, got {self.batch_window_ms!r}.")

    def context_length(self, model: ModelConfig) -> int:
        if self.max_seq_len is None:
            return min(model.max_position_embeddings, 8192)
        if self.max_seq_len > model.max_position_embeddings:
            raise ConfigError(f"max_seq_len {self.max_seq_len} exceeds the model's context of "
                              f"{model.max_position_embeddings} tokens.")
        return self.max_seq_len

    def attention_window(self, model: ModelConfig) -> int | None:
        """The tokens each token attends to (itself included): this engine's window, else the checkpoint's; None when
        the window covers the whole context (full attention)."""
        window = self.sliding_window or model.sliding_window
        return window if window and window < self.context_length(model) else None

    def sink_tokens(self, model: ModelConfig) -> int:
        """The attention sinks beside the window (0: none); a ConfigError where sinks are asked for without one."""
        if self.attention_sinks and self.attention_window(model) is None:
            raise ConfigError("attention sinks keep a sequence's first tokens beside a sliding window: set "
                              "{sliding_window} to fewer tokens than the context, or {attention_sinks} to 0.")
        return self.attention_sinks

    def num_kv_blocks(self, model: ModelConfig) -> int:
        tokens = self.kv_cache_tokens or self.context_length(model)
        return math.ceil(tokens / self.block_size)


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1
