"""Our paged attention kernel for compiled decode on AVX-512 CPUs (`inference_core.model.attention_kernel`): the op
against the fp32 attention inductor compiles otherwise (`_attend_one_fused` over `_read_context`), which layers it
takes, and that an exported step calls it only where asked. The compiled step is checked on the bundled
model against eager (tests/engine/test_compiled.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_models import TINY, write_word_level_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import inference_core
from inference_core.engine.compiled import DecodeGraph, _attend_one_fused, _read_context
from inference_core.engine.query_graph import FlatGraph, QueryGraph, attend_queries, read_context
from inference_core.model import attention_kernel


def paged_case(batch: int, blocks: int, kv_heads: int, group: int, head_dim: int, seed: int,
               dtype: torch.dtype = torch.bfloat16):
    """Random pools (bf16 or fp32: the model's dtype) of 64 blocks of 16, a block table of `blocks` per row, masks of
    different lengths with a hole (a sliding window's edge), the last row with nothing cached (a bucket's padding
    row)."""
    generator = torch.Generator().manual_seed(seed)
    pool = (64, 16, kv_heads, head_dim)
    k_pool = torch.randn(pool, generator=generator).to(dtype)
    v_pool = torch.randn(pool, generator=generator).to(dtype)
    table = torch.randint(0, 64, (batch, blocks), generator=generator, dtype=torch.int32)
    lengths = torch.randint(1, blocks * 16 + 1, (batch,), generator=generator)
    mask = torch.arange(blocks * 16)[None, :] < lengths[:, None]
    mask[:, 3] = False
    if batch > 1:
        mask[-1] = False
    q = torch.randn(batch, kv_heads * group * head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, head_dim, generator=generator).to(dtype)
    return q, k, v, k_pool, v_pool, table, mask


@pytest.mark.parametrize("batch, blocks, kv_heads, group, head_dim", [
    (1, 9, 3, 3, 64),  # the bundled model at 144 keys
    (2, 32, 3, 3, 64),
    (4, 3, 2, 4, 128),
    (3, 5, 1, 8, 64),
    (2, 2, 4, 1, 128),
    (1, 1, 8, 2, 128),  # Qwen3-0.6B's heads, one block
    (3, 4, 2, 2, 16),  # the tests' tiny models' heads
    (2, 6, 2, 4, 32),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_op_equals_the_attention_inductor_compiles(our_ops, batch, blocks, kv_heads, group, head_dim, dtype):
    q, k, v, k_pool, v_pool, table, mask = paged_case(batch, blocks, kv_heads, group, head_dim, seed=blocks,
                                                      dtype=dtype)
    k_ctx, v_ctx = _read_context(k_pool, v_pool, table, blocks, paged=True)
    want = _attend_one_fused(q, k, v, k_ctx, v_ctx, mask, head_dim**-0.5)
    got = attention_kernel.attend(q, k, v, k_pool, v_pool, table, mask, head_dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_the_op_refuses_a_pool_of_another_layout(our_ops):
    q, k, v, k_pool, v_pool, table, mask = paged_case(1, 2, 3, 3, 64, seed=0)
    # heads and positions swapped, as a contiguous cache has them
    with pytest.raises(RuntimeError, match="bf16 or fp32 pools"):
        attention_kernel.attend(q, k, v, k_pool.transpose(1, 2).contiguous(), v_pool.transpose(1, 2).contiguous(),
                                table, mask, 0.125)


def test_it_takes_bf16_and_fp32_paged_pools_of_the_head_sizes_it_knows():
    q, k = torch.zeros(1, 9 * 64).bfloat16(), torch.zeros(1, 3, 64).bfloat16()
    pool = torch.zeros(8, 16, 3, 64)  # a layer's [blocks, block, KV heads, head_dim]
    assert attention_kernel.takes(q, k, pool.bfloat16()) and attention_kernel.takes(q.float(), k.float(), pool)
    assert not attention_kernel.takes(q, k, pool.half())
    assert not attention_kernel.takes(q, k, pool.to(torch.int8))  # the int8 KV cache
    assert not attention_kernel.takes(q, k, torch.zeros(4, 3, 16, 64).bfloat16())  # a contiguous cache's layout:
    # [slots, KV heads, positions, head_dim]
    assert not attention_kernel.takes(torch.zeros(1, 27 * 64), k, pool.bfloat16())  # 9 query heads a KV head
    assert attention_kernel.takes(torch.zeros(1, 4 * 16), torch.zeros(1, 2, 16), torch.zeros(8, 16, 2, 16))
    odd = torch.zeros(1, 3, 96)
    assert not attention_kernel.takes(torch.zeros(1, 9 * 96), odd, torch.zeros(8, 16, 3, 96).bfloat16())


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A 1-layer random Llama with head_dim 64 (the bundled model's), in bf16."""
    directory = tmp_path_factory.mktemp("tiny-llama-d64")
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 1, "head_dim": 64}, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    write_word_level_tokenizer(directory)
    return inference_core.load_model(str(directory), device="cpu", dtype="bfloat16")


