"""Trained draft heads: small networks on the target model's last hidden state that guess its next tokens, trained here
on the model's own answers (`python -m inference_core train-draft`, `inference_core.training.train_draft`) and used as
speculative draft sources `medusa` and `eagle`. The target model stays frozen and verifies every draft, so the output is
the target's whatever the heads guess; better heads only mean more accepted drafts.

Both read the target's final-normed hidden state f_t at position t (the vector its LM head turns into the logits of
token t+1) and score tokens through the target's own LM head rows, restricted to a draft vocabulary: the most
frequent tokens of the training answers (a few thousand of the model's 49k; FR-Spec and EAGLE-3 do the same). On
the bundled model the full LM head is a fifth of the weights, so scoring every token would cost a draft step a
fifth of a whole forward; the restricted head reads a sixth of its rows. A draft outside that vocabulary is never
proposed, and under sampling its draft probability is 0, which the acceptance rule handles exactly.

- `medusa` (Medusa, Cai et al. 2024): K heads, each a residual block f + SiLU(W_i f + b_i), where head i predicts the
  token i+1 places after the one the target just predicted. All K drafts come from one hidden state in one batched
  matmul; the drafts do not see each other.
- `eagle` (EAGLE, Li et al. 2024): one decoder layer over the pairs (f_j, embedding of token j+1), fused by a linear
  layer, that predicts the next hidden state f_{j+1}; its own output and the drafted token feed the next draft step,
  k steps in all. It attends over the request's earlier positions through a small KV cache of its own, kept with
  the target's true hidden states and rolled back past each step's drafts.

Next to a model whose weights are quantized (`--quant`), the heads' projections and scoring rows are quantized the
same way when an engine loads them (`DraftHeads.quantize`).

Weights are safetensors files with their metadata (kind, model fingerprint, training note). `find_heads` looks for
a model's heads in the user cache (where `train-draft` writes) and in the package (the bundled model's, shipped in
`inference_core/data/draft_heads/`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from inference_core.config import ConfigError, ModelConfig
from inference_core.model import attention_kernel
from inference_core.model.bundled import BUNDLED_NAMES
from inference_core.model.llama import MLP, Attention, CausalLM, Linear, RMSNorm, attention_backends, weight_layout
from inference_core.model.paths import DATA_DIR, cache_root
from inference_core.quant.linear import (INT4_SCHEMES, QuantConfig, QuantLinear, compute_dtype,
                                        quantize_projections)
from inference_core.sampling import SamplingParams, sample_with_probabilities
from inference_core.sequence import Sequence
from inference_core.spec.decoding import TREE_GO_ON, TREE_KEEP

DRAFT_KINDS = ("medusa", "eagle")
SHIPPED = DATA_DIR / "draft_heads"
QUANT_ROWS = 8  # quantized scorer rows come in whole tiles of this many (`model.w4a8_kernel`'s)
# A compiled engine's EAGLE draft steps, by their tokens a sequence padded up to one of these (a catch-up after a
# verification of k drafts reads k + 1 positions at most; a longer one, after a prompt, runs eager), for each bucket
# of sequences stepped together (`EagleDraftPool`): one package each.
DRAFT_TOKENS = (1, 2, 4, 8)


def fingerprint(config: ModelConfig) -> str:
    """What a set of heads must match: the shapes of the hidden state and the vocabulary they read and score."""
    return (f"{config.architecture}:h{config.hidden_size}:l{config.num_layers}:v{config.vocab_size}:"
            f"heads{config.num_heads}/{config.num_kv_heads}")


def lm_head_rows(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows of token `ids`, [len(ids), hidden], in the model dtype (tied models read the
    embedding, which quantized weights leave in the model dtype)."""
    if model.config.tie_word_embeddings:
        return model.embed_tokens.weight[ids].detach()
    head = model.lm_head
    if hasattr(head, "in_out"):
        weight = head.weight.t() if head.in_out else head.weight
        return weight[ids].detach()
    # A quantized, untied LM head: read its rows back through the layer itself.
    eye = torch.eye(model.config.hidden_size, dtype=model.embed_tokens.weight.dtype,
                    device=model.embed_tokens.weight.device)
    return head.forward(eye).t()[ids].detach()


