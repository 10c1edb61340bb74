"""The compiled step's Triton attention (`engine.triton_attention`) against the ATen ops it replaces
(`compiled._attend_one` over `compiled._read_context`): paged and contiguous pools, grouped-query heads (groups of
1, 3 and 4), masks with holes (a sliding window, padding rows), sequences with no cached key, fp32 and bf16. On CUDA
the kernel runs compiled; on the CPU under Triton's interpreter, where Triton is installed (it comes with torch's
CUDA builds, not with the CPU build the suite pins, so here these tests run on a GPU machine's `gpu-report` and on
a CPU where Triton was installed by hand). Which layouts it takes, and how the compiled step's stats name it, is
checked everywhere."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read by Triton's import and when the kernel is defined

from inference_core import gpu  # noqa: E402
from inference_core.engine import triton_attention  # noqa: E402
from inference_core.engine.compiled import _attend_one, _read_context  # noqa: E402

pytestmark = pytest.mark.cuda  # in the GPU run's tests (`pytest -m cuda`)
needs_triton = pytest.mark.skipif(triton_attention._triton() is None, reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(paged: bool, dtype, group: int, seed: int):
    """Random inputs of one decode step: 3 sequences (the last a padding row with nothing cached), 2 KV heads."""
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, head_dim, block_size = 3, 2, 32, 8

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = rand(batch, kv_heads * group, head_dim), rand(batch, kv_heads, head_dim), rand(batch, kv_heads, head_dim)
    if paged:  # 48 keys: a whole chunk of the kernel's and part of a second
        blocks, lengths = 6, [45, 9, 0]
        k_pool, v_pool = rand(24, block_size, kv_heads, head_dim), rand(24, block_size, kv_heads, head_dim)
        table = torch.randperm(23, generator=generator)[:batch * blocks].view(batch, blocks) + 1
        read_index = torch.zeros(batch, 8, dtype=torch.int32)  # wider than read: the step passes a view
        read_index[:, :blocks] = table.to(torch.int32)
        read_index = read_index[:, :blocks]
        keys = blocks * block_size
    else:
        k_pool, v_pool = rand(5, kv_heads, 80, head_dim), rand(5, kv_heads, 80, head_dim)
        read_index = torch.tensor([3, 0, 4])
        keys, lengths = 70, [65, 9, 0]  # not a multiple of the kernel's chunk
    key_mask = torch.arange(keys)[None, :] < torch.tensor(lengths)[:, None]
    key_mask[0, :5] = False  # a sliding window's hole
    if paged:  # a whole chunk masked: with splits, one whose keys are all left out
        key_mask[0, 32:] = False
    else:  # a window past the first chunk: with splits, split 0 has only the own key
        key_mask[0, :40] = False
    tensors = [q, k, v, k_pool, v_pool, read_index, key_mask, torch.tensor(lengths)]
    return [tensor.to(DEVICE) for tensor in tensors], keys


@needs_triton
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("splits", [1, 4], ids=["whole", "split4"])
def test_kernel_equals_the_aten_ops(paged, dtype, group, splits):
    """With one split a program walks all of a sequence's keys; with 4, a split of 32 keys each (some empty, one all
    masked, one with only the own key), combined by the second kernel."""
    (q, k, v, k_pool, v_pool, read_index, key_mask, lengths), keys = _case(paged, dtype, group, seed=group)
    assert triton_attention.unsupported(q.dtype, k_pool, paged) is None
    scale = 32 ** -0.5
    width = read_index.shape[1] if paged else keys
    k_ctx, v_ctx = _read_context(k_pool, v_pool, read_index, width, paged)
    expected = _attend_one(q.float(), k.float(), v.float(), k_ctx.float(), v_ctx.float(), key_mask, scale)
    out = triton_attention.decode_attention(q, k, v, k_pool, v_pool, read_index, key_mask, lengths, scale, paged,
                                            splits)
    assert out.shape == expected.shape and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    # The padding row (nothing cached) attends to its own value alone.
    torch.testing.assert_close(out[2].float(), v[2].float()[:, None, :].expand(-1, group, -1), rtol=1e-6, atol=1e-6)
    # The compiled step on CUDA passes its buffers whole: past each sequence's length, the block table and the mask
    # hold what earlier steps left there (blocks of other sequences, keys marked attended). None of it is read.
    stale_index = torch.cat([read_index, torch.randint(1, 24, (3, 4), dtype=read_index.dtype, device=DEVICE)], 1) \
        if paged else read_index
    extra = 4 * 8 if paged else 10
    stale_mask = torch.cat([key_mask, torch.ones(3, extra, dtype=torch.bool, device=DEVICE)], 1)
    stale_mask[:, :keys] |= torch.arange(keys, device=DEVICE)[None, :] >= lengths[:, None]
    if not paged:  # the pool's slots are as wide as the mask
        k_pool, v_pool = (torch.cat([pool, pool[:, :, :extra]], 2) for pool in (k_pool, v_pool))
    whole = triton_attention.decode_attention(q, k, v, k_pool, v_pool, stale_index, stale_mask, lengths, scale, paged,
                                              splits)
    torch.testing.assert_close(whole, out, rtol=0, atol=0)


@needs_triton
def test_the_timed_cases_inputs_give_the_aten_ops_result():
    """`gpu-report --parts attention` times the kernel on inputs `bench.kernel_timing` builds: a paged step whose
    every sequence has its whole context cached. Here (smaller) under the interpreter, split and not."""
    from inference_core.bench import kernel_timing

    inputs = kernel_timing._inputs(torch.device(DEVICE), heads=32, batch=2, keys=70)
    expected = kernel_timing._aten(*[tensor.float() if tensor.is_floating_point() else tensor
                                        for tensor in inputs[:8]], inputs[8])
    for splits in (1, 4):
        out = triton_attention.decode_attention(*inputs, paged=True, splits=splits)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def _flat_case(dtype, group: int, seed: int):
    """Random inputs of one flat step over a paged pool (block size 8, 2 KV heads, head size 32): a decode after 45
    cached keys, a 40-token prompt (past one chunk of the kernel's), a 10-token chunk after 20 cached keys, a sequence
    with nothing new, and 3 padding rows of a padding sequence."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, block_size = 2, 32, 8

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    news, cached = [1, 40, 10, 0, 3], [45, 0, 20, 7, 0]
    tokens = sum(news)
    q, k, v = rand(tokens, kv_heads * group, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads,
                                                                                               head_dim)
    k_pool, v_pool = rand(40, block_size, kv_heads, head_dim), rand(40, block_size, kv_heads, head_dim)
    table = (torch.randperm(39, generator=generator)[:5 * 7].view(5, 7) + 1).to(torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32)
    return q, k, v, k_pool, v_pool, table, starts, torch.tensor(cached, dtype=torch.int32)


def _flat_reference(q, k, v, k_pool, v_pool, table, starts, cached, window, scale, positions=None, seen=None):
    """Each token against its sequence's cached keys (through its block table) and its new keys up to itself (a tree
    node: those its `seen` bits mark), within the window or among the sinks, in fp32, one token at a time."""
    size, sinks = window.tolist()
    kv_heads, head_dim = k.shape[1:]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for s in range(len(cached)):
        first, end, count = int(starts[s]), int(starts[s + 1]), int(cached[s])
        pooled = torch.arange(count)
        blocks = table[s].long()[pooled // k_pool.shape[1]]
        keys = torch.cat([k_pool[blocks, pooled % k_pool.shape[1]], k[first:end]]).float()
        values = torch.cat([v_pool[blocks, pooled % v_pool.shape[1]], v[first:end]]).float()
        new_positions = positions[first:end] if positions is not None else torch.arange(count, count + end - first)
        key_positions = torch.cat([pooled, new_positions])
        for t in range(first, end):
            u, position = t - first, int(new_positions[t - first])
            bits = int(seen[t]) if seen is not None else 0
            before = [j for j in range(end - first) if (bits >> j & 1 if bits else j <= u)]
            visible = torch.cat([pooled, count + torch.tensor(before, dtype=torch.long)])
            if size:
                at = key_positions[visible]
                visible = visible[(at > position - size) | (at < sinks)]
            for head in range(q.shape[1]):
                scores = (keys[visible, head // group] @ q[t, head].float()) * scale
                out[t, head] = torch.softmax(scores, 0) @ values[visible, head // group]
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [(0, 0), (12, 3)], ids=["no-window", "window+sinks"])
def test_flat_kernel_takes_a_draft_tree(dtype, window):
    """A draft tree among the flat step's sequences (CUDA's tree verification): 2 levels of 2 candidates after 20
    cached keys, node i at its depth's position seeing its ancestors and itself, beside a decode and a prompt."""
    generator = torch.Generator().manual_seed(7)
    kv_heads, group, head_dim, block_size = 2, 3, 32, 8

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    news, cached = [1, 5, 20], [30, 20, 0]
    depths, parents = [0, 1, 1, 2, 2], [None, 0, 0, 1, 2]
    tokens = sum(news)
    q, k, v = rand(tokens, kv_heads * group, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads,
                                                                                               head_dim)
    k_pool, v_pool = rand(30, block_size, kv_heads, head_dim), rand(30, block_size, kv_heads, head_dim)
    table = (torch.randperm(29, generator=generator)[:3 * 4].view(3, 4) + 1).to(torch.int32)
    starts = torch.tensor([0, 1, 6, 26], dtype=torch.int32)
    positions = torch.tensor([30] + [20 + depth for depth in depths] + list(range(20)))
    seen = torch.zeros(tokens, dtype=torch.long)
    for node, parent in enumerate(parents):
        seen[1 + node] = (1 << node) | (int(seen[1 + parent]) if parent is not None else 0)
    window = torch.tensor(window, dtype=torch.int32)
    cached = torch.tensor(cached, dtype=torch.int32)
    scale = 32 ** -0.5
    expected = _flat_reference(q, k, v, k_pool, v_pool, table, starts, cached, window, scale, positions, seen)
    tensors = [tensor.to(DEVICE) for tensor in (q, k, v, k_pool, v_pool, table, starts, cached, window)]
    out = triton_attention.flat_attention(*tensors, scale, positions.to(DEVICE), seen.to(DEVICE))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, rtol=tolerance, atol=tolerance)
    # A tree node sees no sibling: with causal rows instead, the tree's rows differ.
    causal = triton_attention.flat_attention(*tensors, scale, positions.to(DEVICE))
    assert not torch.allclose(causal[1:6].cpu(), expected[1:6], rtol=tolerance, atol=tolerance)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [(0, 0), (12, 0), (12, 3)], ids=["no-window", "window", "window+sinks"])
def test_flat_kernel_equals_a_token_at_a_time(dtype, group, window):
    """The flat step's kernel (a program per new token and KV head) against the reference above: decodes, a prompt,
    a chunk after cached keys, an empty sequence and padding rows; a sliding window that cuts cached and new keys
    (a prompt's early queries see the whole of theirs), with and without sinks."""
    q, k, v, k_pool, v_pool, table, starts, cached = _flat_case(dtype, group, seed=group)
    window = torch.tensor(window, dtype=torch.int32)
    scale = 32 ** -0.5
    expected = _flat_reference(q, k, v, k_pool, v_pool, table, starts, cached, window, scale)
    tensors = [tensor.to(DEVICE) for tensor in (q, k, v, k_pool, v_pool, table, starts, cached, window)]
    out = triton_attention.flat_attention(*tensors, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, rtol=tolerance, atol=tolerance)


def test_unsupported_layouts_say_why():
    assert "head size 24" in triton_attention.unsupported(torch.float32, torch.zeros(4, 16, 2, 24), paged=True)
    assert "block size 12" in triton_attention.unsupported(torch.float32, torch.zeros(4, 12, 2, 32), paged=True)
    assert triton_attention.unsupported(torch.float32, torch.zeros(4, 2, 12, 32), paged=False) is None  # positions
    assert "int8" in triton_attention.unsupported(torch.bfloat16, torch.zeros(4, 16, 2, 32, dtype=torch.int8), True)
    pool, cuda = torch.zeros(4, 16, 2, 32), torch.device("cuda")
    assert not triton_attention.used(torch.device("cpu"), torch.float32, pool, True)  # CUDA only
    if triton_attention._triton() is None:
        assert triton_attention.describe(cuda, torch.float32, pool, True) == (
            "attention: ATen ops (Triton is not installed)")
        return
    assert triton_attention.describe(cuda, torch.float32, pool, True) == (
        "attention: one Triton kernel a layer, keys in up to 16 splits")
    assert "does not take head size 24" in triton_attention.describe(cuda, torch.float32, torch.zeros(4, 16, 2, 24),
                                                                     True)


def test_the_flat_step_says_why_it_has_no_triton_attention(monkeypatch):
    pool, cuda = torch.zeros(4, 16, 2, 32), torch.device("cuda")
    assert triton_attention.flat_unavailable(torch.device("cpu"), torch.float32, pool) == (
        "our Triton attention runs on CUDA, not cpu")
    monkeypatch.setenv("INFERENCE_CORE_TRITON_FLAT", "0")
    assert triton_attention.flat_unavailable(cuda, torch.float32, pool) == "INFERENCE_CORE_TRITON_FLAT=0"
    monkeypatch.delenv("INFERENCE_CORE_TRITON_FLAT")
    if triton_attention._triton() is None:
        assert triton_attention.flat_unavailable(cuda, torch.float32, pool) == "Triton is not installed"
    else:
        assert triton_attention.flat_unavailable(cuda, torch.float32, pool) is None
        assert "head size 24" in triton_attention.flat_unavailable(cuda, torch.float32, torch.zeros(4, 16, 2, 24))


def test_splits_fill_the_device_and_a_full_batch_takes_none(monkeypatch):
    """Programs for about two a multiprocessor (an H100 has 132), a power of two, at most 16 a (sequence, KV head);
    `INFERENCE_CORE_ATTENTION_SPLITS` fixes them, and a value that is not a power of two up to 16 is refused."""
    monkeypatch.setattr(gpu, "multiprocessors", lambda device: 132)
    device = torch.device("cuda")
    assert [triton_attention.splits_for(device, batch, 8) for batch in (1, 2, 4, 8, 16, 33, 128)] == [
        16, 16, 8, 4, 2, 1, 1]
    assert triton_attention.splits_for(device, 1, 2) == 16 and triton_attention.splits_for(device, 3, 32) == 2
    for value, splits in (("1", 1), ("4", 4)):
        monkeypatch.setenv("INFERENCE_CORE_ATTENTION_SPLITS", value)
        triton_attention._fixed_splits.cache_clear()
        assert triton_attention.splits_for(device, 1, 8) == splits
    for value in ("3", "32", "x"):
        monkeypatch.setenv("INFERENCE_CORE_ATTENTION_SPLITS", value)
        triton_attention._fixed_splits.cache_clear()
        with pytest.raises(ValueError, match="power of two up to 16"):
            triton_attention.splits_for(device, 1, 8)
    monkeypatch.delenv("INFERENCE_CORE_ATTENTION_SPLITS")
    triton_attention._fixed_splits.cache_clear()


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled step's CUDA tests run the kernel")
@pytest.mark.parametrize("kv_mode", ["contiguous", "paged"])
def test_compiled_step_with_the_kernel_takes_whole_buffers(tmp_path, kv_mode, monkeypatch):
    """CUDA's compiled step (torch.compile, the attention an op the compiler does not look into) with the kernel,
    here on the CPU under Triton's interpreter: the graph takes the bucket's buffers whole, whatever the contexts, so
    one compile serves bucket 1 and one every bucket above it, with no width marked dynamic; ids equal eager's while
    contexts grow through 2 to 16 blocks and batches shrink from 4 to 1."""
    from conftest import compile_as_on_cuda, compiled_matches_eager
    from tiny_models import build_tiny_model

    compiled_module = compile_as_on_cuda(monkeypatch, flat=False)
    widths, call = set(), compiled_module.CompiledDecoder._call_compiled

    def recording_widths(self, bucket, args):
        widths.add(args[3].shape[1])  # the key mask's
        buffers = self._buffers[bucket]  # passed themselves (static inputs), not views of them
        assert args[2] is buffers["read_index"] and args[3] is buffers["key_mask"]
        return call(self, bucket, args)

    monkeypatch.setattr(compiled_module.CompiledDecoder, "_call_compiled", recording_widths)
    compiled, _ = compiled_matches_eager(build_tiny_model(tmp_path), kv_mode=kv_mode, block_size=4, max_num_seqs=4,
                                         max_num_batched_tokens=64, max_seq_len=96)
    decoder = compiled.decoder
    assert decoder.whole_width and not decoder.width_buckets
    assert widths == {96}  # the whole width, every step
    stats = compiled.compile_stats()
    assert stats["recompiles"] == 0 and stats["graphs"] <= 2 and stats["compiled_steps"] > 0


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled step's CUDA tests run the kernel")
def test_compiled_flat_step_with_the_kernel_takes_prompts_and_mixed_steps(tmp_path, monkeypatch):
    """CUDA's flat step (torch.compile, our Triton kernel its attention), here on the CPU under Triton's interpreter:
    prompts in chunks, mixed steps of chunks and decodes, and prompt lookup's verifications run through it with no
    fallback, padded to token buckets by one compile (the token count dynamic), and the ids equal eager's."""
    from conftest import assert_same_or_near_tie, compile_as_on_cuda, compiled_matches_eager
    from tiny_models import build_tiny_model, prompt

    from inference_core import Engine, EngineConfig, SamplingParams
    from inference_core.spec.decoding import SpecConfig

    compiled_module = compile_as_on_cuda(monkeypatch)
    buckets, call = [], compiled_module.CompiledDecoder._call_flat_compiled

    def recording_buckets(self, tokens, args):
        assert args[0].shape[0] == tokens == compiled_module.flat_tokens(tokens) and args[2].shape[1] == self.max_width
        buckets.append(tokens)
        return call(self, tokens, args)

    monkeypatch.setattr(compiled_module.CompiledDecoder, "_call_flat_compiled", recording_buckets)
    tiny = build_tiny_model(tmp_path)
    settings = dict(kv_mode="paged", block_size=4, max_num_seqs=4, max_num_batched_tokens=24, max_seq_len=96)
    compiled, _ = compiled_matches_eager(tiny, **settings)
    stats = compiled.compile_stats()
    assert compiled.decoder.flat_off is None and stats["fallbacks"] == {}
    assert stats["steps_by_bucket"]["flat"] > 0 and len(set(buckets)) > 1
    assert stats["recompiles"] == 0 and stats["graphs"] <= 3  # the decode step's two and the flat step's one
    # Prompt lookup's verifications (a chain of drafts a step) through the same flat step: plain greedy's ids.
    ids, params = prompt(9, 5) * 3, SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = Engine(tiny, EngineConfig(**settings)).complete(ids, params).token_ids
    steps = stats["steps_by_bucket"]["flat"]
    finish = compiled.complete(ids, params, spec=SpecConfig("ngram", k=4, ngram_min=1))
    assert_same_or_near_tie(tiny, ids, want, finish.token_ids)
    assert finish.stats.spec["drafted"] > 0
    stats = compiled.compile_stats()
    assert stats["fallbacks"] == {} and stats["recompiles"] == 0 and stats["steps_by_bucket"]["flat"] > steps + 1


# Run in a process of its own: this module sets TRITON_INTERPRET, under which Triton builds its own library functions
# for the interpreter, and compiling then fails for reasons of the mix, not of the kernel.
COMPILE_FOR_H100 = """
import inspect, sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from inference_core.engine._triton_attention_kernel import attend, attend_flat, combine
from inference_core.engine.triton_attention import CHUNK, FLAT_QUERIES, MAX_SPLITS


def binary(kernel, signature, constants):
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    assert list(signature) == list(inspect.signature(kernel.fn).parameters), "the kernel's arguments changed"
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(list(signature).index(name),): value for name, value in constants.items()})
    return len(compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"])


paged = sys.argv[1] != "contiguous"
pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_pool": "*bf16", "v_pool": "*bf16",
            "index_ptr": "*i32" if paged else "*i64", "mask_ptr": "*i1", "lengths_ptr": "*i64", "out_ptr": "*bf16",
            "part_acc": "*fp32", "part_stats": "*fp32"}
strides = ("q_batch", "q_head", "k_batch", "k_head", "v_batch", "v_head", "block_stride", "position_stride",
           "head_stride", "index_stride", "mask_stride", "out_batch", "out_head", "out_group")
sizes = []
for splits in (1, MAX_SPLITS) if sys.argv[1] != "flat" else ():
    constants = {"GROUP": 4, "GROUP_PAD": 4, "CHUNK": CHUNK, "BLOCK": 16 if paged else 1, "HEAD_DIM": 128,
                 "PAGED": paged, "SPLITS": splits}
    sizes.append(binary(attend, {**pointers, "keys": "i32", "scale": "fp32", **dict.fromkeys(strides, "i64")},
                        constants))
if sys.argv[1] != "flat":
    sizes.append(binary(combine, {"part_acc": "*fp32", "part_stats": "*fp32", "out_ptr": "*bf16", "out_batch": "i64",
                                  "out_head": "i64", "out_group": "i64"},
                        {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "SPLITS": MAX_SPLITS}))
else:  # the flat step's (a paged pool)
    flat_pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "k_pool": "*bf16", "v_pool": "*bf16",
                     "table_ptr": "*i32", "starts_ptr": "*i32", "cached_ptr": "*i32", "positions_ptr": "*i64",
                     "seen_ptr": "*i64", "item_seq_ptr": "*i64", "item_first_ptr": "*i64", "window_ptr": "*i32",
                     "out_ptr": "*fp32"}
    flat_strides = ("q_token", "q_head", "k_token", "k_head", "v_token", "v_head", "block_stride", "position_stride",
                    "head_stride", "table_stride", "out_token", "out_head")
    sizes.append(binary(attend_flat, {**flat_pointers, "scale": "fp32", **dict.fromkeys(flat_strides, "i64")},
                        {"GROUP": 4, "GROUP_PAD": 4, "QUERIES": FLAT_QUERIES, "CHUNK": CHUNK, "BLOCK": 16,
                         "HEAD_DIM": 128, "IEEE": False}))
print(min(sizes))
"""


@needs_triton
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kernel_compiles_for_an_h100(paged):
    """The interpreter runs what compiled Triton refuses (a Python `int()` of a loaded length, say, runs there and
    fails here): the kernels are compiled for an H100 (sm_90) down to their binaries, with no GPU needed, as the
    compiled step calls them for bf16 at head size 128, a group of 4 and block size 16, with one split and with
    the most."""
    _compile_for_an_h100("paged" if paged else "contiguous")


@needs_triton
def test_flat_kernel_compiles_for_an_h100():
    """The flat step's kernel likewise (bf16, head size 128, a group of 4, block size 16), its products in bf16 (which
    the interpreter gets wrong, so the tests above run them in fp32 there)."""
    _compile_for_an_h100("flat")


def _compile_for_an_h100(kernels: str) -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100, kernels], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0  # bytes of the smallest binary