def test_an_exported_step_calls_it_only_where_asked(our_ops, wide_heads):
    pool = torch.randn(1, 8, 16, 2, 64).bfloat16()
    args = (torch.tensor([5, 7]), torch.tensor([40, 3]), torch.tensor([[1, 2, 3], [4, 0, 0]], dtype=torch.int32),
            torch.arange(48)[None, :] < torch.tensor([[40], [3]]), pool, pool.clone())
    outputs = {}
    for ours in (True, False):
        step = DecodeGraph(wide_heads.model, paged=True, block_size=16, our_attention=ours).eval()
        with torch.no_grad():
            program = torch.export.export(step, args)
        assert ("attend_paged" in str(program.graph)) == ours
        outputs[ours] = program.module()(*args)
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=2e-2, atol=2e-2)  # logits, bf16 projections


def test_an_exported_flat_step_calls_our_ops_and_finishes_the_rows_it_keeps(our_ops, wide_heads):
    """The flat step of a bf16 model: attention and the MLP's activation through our ops (`model.mlp_kernel`), and
    the last layer finishing only the rows `keep` names, which equal those rows of a step that keeps every row."""
    pool = torch.randn(1, 8, 16, 2, 64).bfloat16()
    inputs = (torch.arange(3, 13), torch.arange(10), torch.tensor([[1, 2]], dtype=torch.int32),
              torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
              torch.tensor([0, 0], dtype=torch.int32))
    step = FlatGraph(wide_heads.model).eval()
    with torch.no_grad():
        program = torch.export.export(step, (*inputs, torch.tensor([9, 3]), pool, pool.clone()))
        graph = str(program.graph)
        assert "attend_paged_flat" in graph and "silu_mul" in graph
        kept, _, _ = program.module()(*inputs, torch.tensor([9, 3]), pool, pool.clone())
        every, new_k, _ = step(*inputs, torch.arange(10), pool, pool.clone())
    assert kept.shape == (2, 64) and every.shape == (10, 64) and new_k.shape == (1, 10, 2, 64)
    torch.testing.assert_close(kept, every[[9, 3]], rtol=2e-2, atol=2e-2)  # bf16 projections of 2 rows against 10