class MedusaHeads(nn.Module):
    """K residual blocks on the hidden state: head i maps f to f + SiLU(f W_i + b_i). W starts at zero, so every head
    starts as the target's own next-token prediction."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., num_heads, hidden]."""
        mixed = torch.einsum("...d,nde->...ne", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + F.silu(mixed)


class EagleLayer(nn.Module):
    """fc(cat(f_j, e(x_{j+1}))) -> one decoder layer (the target's layer shape, attention over earlier positions) ->
    RMSNorm, an estimate of f_{j+1}."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        nn.init.kaiming_uniform_(self.fc.weight, a=math.sqrt(5))  # nn.Linear's initialization
        bound = 1 / math.sqrt(2 * config.hidden_size)
        nn.init.uniform_(self.fc.bias, -bound, bound)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, 0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        for module in (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, features, embeddings, cos, sin, cache=None, start: int = 0,
                our_attention: bool = False) -> torch.Tensor:
        """features, embeddings: [batch, tokens, hidden]; cos, sin: [tokens, 1, head_dim] (the rotary tables at these
        tokens' positions). Training passes no cache: causal attention within each row. Drafting passes `cache`
        (keys, values [positions, kv_heads, head_dim]) for batch 1: these tokens' keys and values are written at
        `start`.. and the tokens attend to everything before them there, through our attention op where
        `our_attention` (`model.attention_kernel.attend_flat`, the cache read in place as one block: a 1-token draft
        step over 300 positions 0.03 against 0.19 ms in ATen's SDPA) and SDPA, the reference, otherwise. Returns
        [batch, tokens, hidden]."""
        x, q, k, v = self._project(features, embeddings, cos, sin)
        tokens = x.shape[1]
        if cache is None:
            return self._finish(x, self._sdpa(q, k.transpose(1, 2), v.transpose(1, 2), None, tokens > 1))
        cache_k, cache_v = cache
        cache_k[start:start + tokens] = k[0]
        cache_v[start:start + tokens] = v[0]
        if our_attention:
            return self.finish_over_cache(x, q, k, v, (cache_k[None], cache_v[None]),
                                          torch.zeros(1, 1, dtype=torch.int32),
                                          torch.tensor([0, tokens], dtype=torch.int32),
                                          torch.tensor([start], dtype=torch.int32))
        keys = cache_k[:start + tokens].transpose(0, 1).unsqueeze(0)
        values = cache_v[:start + tokens].transpose(0, 1).unsqueeze(0)
        mask = None if tokens == 1 else torch.ones(tokens, start + tokens, dtype=torch.bool,
                                                  device=x.device).tril(diagonal=start)
        return self._finish(x, self._sdpa(q, keys, values, mask, False))

    def finish_over_cache(self, x, q, k, v, pools, table, starts, cached) -> torch.Tensor:
        """The rest of the layer (`_finish`) for the tokens of S sequences one after another (batch 1) attending
        through our flat op (`attention_kernel.attend_flat`) to their own sequence's new keys and to its cached ones
        before them, each sequence's cache one block of `pools` (keys, values [blocks, positions, kv_heads,
        head_dim]) read in place (`table` int32 [S, 1]: its block; `starts` int32 [S + 1]: its tokens' rows;
        `cached` int32 [S]: its first token's position). The eager step's and the compiled step's
        (`EagleDraftStep`) attention."""
        attn = self.self_attn
        attended = attention_kernel.attend_flat(q[0], k[0], v[0], pools[0], pools[1], table, starts, cached, 0,
                                                attn.scale)
        return self._finish(x, attended.to(x.dtype).view(1, q.shape[1], attn.q_size))

    def _sdpa(self, q, keys, values, mask, causal: bool) -> torch.Tensor:
        """SDPA of q [batch, tokens, heads, head_dim] over keys, values [batch, kv_heads, keys, head_dim] ->
        [batch, tokens, heads * head_dim]."""
        attn = self.self_attn
        with attention_backends(q.device):  # no cuDNN on CUDA: the context grows every drafted token
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
                                                 scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], attn.q_size)

    def unrolled(self, features, embeddings, cos, sin, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): the layer run `steps` times over whole sequences [batch, tokens, hidden], each
        step the way a draft that many tokens ahead runs. Step 1 is `forward`: at position p it reads the target's
        hidden state f_p and the embedding of token p+1. Step s reads at p step s-1's output at p-1 (its estimate of
        f_p) with the same embedding, and attends as the drafter's cache lets it: to step 1's keys and values up to
        position p-s+1 (those the target's true hidden states gave) and to steps 2..s's own at p-s+2..p. Returns
        every step's outputs [batch, tokens, hidden]; step s's mean something from position s-1 on."""
        tokens = features.shape[1]
        positions = torch.arange(tokens, device=features.device)
        outputs, keys, values = [], [], []
        inputs = features
        for step in range(steps):
            if step:
                inputs = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))  # position p reads the last step's output at p-1
            x, q, k, v = self._project(inputs, embeddings, cos, sin)
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            # Over every step's keys so far: step 1's up to position p - (s - 1), step t's (t = 2..s) at p - (s - t).
            masks = [positions[None, :] <= positions[:, None] - step] + \
                [positions[None, :] == positions[:, None] - (step - t) for t in range(1, step + 1)]
            out = self._sdpa(q, torch.cat(keys, 2), torch.cat(values, 2), torch.cat(masks, 1), False)
            outputs.append(self._finish(x, out))
        return outputs

    def _project(self, features, embeddings, cos, sin):
        """The fused input x [batch, tokens, hidden] and its rotated q [batch, tokens, heads, head_dim], k and v
        [batch, tokens, kv_heads, head_dim]."""
        batch, tokens, hidden = features.shape
        x = self.fc(torch.cat((features, embeddings), -1).view(batch * tokens, 2 * hidden)).view(batch, tokens, hidden)
        attn = self.self_attn
        if batch > 1:
            cos, sin = cos.repeat(batch, 1, 1), sin.repeat(batch, 1, 1)
        q, k, v = attn.project(self.input_layernorm.forward(x).reshape(batch * tokens, hidden), cos, sin)
        q = q.view(batch, tokens, attn.num_heads, attn.head_dim)
        k = k.view(batch, tokens, attn.num_kv_heads, attn.head_dim)
        v = v.view(batch, tokens, attn.num_kv_heads, attn.head_dim)
        return x, q, k, v

    def _finish(self, x, attended) -> torch.Tensor:
        """The rest of the layer after attention (`attended` [batch, tokens, heads * head_dim]), then the norm."""
        batch, tokens, hidden = x.shape
        attn = self.self_attn
        x = x + attn.o_proj.forward(attended.reshape(batch * tokens, attn.q_size)).view(x.shape)
        x = x + self.mlp.forward(self.post_attention_layernorm.forward(x).reshape(batch * tokens, hidden)
                                 ).view(x.shape)
        return self.norm.forward(x)


