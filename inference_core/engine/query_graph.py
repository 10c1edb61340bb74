"""The compiled step for several new tokens per sequence: a speculative chain's verification (the last token and its
k drafts), and a step whose hidden states a trained draft head reads (one token, the hidden states returned too).

`compiled.DecodeGraph` forwards one token per sequence; this graph forwards T per sequence, each of the batch's B
sequences padded to the same T (its padding queries come after its real ones, so no real query sees them), and is
compiled by the same machinery (`compiled.CompiledDecoder`: AOTInductor packages on disk, one per batch bucket and
query bucket). As in the decode step, the KV pool is read and never written inside the graph:

- a sequence's cached keys (positions before its first new token) come from the pool through its block table
  (paged) or slot (contiguous), and `key_mask` [B, T, width] says which of them each query sees (the sliding window
  cuts them per query);
- the T new keys are scored apart, against `new_mask` [B, T, T] (causal for a chain; the tree's mask for a tree);
- the graph returns every query's fp32 logits and final-normed hidden state, and every layer's new k and v, which
  the decoder writes into the pool for the real queries after the call.

Attention over a bf16 or fp32 paged pool runs through our CPU kernel (`model.attention_kernel`, its queries op: each
cached key read once for all of a sequence's queries) where `our_attention` asks for it and it takes the layer;
otherwise it is written with matmuls in fp32 over the context cast once per layer, for inductor to compile. The eager
forward (`model.llama`) is the reference both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_core.config import int4_value_group
from inference_core.engine import triton_attention
from inference_core.model import attention_kernel, kv_kernel, mlp_kernel
from inference_core.model.llama import MLP, CausalLM

# The most new tokens a sequence forwards through the graph: the last token and the longest chain
# (spec.decoding.MAX_K drafts). Each count T up to it is a package of its own (`CompiledDecoder.run_queries` takes the
# smallest one loaded that holds a step, so a chain of k drafts and its shorter drafts share the package of k + 1).
MAX_QUERIES = 17


class QueryGraph(nn.Module):
    """T new tokens for each of B sequences whose earlier tokens are in the KV cache, as a pure function of its inputs
    (see the module docstring). `paged` selects how the pool is read."""

    def __init__(self, model: CausalLM, paged: bool, block_size: int, our_attention: bool = False):
        super().__init__()
        self.model = model
        self.paged = paged
        self.block_size = block_size
        # Our CPU ops where they take a layer: the attention (`model.attention_kernel`) and a bf16 model's MLP
        # activation (`model.mlp_kernel`, as the decode step's: a verification's logits are a decode step's).
        self.our_attention = our_attention
        self.group = int4_value_group(model.config.head_dim)  # an int4 pool's (`layer_pool`)

    def width_dims(self) -> dict[int, int]:
        """The dimension of each input that is the key width (dynamic in a package): the block table's (paged) and
        the key mask's."""
        return {2: 1, 3: 2} if self.paged else {3: 2}

    def forward(self, input_ids, positions, read_index, key_mask, new_mask, *pool):
        """input_ids, positions: [B, T]; read_index: contiguous [B] slots, paged [B, blocks] int32 block table;
        key_mask: [B, T, width] bool, True where query t attends cached key j; new_mask: [B, T, T] bool, True where
        query t attends new key u. pool: the cache's whole tensors (`layer_pool`). Returns fp32 logits [B * T,
        vocab], the final-normed hidden states [B * T, hidden] and the new k, v [layers, B * T, kv_heads, head_dim]."""
        batch, queries = input_ids.shape
        width = key_mask.shape[2]

        def attend(index, attn, q, k, v):  # q: [B * T, heads, d]; k, v: [B * T, kv_heads, d]
            q, k, v = (x.view(batch, queries, *x.shape[1:]) for x in (q, k, v))
            k_layer, v_layer = layer_pool(pool, index, self.group)
            if self.paged and self.our_attention and attention_kernel.takes(q[:, 0], k[:, 0], k_layer):
                return attention_kernel.attend_queries(q, k, v, k_layer, v_layer, read_index, key_mask, new_mask,
                                                       attn.scale)
            k_ctx, v_ctx = read_context(k_layer, v_layer, read_index, width, self.paged)
            return attend_queries(q, k, v, k_ctx, v_ctx, key_mask, new_mask, attn.scale)

        x, new_k, new_v = forward_layers(self.model, input_ids.reshape(-1), positions.reshape(-1), attend,
                                         activation=silu_mul if self.our_attention else None)
        hidden = self.model.norm.forward(x)
        return self.model.lm_head.forward(hidden).float(), hidden, new_k, new_v