def queries_case(batch: int, queries: int, blocks: int, kv_heads: int, group: int, head_dim: int, seed: int,
                 dtype: torch.dtype = torch.bfloat16):
    """`paged_case`'s pools and table with T new tokens a sequence: each query's cached keys cut by a sliding window
    of its own (the later queries see fewer of the first keys), a tree's mask over the new keys (each sees itself
    and a random set of the earlier ones), and a row whose queries see no cached key."""
    _, _, _, k_pool, v_pool, table, mask = paged_case(batch, blocks, kv_heads, group, head_dim, seed, dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    key_mask = mask[:, None, :].repeat(1, queries, 1)
    for t in range(queries):
        key_mask[0, t, : 2 * t] = False  # the window moves on by two cached keys a query
    new_mask = torch.rand(batch, queries, queries, generator=generator) < 0.5
    new_mask = (new_mask & torch.ones(queries, queries, dtype=torch.bool).tril()) | torch.eye(queries, dtype=torch.bool)
    q = torch.randn(batch, queries, kv_heads * group, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, queries, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, queries, kv_heads, head_dim, generator=generator).to(dtype)
    return q, k, v, k_pool, v_pool, table, key_mask, new_mask


@pytest.mark.parametrize("batch, queries, blocks, kv_heads, group, head_dim", [
    (1, 5, 9, 3, 3, 64),  # the bundled model verifying 4 drafts at 144 keys
    (2, 2, 32, 3, 3, 64),
    (3, 17, 3, 2, 4, 128),  # the most queries the graph takes
    (2, 4, 5, 1, 8, 64),
    (1, 3, 1, 8, 2, 128),
    (2, 1, 4, 3, 3, 64),  # one query: the decode op's case through the other
    (2, 5, 3, 2, 2, 16),  # the tests' tiny models' heads
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_queries_op_equals_the_attention_inductor_compiles(our_ops, batch, queries, blocks, kv_heads, group,
                                                               head_dim, dtype):
    q, k, v, k_pool, v_pool, table, key_mask, new_mask = queries_case(batch, queries, blocks, kv_heads, group,
                                                                      head_dim, seed=blocks + queries, dtype=dtype)
    k_ctx, v_ctx = read_context(k_pool, v_pool, table, blocks * 16, paged=True)
    want = attend_queries(q, k, v, k_ctx, v_ctx, key_mask, new_mask, head_dim**-0.5)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values through a view's strides
    got = attention_kernel.attend_queries(strided, k, v, k_pool, v_pool, table, key_mask, new_mask, head_dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_an_exported_query_step_calls_it_only_where_asked(our_ops, wide_heads):
    pool = torch.randn(1, 8, 16, 2, 64).bfloat16()
    lengths = torch.tensor([[40], [3]])
    key_mask = (torch.arange(48)[None, :] < lengths)[:, None, :].repeat(1, 3, 1)  # [B, T, width]
    args = (torch.tensor([[5, 7, 9], [7, 1, 0]]), lengths + torch.arange(3), torch.tensor([[1, 2, 3], [4, 0, 0]],
            dtype=torch.int32), key_mask, torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3).clone(), pool,
            pool.clone())
    outputs = {}
    for ours in (True, False):
        step = QueryGraph(wide_heads.model, paged=True, block_size=16, our_attention=ours).eval()
        with torch.no_grad():
            program = torch.export.export(step, args)
        assert ("attend_paged_queries" in str(program.graph)) == ours
        outputs[ours] = program.module()(*args)
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=2e-2, atol=2e-2)  # logits, bf16 projections


def flat_case(news: list[int], cached: list[int], kv_heads: int, group: int, head_dim: int, dtype, seed: int):
    """Random pools of 64 blocks of 16 and a flat batch: sequence s forwards news[s] new tokens after cached[s] keys
    in the pool, its block table a random row of distinct blocks."""
    generator = torch.Generator().manual_seed(seed)
    pool = (64, 16, kv_heads, head_dim)
    k_pool, v_pool = (torch.randn(pool, generator=generator).to(dtype) for _ in range(2))
    blocks = max(2, max(-(-c // 16) for c in cached))
    table = torch.stack([torch.randperm(64, generator=generator)[:blocks] for _ in news]).int()
    tokens = sum(news)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    starts = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32)
    return q, k, v, k_pool, v_pool, table, starts, torch.tensor(cached, dtype=torch.int32)


def flat_reference(q, k, v, k_pool, v_pool, table, starts, cached, window, scale, sinks: int = 0):
    """The flat op's attention written plainly: each sequence's keys (cached, then new) and a causal, windowed mask
    that keeps the first `sinks` keys."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k.shape[1]
    for s in range(len(cached)):
        first, last, c = int(starts[s]), int(starts[s + 1]), int(cached[s])
        if first == last:
            continue
        keys_at = [int(table[s, j // 16]) * 16 + j % 16 for j in range(c)]
        k_all = torch.cat([k_pool.flatten(0, 1)[keys_at], k[first:last]]).float()  # [c + n, KVH, D]
        v_all = torch.cat([v_pool.flatten(0, 1)[keys_at], v[first:last]]).float()
        query_positions = torch.arange(c, c + last - first)[:, None]
        key_positions = torch.arange(c + last - first)[None, :]
        mask = key_positions <= query_positions
        if window:
            mask &= (key_positions > query_positions - window) | (key_positions < sinks)
        scores = torch.einsum("nhd,jhd->hnj", q[first:last].float(), k_all.repeat_interleave(group, 1)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("hnj,jhd->nhd", probs, v_all.repeat_interleave(group, 1))
    return out


@pytest.mark.parametrize("news, cached, kv_heads, group, head_dim, dtype, window", [
    ([1, 1, 1], [40, 7, 100], 3, 3, 64, torch.bfloat16, None),  # decodes alone
    ([16, 1, 1, 1], [0, 33, 90, 5], 3, 3, 64, torch.bfloat16, None),  # a prefill chunk beside decodes
    ([16, 1, 1, 1], [0, 33, 90, 5], 3, 3, 64, torch.float32, None),  # an fp32 pool
    ([9, 30, 1], [50, 17, 200], 2, 4, 128, torch.bfloat16, None),  # chunks after cached prefixes
    ([70], [0], 2, 2, 16, torch.float32, None),  # a long prompt: the tiled loops, causal
    ([71], [0], 2, 2, 16, torch.bfloat16, None),  # ... bf16: an odd last chunk of keys
    ([100, 2], [37, 60], 2, 2, 32, torch.bfloat16, None),  # a long chunk after a prefix
    ([8, 7], [130, 130], 3, 3, 64, torch.float32, None),  # the shortest tiled sequence beside the longest short one
    ([200], [300], 1, 5, 64, torch.bfloat16, None),  # several key chunks; 5 heads a KV head pad the rows
    ([150, 1], [90, 40], 2, 8, 128, torch.float32, None),  # head_dim 128, 8 heads a KV head
    ([70, 3, 1], [0, 21, 48], 2, 2, 16, torch.float32, 24),  # sliding windows, long and short
    ([300], [400], 2, 3, 64, torch.float32, (70, 3)),  # key chunks before every query's window skipped, not sinks
    ([12, 1], [80, 130], 1, 8, 64, torch.bfloat16, 40),
    ([70, 3, 1], [0, 21, 48], 2, 2, 16, torch.float32, (24, 4)),  # windows beside attention sinks
    ([12, 1], [80, 130], 1, 8, 64, torch.bfloat16, (40, 5)),
    ([0, 5, 0, 1], [0, 19, 0, 3], 2, 2, 16, torch.float32, None),  # empty rows (a bucket's padding sequences)
    ([2], [0], 4, 1, 16, torch.float32, None),  # the smallest flat step
])
@pytest.mark.parametrize("pairs", [False, True], ids=["fp32 products", "bf16 pairs"])
def test_the_flat_op_equals_a_plain_attention(our_ops, news, cached, kv_heads, group, head_dim, dtype, window, pairs):
    """Both forms of the tiled loops: fp32 products (every CPU; the reference), and where the CPU has BF16 dot products
    a bf16 pool's in bf16 pairs, whose exponentials are rounded to bf16 for the weighted values (about 3 of bf16's 8
    bits of error, where a wrong mask or a missed key errs by tenths)."""
    if pairs and not attention_kernel.pairs_available():
        pytest.skip("the CPU has no AVX-512 BF16 dot products")
    case = flat_case(news, cached, kv_heads, group, head_dim, dtype, seed=sum(news))
    window, sinks = window if isinstance(window, tuple) else (window, 0)
    want = flat_reference(*case, window, head_dim**-0.5, sinks)
    with attention_kernel.pairs_form(pairs):
        got = attention_kernel.attend_flat(*case, torch.tensor([window or 0, sinks], dtype=torch.int32),
                                           head_dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bf16_pairs = pairs and dtype == torch.bfloat16 and max(news) >= 8  # the tiled loops' sequences only
    torch.testing.assert_close(got, want, rtol=2e-5 if not bf16_pairs else 1e-2,
                               atol=2e-5 if not bf16_pairs else 8e-3)


def test_the_pairs_form_reads_strided_new_tokens(our_ops):
    """q, k and v as the flat step hands them over (views of the projection's output: strided by token and head)
    give what their contiguous copies give, in the pairs form that reads them in place."""
    if not attention_kernel.pairs_available():
        pytest.skip("the CPU has no AVX-512 BF16 dot products")
    q, k, v, k_pool, v_pool, table, starts, cached = flat_case([40, 1], [20, 9], 3, 3, 64, torch.bfloat16, seed=3)
    wide = torch.randn(41, 15, 64).bfloat16()
    wide[:, :9], wide[:, 9:12], wide[:, 12:] = q, k, v
    window = torch.tensor([0, 0], dtype=torch.int32)
    strided = attention_kernel.attend_flat(wide[:, :9], wide[:, 9:12], wide[:, 12:], k_pool, v_pool, table, starts,
                                           cached, window, 0.125)
    assert torch.equal(strided, attention_kernel.attend_flat(q, k, v, k_pool, v_pool, table, starts, cached, window,
                                                             0.125))


def test_the_flat_op_refuses_a_block_outside_the_pool(our_ops):
    q, k, v, k_pool, v_pool, table, starts, cached = flat_case([3], [20], 2, 2, 16, torch.float32, seed=0)
    table[0, 1] = 64
    with pytest.raises(RuntimeError, match="outside the pool"):
        attention_kernel.attend_flat(q, k, v, k_pool, v_pool, table, starts, cached, None, 0.25)
    with pytest.raises(RuntimeError, match="starts from 0"):
        attention_kernel.attend_flat(q, k, v, k_pool, v_pool, table, starts + 1, cached, None, 0.25)