class EagleDraftStep(nn.Module):
    """EAGLE's draft step as one graph for a compiled engine's package (`engine.compiled.CompiledDecoder.run_draft`,
    AOTInductor): the layer over the new positions of S sequences one after another (S padded to a batch bucket,
    their T tokens to S times one of `DRAFT_TOKENS`), each attending through our op to its own drafter's keys and
    values before them, a slot of the pool (`EagleDraftPool`), and the scoring of one row of each. The eager step ran
    about 30 ATen ops and six projections one by one from Python: on the bundled model, 1.4-1.7 ms a draft inside a
    request (the weights cold after the target's forward), 0.87 ms with them hot; a batch of speculating requests
    drafts in one call a step rather than one each. The pool is read, not written: the step returns the new keys and
    values, which the drafters store."""

    def __init__(self, heads: DraftHeads, model: CausalLM):
        super().__init__()
        self.layer = heads.network
        self.scorer = heads.scorer(model)
        self.vocab = len(heads.vocab_ids)
        cos, sin = rope_tables(model, heads.dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.identity = heads.identity()  # what the package's key adds to the model's

    def width_dims(self) -> dict[int, int]:
        return {}  # a package per bucket, the pool passed whole

    def slot_dims(self) -> dict[int, int]:
        """The pool's slots (dynamic in a package: one serves engines of any number of requests)."""
        return {3: 0, 4: 0}

    def forward(self, features, token_ids, index, pool_k, pool_v, embedding):
        """features [T, hidden]: the rows of S sequences one after another, f_j at each row's position j;
        token_ids [T]: token j+1 at each, whose embedding is looked up in `embedding` (the target's table [vocab,
        hidden], an input rather than a copy in the package); index int32 [T + 4S + 1]: each row's position, the
        sequences' row starts [S + 1], the position before which each reads its cached keys [S], its slot of the
        pool [S] and the one row of it that is scored [S]; pool_k, pool_v [slots, positions, kv_heads, head_dim].
        Returns (outputs [T, hidden], new keys and values [T, kv_heads, head_dim], fp32 scores of the scored rows
        [S, draft vocab]). The inputs are three small tensors the drafters build and the tensors they hold: the
        host's part of a draft was a dozen small ops, each slow right after the target's forward has cycled the
        caches."""
        tokens = features.shape[0]
        sequences = (index.shape[0] - tokens - 1) // 4
        ends = (tokens, tokens + sequences + 1, tokens + 2 * sequences + 1, tokens + 3 * sequences + 1)
        positions = index[:ends[0]].long().clamp(max=len(self.cos) - 1)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        embeddings = F.embedding(token_ids, embedding).to(features.dtype)
        x, q, k, v = self.layer._project(features[None], embeddings[None], cos, sin)
        out = self.layer.finish_over_cache(x, q, k, v, (pool_k, pool_v), index[ends[2]:ends[3]].view(sequences, 1),
                                           index[ends[0]:ends[1]], index[ends[1]:ends[2]])[0]
        rows = out.index_select(0, index[ends[3]:].long())
        return out, k[0], v[0], self.scorer(rows)[:, :self.vocab].float()

    def example(self, sequences: int, tokens: int, pool: EagleDraftPool) -> tuple:
        """Inputs of a step of `sequences` and `tokens` over `pool`, for building its package before a request."""
        hidden = self.cos.new_zeros(tokens, len(self.layer.norm.weight))
        index = [0] * tokens + [0] + [tokens] * sequences + [0] * 3 * sequences
        return (hidden, torch.zeros(tokens, dtype=torch.long), torch.tensor(index, dtype=torch.int32),
                pool.keys, pool.values, pool.embedding)


class EagleDraftPool:
    """A compiled engine's EAGLE drafting for all its requests: each drafter's keys and values in a slot of one pool
    (`keys`, `values` [slots, positions, kv_heads, head_dim]), and the draft step's packages (`EagleDraftStep`, run as
    `run(step, sequences, tokens, inputs)`), which step any of the pool's drafters at once: a step of the
    speculating requests of a batch is one call rather than one a request. `buckets`: the numbers of sequences a
    package steps (the engine's batch buckets)."""

    def __init__(self, heads: DraftHeads, model: CausalLM, positions: int, slots: int, buckets: list[int], run):
        attn = heads.network.self_attn
        positions = min(positions, len(model.rope_tables(model.embed_tokens.weight.dtype)[0]))
        shape = (slots, positions, attn.num_kv_heads, attn.head_dim)
        self.keys = torch.zeros(shape, device=heads.vocab_ids.device, dtype=heads.dtype)
        self.values = torch.zeros_like(self.keys)
        self.heads, self.buckets, self.run = heads, buckets, run
        self.graph = EagleDraftStep(heads, model)
        self.embedding = model.embed_tokens.weight
        self.free = list(range(slots - 1, -1, -1))

    @property
    def positions(self) -> int:
        return self.keys.shape[1]

    def take(self) -> int | None:
        """A free slot for a new drafter (None: every slot is held, and the drafter keeps a cache of its own)."""
        return self.free.pop() if self.free else None

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def warm_up(self, sequences: int) -> None:
        """Build (or load) the packages of a bucket of `sequences`, each of its token buckets."""
        for size in DRAFT_TOKENS:
            self.run(self.graph, sequences, sequences * size,
                     self.graph.example(sequences, sequences * size, self))

    def step(self, items: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One package call for `items`, each (drafter with a slot here, features [n, hidden] at positions start..,
        the n next token ids, start), n at most DRAFT_TOKENS[-1]: the sequences padded with empty ones to a bucket,
        their rows (after the last sequence's real ones) to a bucket of tokens. Stores each one's new keys and
        values in its slot; returns each one's last output [hidden] and its fp32 scores [draft vocab]."""
        count = len(items)
        sequences = next(bucket for bucket in self.buckets if bucket >= count)
        total = sum(len(token_ids) for _, _, token_ids, _ in items)
        tokens = next(sequences * size for size in DRAFT_TOKENS if sequences * size >= total)
        features = [features for _, features, _, _ in items]
        token_ids, positions, starts, cached, slots, token_slots = [], [], [0], [], [], []
        for drafter, _, ids, start in items:
            token_ids += ids
            positions += range(start, start + len(ids))
            starts.append(starts[-1] + len(ids))
            cached.append(start)
            slots.append(drafter.slot)
            token_slots += [drafter.slot] * len(ids)
        rows = [end - 1 for end in starts[1:]]
        if tokens > total:  # padding rows after the last sequence's, attending only to what is before them
            features.append(features[-1][-1:].expand(tokens - total, -1))
            token_ids += token_ids[-1:] * (tokens - total)
            positions += [positions[-1] + 1] * (tokens - total)
        starts[-1] = tokens
        empty = sequences - count  # padding sequences: no rows, no cached keys, scoring row 0
        index = positions + starts + [tokens] * empty + cached + [0] * empty + slots + [0] * empty + rows + [0] * empty
        out, keys, values, scores = self.run(self.graph, sequences, tokens, (
            torch.cat(features), torch.tensor(token_ids), torch.tensor(index, dtype=torch.int32), self.keys,
            self.values, self.embedding))
        where = (torch.tensor(token_slots), torch.tensor(positions[:total]))
        self.keys[where] = keys[:total]
        self.values[where] = values[:total]
        return [(out[end - 1], scores[row]) for row, end in enumerate(starts[1:count] + [total])]


def rope_tables(model: CausalLM, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary angles (cos, sin [positions, head_dim]) in the dtype the draft layer runs in."""
    return tuple(table.to(dtype) for table in model.rope_tables(model.embed_tokens.weight.dtype))


@dataclass
class DraftHeads:
    """Trained heads for one model: the network, the draft vocabulary (target token ids) and the file's metadata."""

    kind: str
    network: nn.Module
    vocab_ids: torch.Tensor  # [draft vocab] long: target ids the heads score
    meta: dict
    dtype: torch.dtype = torch.float32  # what the network and the scoring rows compute in: see heads_dtype
    scoring: Linear | QuantLinear | None = None  # hidden -> draft vocabulary scores: see scorer
    row_kernel: bool = False  # the network's and the scorer's projections also through our op (`use_row_kernel`)
    quant: QuantConfig | None = None  # the target's weight quantization, which the projections take (`quantize`)

    def scorer(self, model: CausalLM) -> Linear:
        """The target's LM head rows for the draft vocabulary as a projection hidden -> scores in the heads' dtype,
        gathered once (an engine's heads serve one model) rather than by every request's drafter, in the layout the
        engine uses for that dtype here (`weight_layout`). One row, 8191 x 576, on a 2-core AVX-512 BF16 host:
        0.46 ms in fp32 [in, out] (1.31 ms [out, in]; the [out, in] rows are kept for several rows at once), 0.10 ms
        in bf16 packed."""
        if self.scoring is None:
            rows = lm_head_rows(model, self.vocab_ids).to(self.dtype)
            if self.quant is not None:  # whole tiles of rows for the quantized layouts; `scores` drops the padding
                rows = F.pad(rows, (0, 0, 0, -len(rows) % QUANT_ROWS))
            self.scoring = Linear(rows.shape[1], rows.shape[0], bias=False)
            self.scoring.weight = nn.Parameter(rows, requires_grad=False)
            self.scoring.use_layout(weight_layout(rows.device, rows.dtype), keep_out_in=True)
            if self.row_kernel:
                self.scoring.use_row_kernel()
            if self.quant is not None:
                compute = compute_dtype(rows.device.type, self.dtype, self.quant.scheme)
                self.scoring = QuantLinear(self.scoring, self.quant.scheme, self.quant.group_size, compute,
                                           "the draft heads' scorer", self.quant.activations)
        return self.scoring

    def quantize(self, quant: QuantConfig) -> None:
        """Quantize the network's projections and the scorer's rows as the target's are (`quant`: its scheme, group
        and activations): a draft step then reads a fraction of the bytes, as the target's steps do. Drafts only
        decide what the target verifies, so the target's output stays exactly its own. The bundled model's EAGLE
        draft (k=1, fp32 heads beside an fp32 model, 2-core AVX2 Zen 1 host): 5.3 ms a draft in fp32, 2.3 ms with
        int4 weights by int8 activations."""
        if quant.scheme == "none":
            return
        # AWQ's and GPTQ's calibrations are the target's own: their int4 rounds the heads to nearest.
        self.quant = QuantConfig("int4" if quant.scheme in INT4_SCHEMES else quant.scheme, quant.group_size,
                                 activations=quant.activations)
        self.scoring = None  # made again, quantized, on first use
        quantize_projections(self.network, self.quant, self.vocab_ids.device.type, self.dtype)

    def use_row_kernel(self) -> None:
        """Run the heads' few-row projections through our projection op (`model.row_kernel`; call where it is built
        and the heads compute in bf16), as the compiled step runs the model's: the bundled model's EAGLE draft spent
        1.7 ms of a 3.5 ms draft in its six oneDNN linears (docs/benchmarks.md, "AMX for a verification's rows").
        Heads in fp32 or on a GPU keep their projections."""
        if self.dtype != torch.bfloat16 or self.vocab_ids.device.type != "cpu":
            return
        self.row_kernel = True
        for module in [*self.network.modules(), *([self.scoring] if self.scoring is not None else [])]:
            if isinstance(module, Linear):
                module.use_row_kernel()

    @property
    def num_heads(self) -> int:
        """Medusa: how many tokens ahead the heads reach (the longest draft); EAGLE drafts any length."""
        return self.network.weight.shape[0] if self.kind == "medusa" else 0

    def identity(self) -> str:
        """A digest of the weights, the draft vocabulary and this module's code: what a compiled draft step's
        package depends on beside the model."""
        digest = hashlib.blake2b(inspect.getsource(sys.modules[__name__]).encode(), digest_size=12)
        for name, value in sorted(self.state().items()):
            digest.update(name.encode())
            digest.update(value.cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {f"network.{name}": value.detach().contiguous() for name, value in self.network.state_dict().items()}
        tensors["vocab_ids"] = self.vocab_ids.to(torch.int64).contiguous()
        return tensors

    def save(self, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        tensors = {name: value.to(dtype) if value.is_floating_point() else value
                   for name, value in self.state().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"kind": self.kind, "meta": json.dumps(self.meta)})


def build_network(kind: str, config: ModelConfig, num_heads: int = 4) -> nn.Module:
    if kind == "medusa":
        return MedusaHeads(config.hidden_size, num_heads)
    if kind == "eagle":
        return EagleLayer(config)
    raise ConfigError(f"unknown draft head kind {kind!r}; use one of: {', '.join(DRAFT_KINDS)}.")


def heads_dtype(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """What draft heads compute in next to a model in `model_dtype`: its dtype on a GPU and where its weights run
    packed on a CPU (bf16 with native bf16 math), else fp32, which a CPU without those runs faster. The bundled
    model's EAGLE draft (k=1, a tree 5 wide), 2-core AVX-512 BF16 host: 2.9-3.0 ms a step in fp32, 1.8-2.1 ms in
    bf16 packed (1.1 ms with its weights hot in the cache)."""
    if device.type != "cpu" or weight_layout(device, model_dtype) == "packed":
        return model_dtype
    return torch.float32


def load_heads(path: Path, config: ModelConfig, device: torch.device | str = "cpu",
               model_dtype: torch.dtype = torch.float32) -> DraftHeads:
    """Heads from a file, checked against the model they will draft for (in `model_dtype`, which sets the heads'
    own: `heads_dtype`); refused with a clear message otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no draft heads at {path}.")
    try:
        kind, meta = _metadata(path)
    except Exception as error:  # not a safetensors file at all
        raise ConfigError(f"{path} is not a draft heads file ({error}).") from None
    if kind not in DRAFT_KINDS:
        raise ConfigError(f"{path} is not a draft heads file (kind {kind!r}).")
    if meta.get("fingerprint") != fingerprint(config):
        raise ConfigError(f"the {kind} heads in {path} were trained for another model ({meta.get('model')}, "
                          f"{meta.get('fingerprint')}), not this one ({fingerprint(config)}).")
    tensors = load_file(str(path))
    state = {name.removeprefix("network."): value.float() for name, value in tensors.items()
             if name.startswith("network.")}
    network = build_network(kind, config, state["weight"].shape[0] if kind == "medusa" else 0)
    network.load_state_dict(state)
    network.requires_grad_(False)
    device = torch.device(device)
    dtype = heads_dtype(device, model_dtype)
    network.to(device=device, dtype=dtype)
    for module in network.modules():  # the draft layer decodes a row or two at a time, as the model does
        if isinstance(module, Linear):
            module.use_layout(weight_layout(device, dtype), keep_out_in=True)
    return DraftHeads(kind, network.eval(), tensors["vocab_ids"].to(device), meta, dtype)


def heads_file_name(model_name: str, kind: str) -> str:
    return f"{Path(model_name).name}-{kind}.safetensors"


def find_heads(model_name: str, config: ModelConfig, kind: str, cache_dir: Path | None = None) -> Path | None:
    """Where `kind` heads for this model are: the user cache (what train-draft wrote) first, then the shipped ones;
    None if there are none trained for its shapes."""
    names = [heads_file_name(model_name, kind)]
    if model_name in BUNDLED_NAMES or Path(model_name).name.startswith("SmolLM2-135M-Instruct"):
        names.append(heads_file_name("SmolLM2-135M-Instruct", kind))
    for directory in ((cache_dir or cache_root()) / "draft_heads", SHIPPED):
        for name in names:
            path = directory / name
            if path.is_file() and _metadata(path)[1].get("fingerprint") == fingerprint(config):
                return path
    return None


def _metadata(path: Path) -> tuple[str | None, dict]:
    """A heads file's kind and training report, read without loading its tensors."""
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
    return metadata.get("kind"), json.loads(metadata.get("meta", "{}"))


class _HeadScorer:
    """Scores hidden states over the draft vocabulary and turns the scores into a draft token (and, when sampling,
    its draft distribution over the target's whole vocabulary, 0 outside the draft vocabulary)."""

    def __init__(self, heads: DraftHeads, model: CausalLM):
        self.heads = heads
        self.vocab_size = model.config.vocab_size
        self.scorer = heads.scorer(model)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> fp32 [rows, draft vocab]."""
        return self.scorer(hidden.to(self.heads.dtype))[..., :len(self.heads.vocab_ids)].float()

    def tree_level(self, scores: torch.Tensor, width: int, reach: float, prune: bool) -> tuple[list[int], float]:
        """A tree's candidates at one position from its `scores` [draft vocab]: the `width` best token ids (target
        ids), best first, and the chain's reach through this position (`reach`, the product of the chain's draft
        probabilities above it, times the best one's here). With `prune`, the next-best ones only where their
        probability times `reach` is at least TREE_KEEP."""
        top = scores.softmax(-1).topk(width)
        ids, probs = self.heads.vocab_ids[top.indices].tolist(), top.values.tolist()
        if prune:
            ids = ids[:1] + [token for token, p in zip(ids[1:], probs[1:]) if reach * p >= TREE_KEEP]
        return ids, reach * probs[0]

    def draft(self, scores: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """One draft token from one row of `scores`."""
        if params.greedy:
            return int(self.heads.vocab_ids[int(scores.argmax())]), None
        logits = torch.full((self.vocab_size,), float("-inf"), device=scores.device)
        logits[self.heads.vocab_ids] = scores
        return sample_with_probabilities(logits, params, generator)


class MedusaDrafter(_HeadScorer):
    """Medusa drafts: all from the hidden state at the position that predicted the sequence's last token."""

    wants_hidden = True

    def __init__(self, heads: DraftHeads, model: CausalLM):
        super().__init__(heads, model)
        self.feature: torch.Tensor | None = None
        self.position = -1

    def observe(self, first_position: int, hidden: torch.Tensor) -> None:
        """The target's hidden states at positions first_position.. (a forward's tokens, accepted ones only)."""
        self.feature, self.position = hidden[-1].to(self.heads.dtype), first_position + len(hidden) - 1

    def ready(self, seq: Sequence) -> bool:
        """Whether it holds the hidden state that predicted the sequence's last token (else the caller takes a plain
        step)."""
        return self.feature is not None and self.position == len(seq) - 2

    def chain_job(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator) -> MedusaJob:
        """A chain's proposal (`propose`) as a job for `medusa_together`."""
        def result(head_scores):
            if head_scores is None:
                return [], None
            drafts, probs = [], []
            for scores in head_scores:
                token, q = self.draft(scores, params, generator)
                drafts.append(token)
                probs.append(q)
            return drafts, None if params.greedy else torch.stack(probs)

        return MedusaJob(self, seq, max_drafts, result)

    def tree_job(self, seq: Sequence, depth: int, width: int, prune: bool = False) -> MedusaJob:
        """Greedy tree candidates (`propose_tree`) as a job for `medusa_together`: per position, the `width` best
        tokens of its head, best first; with `prune`, fewer positions and candidates where the heads are unsure
        (`tree_level`, TREE_GO_ON)."""
        def result(head_scores):
            levels, reach = [], 1.0
            for scores in [] if head_scores is None else head_scores:
                candidates, reach = self.tree_level(scores, width, reach, prune)
                levels.append(candidates)
                if prune and reach < TREE_GO_ON:
                    break
            return levels

        return MedusaJob(self, seq, depth, result)

    def propose(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator):
        return medusa_together([self.chain_job(seq, max_drafts, params, generator)])[0]

    def propose_tree(self, seq: Sequence, depth: int, width: int, prune: bool = False) -> list[list[int]]:
        return medusa_together([self.tree_job(seq, depth, width, prune)])[0]

    def close(self) -> None:
        self.feature = None


@dataclass
class MedusaJob:
    """One Medusa drafter's proposal for `medusa_together`: `result(head_scores)` turns its first `max_drafts`
    heads' scores [heads, draft vocab] (None without the hidden state it needs) into the proposal."""

    drafter: MedusaDrafter
    seq: Sequence
    max_drafts: int
    result: Callable


def medusa_together(jobs: list[MedusaJob]) -> list:
    """The proposals of several Medusa drafters of the same heads (each job's `result`): every head over every
    ready drafter's hidden state, and their scoring, in one pass each."""
    ready = [index for index, job in enumerate(jobs) if job.drafter.ready(job.seq)]
    scores: list = [None] * len(jobs)
    if ready:
        drafter, most = jobs[ready[0]].drafter, max(jobs[index].max_drafts for index in ready)
        with torch.inference_mode():
            features = torch.stack([jobs[index].drafter.feature for index in ready])  # [requests, hidden]
            heads = drafter.heads.network(features)[:, :most]  # [requests, heads, hidden]
            rows = drafter.scores(heads.reshape(-1, heads.shape[-1])).view(len(ready), heads.shape[1], -1)
        for row, index in enumerate(ready):
            scores[index] = rows[row, :jobs[index].max_drafts]
    return [job.result(head_scores) for job, head_scores in zip(jobs, scores)]


class EagleDrafter(_HeadScorer):
    """EAGLE drafts: the draft layer steps forward from the target's hidden states, k times. It keeps the target's
    hidden state at every position this request computed (`observe`) and its own keys and values for the positions
    it has read with true hidden states; each proposal first catches up on the positions verified since, then drafts
    (its keys and values at draft positions are overwritten by the next catch-up). Positions the target never
    forwarded for this request (a prompt prefix served from the prefix cache) have no hidden state: the layer then
    attends only from the first position it saw. On a compiled engine its keys and values are a slot of the engine's
    pool (`EagleDraftPool`), whose packages step it, alone or beside the other requests' drafters
    (`draft_together`)."""

    wants_hidden = True

    def __init__(self, heads: DraftHeads, model: CausalLM, max_positions: int, pool: EagleDraftPool | None = None):
        super().__init__(heads, model)
        self.model = model
        config, device, dtype = model.config, heads.vocab_ids.device, heads.dtype
        attn = heads.network.self_attn
        self.rope = rope_tables(model, dtype)
        max_positions = min(max_positions, len(self.rope[0]))
        # Our attention op where the heads' projections take ours (the extension built and running here)
        takes = attention_kernel.takes_flat(torch.empty(1, attn.num_heads, attn.head_dim),
                                            torch.empty(1, attn.num_kv_heads, attn.head_dim),
                                            torch.empty(1, 1, attn.num_kv_heads, attn.head_dim, dtype=dtype))
        self.our_attention = heads.row_kernel and takes
        # A compiled engine's pool, where it has a slot for this drafter (None: eager steps, a cache of its own).
        self.slot = pool.take() if pool is not None and takes and pool.positions >= max_positions else None
        self.pool = pool if self.slot is not None else None
        if self.pool is not None:
            self.cache = (pool.keys[self.slot], pool.values[self.slot])
        else:
            self.cache = (torch.zeros(max_positions, attn.num_kv_heads, attn.head_dim, device=device, dtype=dtype),
                          torch.zeros(max_positions, attn.num_kv_heads, attn.head_dim, device=device, dtype=dtype))
        self.features = torch.zeros(max_positions, config.hidden_size, device=device, dtype=dtype)
        self.first = self.known = self.cached = 0  # features for [first, known); draft KV for [first, cached)

    def observe(self, first_position: int, hidden: torch.Tensor) -> None:
        end = first_position + len(hidden)
        if end > len(self.features):  # past the rotary table: no more drafts for this request
            self.known = -1
            return
        if first_position > self.known or first_position < self.first:
            # A gap (positions not forwarded here) or a restart (recomputed after preemption): begin again there.
            self.first = self.cached = first_position
        self.features[first_position:end] = hidden
        self.known = end
        self.cached = min(self.cached, first_position)

    def _step(self, features: torch.Tensor, token_ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer over positions start.. (features there, the next tokens' embeddings), its keys and values
        stored in the cache; returns its last output [hidden] and that output's fp32 scores [draft vocab]. Through
        the pool's package where it has one that long; else eager."""
        if self.pool is not None and len(token_ids) <= DRAFT_TOKENS[-1]:
            return self.pool.step([(self, features, token_ids, start)])[0]
        tokens = len(token_ids)
        ids = torch.tensor(token_ids, device=features.device)
        embeddings = self.model.embed_tokens.weight[ids].to(self.heads.dtype)
        cos, sin = (table[start:start + tokens].unsqueeze(1) for table in self.rope)
        out = self.heads.network(features[None], embeddings[None], cos, sin, self.cache, start,
                                 self.our_attention)[0][-1]
        return out, self.scores(out[None])[0]

    def chain_job(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator) -> DraftJob:
        """A chain's proposal (`propose`) as a job for `draft_together`: its `result` is (drafts, their draft
        distributions [drafts, vocab] when sampling, else None)."""
        def choose(scores):
            token, q = self.draft(scores, params, generator)
            return token, (token, q), True

        def result(drafted):
            if drafted is None:
                return [], None
            return [token for token, _ in drafted], None if params.greedy else torch.stack([q for _, q in drafted])

        return DraftJob(self, seq, max_drafts, choose, result)

    def tree_job(self, seq: Sequence, depth: int, width: int, prune: bool = False) -> DraftJob:
        """A tree's candidates (`propose_tree`) as a job for `draft_together`: per position, the `width` best tokens,
        best first; the layer steps along the best ones (the chain), so the others are alternatives at their
        position after the chain's tokens before it. With `prune`, the layer steps on only while the chain's reach
        holds (TREE_GO_ON: a draft step saved where the next draft would rarely be reached) and keeps the likely
        alternatives only (`tree_level`)."""
        reach = 1.0

        def choose(scores):
            nonlocal reach
            candidates, reach = self.tree_level(scores, width, reach, prune)
            return candidates[0], candidates, not prune or reach >= TREE_GO_ON

        return DraftJob(self, seq, depth, choose, lambda drafted: drafted or [])

    def propose(self, seq: Sequence, max_drafts: int, params: SamplingParams, generator):
        return draft_together([self.chain_job(seq, max_drafts, params, generator)])[0]

    def propose_tree(self, seq: Sequence, depth: int, width: int, prune: bool = False) -> list[list[int]]:
        return draft_together([self.tree_job(seq, depth, width, prune)])[0]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.give_back(self.slot)
        self.features = self.cache = self.pool = None


@dataclass
class DraftJob:
    """One EAGLE drafter's proposal for `draft_together`: step the layer up to `max_drafts` times from the sequence's
    last position; `choose(scores)` turns each step's scores [draft vocab] into (the token the next step reads, what
    to collect, whether to step on); `result(collected)` turns what was collected (None while the hidden states do
    not reach the last position) into the proposal. `catch_up_s`: its share of the time the parts of long catch-ups
    took (`draft_together`)."""

    drafter: EagleDrafter
    seq: Sequence
    max_drafts: int
    choose: Callable
    result: Callable
    catch_up_s: float = 0.0


def draft_together(jobs: list[DraftJob]) -> list:
    """The proposals of several EAGLE drafters (each job's `result`), their layer steps taken together: first each
    one's catch-up on the positions verified since its last proposal, then each draft step of those still drafting.
    The drafters in one compiled engine's pool step in one package call each time (`EagleDraftPool.step`), a
    catch-up longer than the packages take in parts; the others step alone. Each drafter's steps, and so its
    drafts, are those it takes alone."""
    collected: list[list | None] = [None] * len(jobs)
    starts = {}  # job index -> the first position its catch-up steps
    for index, job in enumerate(jobs):
        drafter, last = job.drafter, len(job.seq) - 1  # the last token's position: the hidden state that predicts
        if drafter.known != last or last <= drafter.first or last + job.max_drafts > len(drafter.features):
            continue
        # Catch up: the pairs (f_j, x_{j+1}) for j in [cached, last), at least the last one (its output drafts).
        starts[index] = min(drafter.cached, last - 1)
        drafter.cached = last
        collected[index] = []
    chunk = DRAFT_TOKENS[-1]
    with torch.inference_mode():
        # A pooled drafter's catch-up past the largest package (after a prompt, or after plain steps: a group kept
        # plain where that paid) steps through it in parts, their outputs unread: eager, 32 positions took 4 ms.
        while long := [index for index, start in starts.items() if jobs[index].drafter.pool is not None
                       and len(jobs[index].seq) - 1 - start > chunk]:
            started = time.perf_counter()
            _step_each([(jobs[index].drafter, jobs[index].drafter.features[starts[index]:starts[index] + chunk],
                         jobs[index].seq.token_ids[starts[index] + 1:starts[index] + chunk + 1], starts[index])
                        for index in long])
            for index in long:
                starts[index] += chunk
                jobs[index].catch_up_s += (time.perf_counter() - started) / len(long)
        steps = [(index, jobs[index].drafter.features[start:len(jobs[index].seq) - 1],
                  jobs[index].seq.token_ids[start + 1:], start) for index, start in starts.items()]
        while steps:
            outputs = _step_each([(jobs[index].drafter, *inputs) for index, *inputs in steps])
            going_on = []
            for (index, *_), (out, scores) in zip(steps, outputs):
                job = jobs[index]
                token, value, step_on = job.choose(scores)
                collected[index].append(value)
                if len(collected[index]) < job.max_drafts and step_on:
                    going_on.append((index, out[None], [token], len(job.seq) - 2 + len(collected[index])))
            steps = going_on
    return [job.result(drafted) for job, drafted in zip(jobs, collected)]


def _step_each(items: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each (drafter, features, token ids, start)'s layer step (`EagleDrafter._step`): those of one pool that its
    packages take in one call where there are several, the rest one by one."""
    pool = next((drafter.pool for drafter, *_ in items if drafter.pool is not None), None)
    pooled = [index for index, (drafter, _, token_ids, _) in enumerate(items)
              if pool is not None and drafter.pool is pool and len(token_ids) <= DRAFT_TOKENS[-1]]
    pooled = pooled[:pool.buckets[-1]] if pool is not None else []  # (the most a package steps)
    outputs: list = [None] * len(items)
    if len(pooled) > 1:
        for index, output in zip(pooled, pool.step([items[index] for index in pooled])):
            outputs[index] = output
    return [output if output is not None else item[0]._step(*item[1:]) for output, item in zip(outputs, items)]