class FlatGraph(nn.Module):
    """Any mix of sequences with any number of new tokens each (decodes, prefill chunks, a static batch's prompts),
    one after another in a flat batch of N tokens, over a paged pool: the step vLLM's V1 engine runs for every
    batch. Attention is our CPU op (`model.attention_kernel.attend_flat`): each token sees its sequence's cached keys
    through the block table and its new keys up to itself, within a sliding window given as an input. The token count
    and the block table's width are dynamic sizes of one package, so one package serves every step; the sequence
    rows are the engine's most (`CompiledDecoder.run_flat` leaves the unused ones empty). The LM head is left out: the
    caller applies it to the rows whose logits it reads (a prefill chunk reads one of its hundreds). The last layer
    computes its attention's output projection and its MLP only for the rows `keep` names (what llama.cpp's graphs
    do for the tokens whose output nobody reads): a 512-token prompt read for its last token's logits skips 1/30 of
    the bundled model's projections. A bf16 model's MLP activation is our op too (`model.mlp_kernel`)."""

    KEEP = 6  # the input `keep`, its length dynamic in a package

    def __init__(self, model: CausalLM):
        super().__init__()
        self.model = model
        self.group = int4_value_group(model.config.head_dim)  # an int4 pool's (`layer_pool`)

    def width_dims(self) -> dict[int, int]:
        """The block table's width (dynamic in a package)."""
        return {2: 1}

    def token_dims(self) -> dict[int, int]:
        """The token count's dimension of each input that has one (dynamic in a package)."""
        return {0: 0, 1: 0}

    def forward(self, input_ids, positions, table, starts, cached, window, keep, *pool):
        """input_ids, positions: [N]; table: [S, blocks] int32 block tables; starts: [S + 1] int32, sequence s's
        tokens at [starts[s], starts[s + 1]); cached: [S] int32, its keys in the pool before them; window: [2] int32,
        a sliding window's size (0: none) and the attention sinks beside it; keep: [K] int64, the rows whose hidden
        states are returned. pool: the cache's whole tensors (`layer_pool`). Returns the final-normed hidden states of
        those rows [K, hidden] and the new k, v [layers, N, kv_heads, head_dim]."""

        def attend(index, attn, q, k, v):
            k_layer, v_layer = layer_pool(pool, index, self.group)
            return attention_kernel.attend_flat(q, k, v, k_layer, v_layer, table, starts, cached, window, attn.scale)

        x, new_k, new_v = forward_layers(self.model, input_ids, positions, attend, keep, silu_mul)
        return self.model.norm.forward(x), new_k, new_v


class TritonFlatGraph(FlatGraph):
    """The flat step on CUDA (torch.compile; `FlatGraph` is the CPU's, exported by AOTInductor): its attention our
    Triton kernel (`flat_attention`), which also takes a draft tree's nodes among the tokens (a tree's verification,
    `ModelRunner.run_tree`), so it has one input more: `seen`."""

    SEEN = 7  # the input `seen`, its length the token count

    def forward(self, input_ids, positions, table, starts, cached, window, keep, seen, *pool):
        """`FlatGraph.forward`'s inputs, and seen: [N] int64, for a tree's node the bits of the new tokens of its
        sequence it sees (its ancestors and itself), 0 for every other token (it sees the ones before it). A node's
        position in `positions` is its depth's."""

        def attend(index, attn, q, k, v):
            k_layer, v_layer = layer_pool(pool, index, self.group)
            return flat_attention(q, k, v, k_layer, v_layer, table, starts, cached, window, attn.scale, positions, seen)

        x, new_k, new_v = forward_layers(self.model, input_ids, positions, attend, keep, silu_mul)
        return self.model.norm.forward(x), new_k, new_v


