"""Our own decoder-only forward for the Llama family: Llama/SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head
RMSNorm on q and k before RoPE), all with grouped-query attention.

The model owns the weights and the arithmetic, nothing else. It takes a flat batch of tokens from one or more
sequences (`input_ids` and `positions`, both [num_tokens]) plus a `ForwardBatch` that says which tokens belong to
which sequence and where each sequence's KV lives; the KV cache object is passed in (`inference_core.kv.cache`;
mode `none` is a cache that keeps nothing).
Numerics follow Hugging Face transformers step for step (fp32 RMSNorm, fp32 RoPE tables cast to the model dtype,
SDPA), because transformers is our correctness oracle. q/k/v and gate/up projections are fused into one matrix each
(fewer, larger matmuls: on a CPU the per-op overhead, not the arithmetic, decides small-model decode speed). For
the same reason submodules are called through `.forward` inside the model: we register no hooks, and
`nn.Module.__call__`'s hook plumbing measured about 2 ms of a 35 ms CPU decode step across ~270 calls.

The forward marks its parts (projections, attention, norms, RoPE, KV writes) with `profile_range`s, which exist
only while the torch profiler records (`python -m inference_core profile` attributes each op's time by them).
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _RecordFunctionFast
from torch.autograd import profiler as autograd_profiler
from torch.nn.attention import SDPBackend, sdpa_kernel

from inference_core.config import ModelConfig
from inference_core.model import row_kernel


_NO_RANGE = contextlib.nullcontext()


# SDPA's backends on CUDA, cuDNN's left out. For bf16 on a Hopper GPU SDPA tries cuDNN first, and cuDNN builds a graph
# for every new shape: on an H100 host 1.3 ms of host time a call, 37 ms of a 53 ms eager decode step of 57 sequences,
# whose padded key width changes from step to step (docs/benchmarks.md, "The fourth H100 run"). The others need no
# such build; with a mask and grouped-query heads it is the math backend.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device):
    """The context an eager forward's SDPA calls run in: on CUDA, `CUDA_SDPA_BACKENDS` alone; elsewhere SDPA's own
    choice (a shared no-op context)."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else _NO_RANGE