@torch.library.custom_op("inference_core::flat_attention", mutates_args=())
def flat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   table: torch.Tensor, starts: torch.Tensor, cached: torch.Tensor, window: torch.Tensor,
                   scale: float, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The flat step's attention on CUDA (`triton_attention.flat_attention`, the arguments and result of
    `model.attention_kernel.attend_flat` with a tree's `positions` and `seen`) as one op the compiler does not look
    into: the token count, which changes from step to step, then reaches no kernel inductor generates."""
    return triton_attention.flat_attention(q, k, v, k_pool, v_pool, table, starts, cached, window, scale, positions,
                                           seen)


@flat_attention.register_fake
def _flat_attention_shape(q, k, v, k_pool, v_pool, table, starts, cached, window, scale, positions, seen):
    return q.new_empty(q.shape, dtype=torch.float32)


def forward_layers(model: CausalLM, input_ids, positions, attend, keep=None, activation=None):
    """The decoder layers over a flat batch of tokens (`input_ids`, `positions`: [tokens]) with attention left to
    `attend(layer index, attention module, q, k, v)` (q [tokens, heads, d], k and v [tokens, kv_heads, d], already
    normed and rotated) -> [tokens, heads, d]: the part the compiled steps share. Returns the last layer's output
    [tokens, hidden] (before the final norm; with `keep`, an int64 tensor of rows, those rows' only, the last layer's
    projection after attention and MLP computed for them alone) and every layer's new k and v, [layers, tokens,
    kv_heads, d]. `activation(gate_up)`: the MLP's silu(gate) * up where given."""
    x = F.embedding(input_ids, model.embed_tokens.weight)
    cos_table, sin_table = model.rope_tables(x.dtype)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    new_k, new_v = [], []
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm.forward(x), cos, sin)
        new_k.append(k)
        new_v.append(v)
        out = attend(index, attn, q, k, v)
        if keep is not None and index == len(model.layers) - 1:
            x, out = x.index_select(0, keep), out.index_select(0, keep)
        x = x + attn.o_proj.forward(out.reshape(x.shape[0], attn.q_size).to(x.dtype))
        x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x), activation)
    return x, torch.stack(new_k), torch.stack(new_v)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation in the compiled CPU steps: our op where it takes the tensor (`model.mlp_kernel`: a bf16
    model's), else the eager forward's (`MLP.activate`)."""
    return mlp_kernel.silu_mul(gate_up) if mlp_kernel.takes(gate_up) else MLP.activate(gate_up)


def layer_pool(pool: tuple, index: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s keys and values as a compiled step's attention reads them, from the pool tensors the step takes:
    (k, v), the cache's whole pools ([layers, blocks, block, kv_heads, d] paged, [layers, slots, kv_heads, positions,
    d] contiguous), give that layer's; an int4 pool (`kv.int4`: codes, ranges, tail k, tail v, and the step's blocks
    and their tail blocks, `Int4Blocks.read_plan`) gives the step's blocks, each once, dequantized to the model dtype
    by our op (`model.kv_kernel`), [blocks read, block, kv_heads, d]: the step's block tables are renumbered to index
    them."""
    if len(pool) == 2:
        return pool[0][index], pool[1][index]
    codes, ranges, tail_k, tail_v, blocks, tails = pool
    return kv_kernel.read(codes[index], ranges[index], blocks, tails, tail_k[index], tail_v[index], group)


def read_context(k_pool, v_pool, read_index, width: int, paged: bool):
    """One layer's cached keys and values of each sequence, [B, kv_heads, width, d]: paged, the blocks of each row of
    the block table `read_index` ([blocks, block_size, kv_heads, d] pool); contiguous, the first `width` positions of
    each slot in `read_index` ([slots, kv_heads, max_seq_len, d] pool)."""
    if paged:
        return (k_pool[read_index].flatten(1, 2).transpose(1, 2), v_pool[read_index].flatten(1, 2).transpose(1, 2))
    return k_pool[:, :, :width].index_select(0, read_index), v_pool[:, :, :width].index_select(0, read_index)


def attend_queries(q, k, v, k_ctx, v_ctx, key_mask, new_mask, scale: float) -> torch.Tensor:
    """T queries per sequence against its cached keys and its T new keys, with grouped-query heads, in fp32.
    q: [B, T, heads, d]; k, v: [B, T, kv_heads, d]; k_ctx, v_ctx: [B, kv_heads, width, d]; key_mask: [B, T, width];
    new_mask: [B, T, T] (each query sees at least its own key). Returns [B, T, heads, d].

    A kv head's group of query heads and its T queries are one [group * T] block of rows, so each matmul reads the
    context as it is (cast to fp32 once), not a copy per query head."""
    batch, queries, kv_heads, head_dim = k.shape
    group = q.shape[2] // kv_heads
    rows = q.view(batch, queries, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).float()  # [B, kv, group, T, d]
    rows = rows.reshape(batch, kv_heads, group * queries, head_dim)
    k_new, v_new = k.transpose(1, 2).float(), v.transpose(1, 2).float()  # [B, kv_heads, T, d]
    cached = (rows @ k_ctx.float().transpose(-1, -2)) * scale  # [B, kv_heads, group * T, width]
    cached = cached.view(batch, kv_heads, group, queries, -1).masked_fill(~key_mask[:, None, None], float("-inf"))
    new = (rows @ k_new.transpose(-1, -2)) * scale  # [B, kv_heads, group * T, T]
    new = new.view(batch, kv_heads, group, queries, queries).masked_fill(~new_mask[:, None, None], float("-inf"))
    # One softmax over [cached keys, new keys], written out: no concatenation of the two, nor slice at the dynamic
    # width.
    top = torch.maximum(cached.amax(-1, keepdim=True), new.amax(-1, keepdim=True))  # finite: the own key is seen
    cached, new = torch.exp(cached - top), torch.exp(new - top)
    total = cached.sum(-1, keepdim=True) + new.sum(-1, keepdim=True)  # [B, kv_heads, group, T, 1]
    out = (cached.flatten(2, 3) @ v_ctx.float() + new.flatten(2, 3) @ v_new).view(batch, kv_heads, group, queries, -1)
    return (out / total).permute(0, 3, 1, 2, 4).reshape(batch, queries, -1, head_dim)