def profile_range(name: str):
    """A range named `name` on the torch profiler's timeline while it records (`inference_core.bench.profile` reads
    the ranges to attribute each op's time to a part of the step), else a shared no-op context. A `record_function`
    costs about 9 us to open and close even when nothing records, and an eager step opens 9 ranges per layer (274 in
    a bundled-model decode step); this check and the no-op cost 0.26 us a range, 0.07 ms of a 39 ms fp32 step. Never
    inside a compiled or exported graph (the compiler sees the no-op). While recording, the range is torch's C++
    `_RecordFunctionFast` (0.2 us against `record_function`'s 9), so the ranges add little to the step they
    measure."""
    if not torch.compiler.is_compiling() and autograd_profiler._is_profiler_enabled:
        return _RecordFunctionFast(name)
    return _NO_RANGE


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored as [out, in] (`F.linear`, the reference layout) and applied in one of three
    ways, picked per dtype and device by the loader (see `weight_layout`):

    - 'out_in': `F.linear` on the [out, in] weight.
    - 'in_out' (`use_in_out_layout`): the weight transposed to [in, out], applied as `x @ W`. On x86 CPUs in fp32
      it streams the weights about 1.4x faster through a one-row matmul (decode); in bf16/fp16 it is far slower.
    - 'packed' (`use_packed_layout`, bf16 on a CPU with oneDNN): the weight also reordered once into oneDNN's
      blocked layout and applied by oneDNN's linear, which otherwise reorders it on every call. The bundled model's
      projections for one decode step, weights streamed from memory on a 2-core AVX-512 BF16 host: 25.0 ms through
      `F.linear`, 12.5 ms packed (6 rows: 29.9 against 11.6 ms). The [out, in] weight stays for what reads it
      (quantization, `torch.compile`, which packs weights itself, the draft heads' scoring rows), so this layout
      holds each projection twice."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.in_out = False
        self.out_in_rows: torch.Tensor | None = None  # in_out only: the same weight as [out, in], where kept
        self.packed: torch.Tensor | None = None  # packed only: the weight in oneDNN's blocked layout
        self.rows_packed: torch.Tensor | None = None  # beside any layout: our projection op's (`use_row_kernel`)
        self.rows_most = 0  # the most rows of x that go through it (0: none)

    @property
    def layout(self) -> str:
        """The layout this layer applies its weight in: 'out_in', 'in_out' or 'packed'."""
        return "in_out" if self.in_out else "packed" if self.packed is not None else "out_in"

    def use_in_out_layout(self, keep_out_in: bool = False) -> None:
        """Store the weight as [in, out]. `keep_out_in` keeps the [out, in] tensor too, for several-row inputs (free
        where it is shared, as a tied LM head's embedding is)."""
        if keep_out_in:
            self.out_in_rows = self.weight.detach()
        self.weight = nn.Parameter(self.weight.detach().t().contiguous(), requires_grad=False)
        self.in_out = True

    def use_packed_layout(self) -> None:
        """Apply the weight through oneDNN, reordered once (for one-row inputs; several rows run as fast)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def use_row_kernel(self) -> None:
        """Also keep the weight in our projection op's layout (`row_kernel.pack_for_op`; call where
        `row_kernel.unavailable()` is None), which eager inputs of at most `max_rows` bf16 rows then take: a draft
        layer's steps, which oneDNN ran at about a quarter of the rate memory gives."""
        if not self.in_out:
            self.rows_packed = row_kernel.pack_for_op(self.weight.detach())
            self.rows_most = row_kernel.max_rows(self.weight.shape[1])

    def use_layout(self, layout: str, keep_out_in: bool = False) -> None:
        """Switch from the reference layout to `layout` ('out_in' stays as it is); `keep_out_in`: see
        `use_in_out_layout`."""
        if layout == "packed":
            self.use_packed_layout()
        elif layout == "in_out":
            self.use_in_out_layout(keep_out_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.in_out and row_kernel.takes(x, self.weight):  # exporting a compiled decode step (row_kernel)
            return row_kernel.linear(x, self.weight, self.bias)
        if (x.dim() == 2 and x.shape[0] <= self.rows_most and x.dtype == torch.bfloat16
                and not torch.compiler.is_compiling()):
            out = torch.ops.inference_core.linear_rows(x, self.rows_packed, self.weight.shape[0])
            return out if self.bias is None else out + self.bias
        if self.packed is not None and not torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if not self.in_out:
            return F.linear(x, self.weight, self.bias)
        if self.out_in_rows is not None and self.bias is None and x.shape[0] > 1:
            # Several rows: x @ W[in, out] runs about one pass over the weights per row here (49152 x 576, AVX-512,
            # 2 threads: 19.0 ms for 4 rows, 4.7 ms for one), while W[out, in] @ x^T takes 4.0 ms for all 4.
            return (self.out_in_rows @ x.t()).t()
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


WEIGHT_LAYOUTS = ("out_in", "in_out", "packed")


def weight_layout(device: torch.device, dtype: torch.dtype) -> str:
    """'in_out' for fp32 on the CPU, 'packed' for bf16 on a CPU with native bf16 math and oneDNN (both measured
    faster, see `Linear`), else 'out_in' (the reference layout)."""
    if device.type != "cpu":
        return "out_in"
    if dtype == torch.float32:
        return "in_out"
    return "packed" if dtype == torch.bfloat16 and packed_bf16_available() else "out_in"


def packed_bf16_available() -> bool:
    """Whether bf16 weights can run packed through oneDNN here: a CPU with native bf16 math and oneDNN's bf16."""
    return bool(native_bf16_math()) and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA runs in. CPUs without native bf16/fp16 math run SDPA in those dtypes several times slower than
    in fp32 (measured, one query against 400 cached tokens: 299 us in bf16, 82 us upcast to fp32), so on the CPU we
    attend in fp32; the KV cache itself stays in the model dtype. GPUs attend in the model dtype."""
    return torch.float32 if device.type == "cpu" else dtype


def native_bf16_math() -> list[str]:
    """This CPU's features that do bf16 dot products natively (without them bf16 matmuls are emulated, slower than
    fp32): the ones `dtype_choice.choose_dtype` and `decode_attention_kernel` look for."""
    return [name for name, check in (("AVX-512 BF16", torch.cpu._is_avx512_bf16_supported),
                                     ("AMX", torch.cpu._is_amx_tile_supported)) if check()]


def decode_attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """How a step's batched single-token decodes attend: 'matmul' (bf16 on a CPU with AVX-512 BF16: scores and
    values through bf16 matmuls, softmax in fp32, the order of transformers' eager attention) or 'sdpa'. Measured on
    a 2-core AVX-512 BF16 host, 121 decodes x 9 heads over 230 keys: 1.6-1.9 ms against 5.7-7.5 ms for SDPA on the
    upcast fp32 copies. CPUs without native bf16 dot products keep SDPA."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "sdpa"
    return "matmul" if native_bf16_math() else "sdpa"


def attend_decodes_matmul(q, k, v, mask, scale: float) -> torch.Tensor:
    """Single-token queries q [batch, heads, 1, head_dim] over k, v [batch, kv_heads, keys, head_dim] in the model
    dtype, with a key mask [batch, 1, 1, keys]: q k^T in the model dtype, scaled, softmax in fp32, then p v."""
    batch, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(batch, kv_heads, heads // kv_heads, head_dim), k.transpose(-1, -2))
    scores = (scores * scale).float().masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, heads, 1, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm normalizes in fp32, casts, then scales. The fused kernel gives bit-identical
        # results in fp32 (one op instead of eight); in bf16/fp16 we keep the cast before the scale, as it does.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with linear or Llama-3 scaling when the checkpoint asks for it."""
    dim = config.head_dim
    # An explicit CPU tensor even when the model is built on the meta device (meta math imports torch._dynamo).
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling and scaling[0] == "linear":
        inv_freq = inv_freq / scaling[1]
    elif scaling and scaling[0] == "llama3":
        _, factor, low_freq_factor, high_freq_factor, original_max = scaling
        low_freq_wavelen = original_max / low_freq_factor
        high_freq_wavelen = original_max / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.attention_dtype = torch.float32  # set per device and dtype by CausalLM.configure_kernels
        self.decode_kernel = "sdpa"  # likewise
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `x` [tokens, hidden], q and k normed (Qwen3) and rotated: q [tokens, heads, head_dim], k and v
        [tokens, kv_heads, head_dim]; cos, sin: [tokens, 1, head_dim]. Shared by the eager and the compiled step."""
        num_tokens = x.shape[0]
        with profile_range("ic::projection"):
            qkv = self.qkv_proj.forward(x)
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        with profile_range("ic::norm_rope"):
            if self.q_norm is not None:
                q, k = apply_rope(self.q_norm.forward(q), cos, sin), apply_rope(self.k_norm.forward(k), cos, sin)
            else:  # q and k are adjacent in qkv: rotate both in one pass
                qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
                q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return q, k, v

    def forward(self, x, cos, sin, batch, kv_cache) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        with profile_range("ic::kv_write"):
            kv_cache.store(self.layer_index, k, v, batch)
        with profile_range("ic::attention"):
            attended = self._attend_batch(q, batch, kv_cache).to(x.dtype)
        with profile_range("ic::projection"):
            return self.o_proj.forward(attended)

    def _attend_batch(self, q, batch, kv_cache) -> torch.Tensor:
        """q [tokens, heads, head_dim] against each sequence's keys (the stored ones and the new) -> [tokens,
        heads * head_dim] in the attention dtype."""
        if batch.flex is not None:  # the paged pool read in place through the block tables
            return self._attend_flex(q, batch, kv_cache)
        outputs = []
        num_decodes = batch.num_decodes
        first = 0
        if num_decodes > 1:
            # All single-token decodes at once: their contexts gathered into one padded buffer, masked by length.
            k_d, v_d = kv_cache.load_decodes(self.layer_index, batch)  # [decodes, kv_heads, longest, head_dim]
            q_d = q[:num_decodes].unsqueeze(2)  # [decodes, heads, 1, head_dim]
            if self.decode_kernel == "matmul":
                out = attend_decodes_matmul(q_d, k_d, v_d, batch.decode_mask, self.scale)
            else:
                out = self._attend(q_d, k_d, v_d, batch.decode_mask, False)
            outputs.append(out.reshape(num_decodes, self.q_size))
            first = num_decodes
        chunks = batch.chunks
        if chunks is not None:  # the prefill chunks (and a lone decode) in one padded call
            most = chunks.query_index.shape[0] // chunks.count
            q_c = q.index_select(0, chunks.query_index).view(chunks.count, most, self.num_heads, self.head_dim)
            k_c, v_c = kv_cache.load_chunks(self.layer_index, batch)  # [chunks, kv_heads, longest, head_dim]
            out = self._attend(q_c.transpose(1, 2), k_c, v_c, chunks.mask, False)  # [chunks, heads, most, d]
            outputs.append(out.transpose(1, 2).reshape(-1, self.q_size).index_select(0, chunks.rows))
            first = len(batch.query_ranges)
        for i in range(first, len(batch.query_ranges)):  # prefill chunks (and a lone decode), one at a time
            start, end = batch.query_ranges[i]
            q_i = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, new_tokens, head_dim]
            k_i, v_i = kv_cache.load(self.layer_index, i, batch)  # [kv_heads, context, head_dim]
            out = self._attend(q_i, k_i.unsqueeze(0), v_i.unsqueeze(0), batch.attention_masks[i], batch.is_causal[i])
            outputs.append(out[0].transpose(0, 1).reshape(end - start, self.q_size))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend_flex(self, q, batch, kv_cache) -> torch.Tensor:
        """FlexAttention over the paged pool (`kv.flex`), in the pool's dtype: the decodes in one call, then each other
        sequence in its own; q: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        calls, outputs = batch.flex, []
        if calls.decodes is not None:
            num_decodes = calls.decodes.rows
            out = kv_cache.attend(self.layer_index, calls.decodes, q[:num_decodes].unsqueeze(2), self.scale)
            outputs.append(out.reshape(num_decodes, self.q_size))  # out: [decodes, heads, 1, head_dim]
        ranges = batch.query_ranges[len(batch.query_ranges) - len(calls.chunks):]
        for call, (start, end) in zip(calls.chunks, ranges):
            q_i = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, new_tokens, head_dim]
            out = kv_cache.attend(self.layer_index, call, q_i, self.scale)
            outputs.append(out[0].transpose(0, 1).reshape(end - start, self.q_size))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        """SDPA in the attention dtype; q: [batch, heads, queries, head_dim], k and v: [batch, kv_heads, keys,
        head_dim]."""
        if q.dtype != self.attention_dtype:
            q, k, v = q.to(self.attention_dtype), k.to(self.attention_dtype), v.to(self.attention_dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (the Hugging Face layout): [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
    With signed_sin = [-sin, sin] each half is one product plus another: the same products and sums as
    transformers' rotate_half form. Written by halves, not as x cos + roll(x) signed_sin (the same numbers), because
    inductor's CPU code for the roll indexes each element on its own: a 512-token prompt's rotation took 2.5x as
    long."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos[..., :half] + x2 * signed_sin[..., :half],
                      x2 * cos[..., half:] + x1 * signed_sin[..., half:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, activation=None) -> torch.Tensor:
        """silu(gate) * up of x's projections, projected down; `activation(gate_up)` computes silu(gate) * up where
        given (the flat step's: `engine.query_graph.silu_mul`), else `activate`."""
        with profile_range("ic::projection"):
            gate_up = self.gate_up_proj.forward(x)
        activated = (activation or MLP.activate)(gate_up)
        with profile_range("ic::projection"):
            return self.down_proj.forward(activated)

    @staticmethod
    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the gate-and-up projection's output [rows, 2 * features]: the reference."""
        half = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, batch, kv_cache):
        with profile_range("ic::norm_rope"):
            normed = self.input_layernorm.forward(x)
        x = x + self.self_attn.forward(normed, cos, sin, batch, kv_cache)
        with profile_range("ic::norm_rope"):
            normed = self.post_attention_layernorm.forward(x)
        return x + self.mlp.forward(normed)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head. `forward` returns logits for the tokens that need them."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # A bare parameter, not nn.Embedding: its random init would run (and on the meta device import torch._dynamo,
        # ~2 s of start-up) only to be overwritten by the checkpoint.
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size),
                                                requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.requires_grad_(False)
        # RoPE angles for every position, computed once in fp32 like transformers does per step.
        self.register_buffer("rope_inv_freq", rope_inverse_frequencies(config), persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def configure_kernels(self, device: torch.device, dtype: torch.dtype, layout: str = "auto") -> None:
        """Pick the measured-faster kernels for this device and dtype (see `weight_layout`, `attention_dtype`,
        `decode_attention_kernel`)."""
        self.use_weight_layout(weight_layout(device, dtype) if layout == "auto" else layout)
        for layer in self.layers:
            layer.self_attn.attention_dtype = attention_dtype(device, dtype)
            layer.self_attn.decode_kernel = decode_attention_kernel(device, dtype)

    def use_weight_layout(self, layout: str) -> None:
        """Switch every projection (and the LM head) to `layout`: 'out_in' (reference), 'in_out' or 'packed'."""
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"unknown weight layout {layout!r}; use one of {WEIGHT_LAYOUTS}.")
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        current = next((m.layout for m in linears if m.layout != "out_in"), "out_in")
        if current == layout:
            return
        if current != "out_in":
            raise ValueError(f"weights are already in the {current} layout; reload the model to switch.")
        for module in linears:
            # A tied LM head keeps the embedding as its [out, in] form for several-row inputs (no extra memory).
            module.use_layout(layout, keep_out_in=module is self.lm_head and module.weight is self.embed_tokens.weight)

    def rope_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([-sin, sin]) tables [max_positions, head_dim] in the model dtype, built once per device
        and dtype."""
        cached = self._rope_cache
        if cached is None or cached[0].dtype != dtype or cached[0].device != self.rope_inv_freq.device:
            positions = torch.arange(self.config.max_position_embeddings, device=self.rope_inv_freq.device)
            freqs = positions.float()[:, None] * self.rope_inv_freq.float()[None, :]
            cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
            self._rope_cache = cached = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        return cached

    def forward(self, batch, kv_cache, num_layers: int | None = None, return_hidden: bool = False,
                layer_states: list | None = None):
        """batch.input_ids, batch.positions: [tokens]. Returns fp32 logits [len(batch.logits_indices), vocab].
        `num_layers` < the model's runs only the first layers before the final norm and LM head (an early-exit
        draft; only those layers' KV is written). With `return_hidden`, returns (logits, hidden): hidden is every
        token's final-normed hidden state [tokens, hidden_size] (what the LM head reads; trained draft heads read it
        too). A `layer_states` list receives every layer's output [tokens, hidden_size], before the final norm (the
        logit lens reads them)."""
        with profile_range("ic::forward"), attention_backends(batch.input_ids.device):
            x = F.embedding(batch.input_ids, self.embed_tokens.weight)
            cos_table, sin_table = self.rope_tables(x.dtype)
            cos, sin = cos_table[batch.positions].unsqueeze(1), sin_table[batch.positions].unsqueeze(1)
            for layer in self.layers[:num_layers]:
                x = layer.forward(x, cos, sin, batch, kv_cache)
                if layer_states is not None:
                    layer_states.append(x)
            with profile_range("ic::norm_rope"):
                # Only the last token of each sequence needs logits: the LM head is a decode step's largest matmul.
                hidden = self.norm.forward(x if return_hidden else x[batch.logits_indices])
            with profile_range("ic::projection"):
                logits = self.lm_head.forward(hidden[batch.logits_indices] if return_hidden else hidden).float()
            return (logits, hidden) if return_hidden else logits


def model_fingerprint(model: CausalLM) -> str:
    """A hash of the model's config and every weight's bytes (about 0.7 s for 600 MiB). Kept on the model while no
    weight is replaced or changed in place (each tensor's storage and version counter say so)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    signature = tuple((name, tensor.data_ptr(), tensor._version, tensor.dtype, tuple(tensor.shape))
                      for name, tensor in tensors)
    cached = getattr(model, "_fingerprint", None)
    if cached is None or cached[0] != signature:
        digest = hashlib.blake2b(repr(model.config).encode(), digest_size=12)
        digest.update(repr(model).encode())  # the modules and how each computes (a quantized layer's activations)
        for name, tensor in tensors:
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
        cached = model._fingerprint = (signature, digest.hexdigest())
    return cached[1]
