"""The compiled decode step's attention on CUDA as one Triton kernel a layer.

`compiled.decode_attention` (one query per sequence against its cached keys and its own new key, grouped-query heads)
runs as ATen ops elsewhere: a gather of the context out of the KV pool, two casts, two matmuls, a softmax over the
cached and the own score, and the sums around them. Inside a CUDA graph that is about 20 kernels a layer of one or
two microseconds each: on an H100 at Llama-3-8B's shape, batch 1, 47 us a layer and 1.5 ms of an 8.3 ms step
(`docs/benchmarks.md`, "GPU"), where the weights the layer reads take about 170 us. This kernel does the same in one
launch (measured on an H100: 17.8 us a layer at that shape, 146.8 against 120.7 tokens/s): a program per (sequence,
KV head, split) walks its split of the sequence's positions, `CHUNK` at a time, straight from the pool (paged:
through the block table; contiguous: in its slot), scores the group's query heads against each chunk of keys, and
keeps an online softmax in fp32; split 0 starts from the own key (so a sequence with no cached key never divides by
zero), and a split whose keys are all masked subtracts no infinities. With one split (`splits_for`: where the
batch's programs alone fill the device) the program writes the output; with more, a second kernel (`combine`)
rescales the splits' partial sums to their common max and adds them up. The ids are expected to match the ATen ops'
(the sums run in another order: fp32 rounding apart). What the splits buy is for the next GPU run to measure.

`flat_attention` is the flat step's (`query_graph.FlatGraph` on CUDA): the new tokens of several sequences one after
another, any number each (a decode's 1, a verification's k + 1, a prompt chunk), each against its sequence's cached
keys in the paged pool and its new keys up to itself, within a sliding window and beside attention sinks; one
program a (block of 16 new tokens of a sequence, KV head), which reads each key once for its block.

Triton is imported on first use (it comes with torch's CUDA builds); where it is missing, or the layout is one the
kernel does not take (`unsupported`), the ATen ops run. `INFERENCE_CORE_TRITON_ATTENTION=0` keeps the ATen ops (and
the flat step eager; `INFERENCE_CORE_TRITON_FLAT=0` the flat step alone), and
`INFERENCE_CORE_ATTENTION_SPLITS=N` fixes the splits (1: one program a sequence and KV head), for an A/B on one
machine. On the CPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`), which is how
`tests/engine/test_triton_attention.py` checks it against the ATen ops without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

from inference_core import gpu

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLAT_QUERIES = 16  # new tokens of one sequence a program of the flat step's kernel takes
CHUNK = 32  # cached positions a program reads at a time (two blocks of 16: two loads in flight per step of its loop)
# Splits of a sequence's keys (flash-decoding): programs enough for about this many a multiprocessor, at most
# MAX_SPLITS a (sequence, KV head). One program a (sequence, KV head) walks its keys alone, a chunk after the other:
# on an H100 at batch 1 that was 8 programs on 132 multiprocessors, 12-18 us a layer at contexts under 150 keys
# (docs/benchmarks.md, "The fourth H100 run").
PROGRAMS_PER_SM, MAX_SPLITS = 2, 16
# The [group, chunk, head size] products a warp holds (128 a thread); a larger group gets 8 warps instead of 4.
WARP_PRODUCTS = 4096


def enabled() -> bool:
    """Whether the Triton kernel may run at all: asked for (the default) and Triton importable."""
    return os.environ.get("INFERENCE_CORE_TRITON_ATTENTION", "1") != "0" and _triton() is not None


@functools.cache
def _triton():
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # not installed, or a build that does not load: the ATen ops run
        return None
    return triton


def unsupported(dtype: torch.dtype, k_pool: torch.Tensor, paged: bool) -> str | None:
    """Why the kernel cannot take queries of `dtype` over this pool (None: it can). The V pool is laid out as the K
    pool."""
    head_dim = k_pool.shape[-1]
    if k_pool.dtype not in POOL_DTYPES or dtype not in POOL_DTYPES:
        return f"a {k_pool.dtype} KV pool"
    if k_pool.stride(-1) != 1:
        return "a KV pool whose head dimension is not contiguous"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head size {head_dim} (a power of two from 16)"
    if paged and k_pool.shape[1] & (k_pool.shape[1] - 1):
        return f"block size {k_pool.shape[1]} (a power of two)"
    return None


def used(device: torch.device, dtype: torch.dtype, k_pool: torch.Tensor, paged: bool) -> bool:
    """Whether `compiled.decode_attention` runs this kernel for queries of `dtype` over this pool on `device`."""
    return device.type == "cuda" and enabled() and unsupported(dtype, k_pool, paged) is None


def describe(device: torch.device, dtype: torch.dtype, k_pool: torch.Tensor, paged: bool) -> str:
    """Which attention the compiled step runs on CUDA, in words (for its compile stats)."""
    if used(device, dtype, k_pool, paged):
        fixed = _fixed_splits()
        return "attention: one Triton kernel a layer, " + (
            f"{fixed} split(s) a sequence (INFERENCE_CORE_ATTENTION_SPLITS)" if fixed
            else f"keys in up to {MAX_SPLITS} splits")
    if not enabled():
        return "attention: ATen ops (" + ("INFERENCE_CORE_TRITON_ATTENTION=0" if _triton() is not None
                                          else "Triton is not installed") + ")"
    return f"attention: ATen ops (the Triton kernel does not take {unsupported(dtype, k_pool, paged)})"


def splits_for(device: torch.device, batch: int, kv_heads: int) -> int:
    """How many splits each (sequence, KV head)'s keys take: a power of two, 1 where the batch's programs alone fill
    the device (or `INFERENCE_CORE_ATTENTION_SPLITS`)."""
    if _fixed_splits():
        return _fixed_splits()
    wanted = PROGRAMS_PER_SM * gpu.multiprocessors(device) // (batch * kv_heads)
    return 1 if wanted < 2 else min(MAX_SPLITS, 1 << (wanted.bit_length() - 1))


@functools.cache
def _fixed_splits() -> int | None:
    """`INFERENCE_CORE_ATTENTION_SPLITS`, checked (None where unset)."""
    value = os.environ.get("INFERENCE_CORE_ATTENTION_SPLITS")
    if value is None:
        return None
    if not value.isdigit() or int(value) not in {1 << n for n in range(MAX_SPLITS.bit_length())}:
        raise ValueError(f"INFERENCE_CORE_ATTENTION_SPLITS must be a power of two up to {MAX_SPLITS}, got {value!r}")
    return int(value)


def decode_attention(q, k, v, k_pool, v_pool, read_index, key_mask, lengths, scale: float,
                     paged: bool, splits: int | None = None) -> torch.Tensor:
    """The same function as `compiled._attend_one` over `compiled._read_context`, in one kernel launch.
    q: [B, heads, d]; k, v: [B, kv_heads, d]; paged: k_pool, v_pool [blocks, block_size, kv_heads, d] and
    read_index [B, blocks] (the block table); contiguous: k_pool, v_pool [slots, kv_heads, max_len, d] and read_index
    [B] (slots); key_mask [B, keys], True where a cached key is attended; lengths [B]: each sequence's cached
    positions (its position: keys at or past it are never read, whatever the mask and the block table hold there).
    `splits` (a power of two; default `splits_for`): with more than one, each split of a sequence's keys is a
    program of its own, and a second kernel combines their partial softmaxes. Returns [B, kv_heads, group, d] in q's
    dtype."""
    q, k, v = (tensor if tensor.stride(-1) == 1 else tensor.contiguous() for tensor in (q, k, v))
    batch, kv_heads, head_dim = k.shape
    group = q.shape[1] // kv_heads
    group_pad = max(1, 1 << (group - 1).bit_length())
    out = torch.empty(batch, kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
    keys = key_mask.shape[1]
    if paged:  # [blocks, block_size, kv_heads, d]
        block = k_pool.shape[1]
        block_stride, position_stride, head_stride = k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)
    else:  # [slots, kv_heads, max_len, d]
        block = 1
        block_stride, head_stride, position_stride = k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)
    splits = splits_for(q.device, batch, kv_heads) if splits is None else splits
    if splits & (splits - 1) or splits < 1:
        raise ValueError(f"splits must be a power of two, got {splits}")
    if splits > 1:  # the splits' partial softmaxes, fp32
        part_acc = torch.empty(batch, kv_heads, splits, group_pad, head_dim, dtype=torch.float32, device=q.device)
        part_stats = torch.empty(batch, kv_heads, splits, 2, group_pad, dtype=torch.float32, device=q.device)
    else:  # not read
        part_acc = part_stats = out
    attend, combine, _ = _kernels()
    attend[(batch, kv_heads, splits)](
        q, k, v, k_pool, v_pool, read_index, key_mask, lengths, out, part_acc, part_stats, keys, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_stride, position_stride, head_stride, read_index.stride(0), key_mask.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, GROUP_PAD=group_pad, CHUNK=CHUNK, BLOCK=block, HEAD_DIM=head_dim, PAGED=paged, SPLITS=splits,
        num_warps=4 if group_pad * CHUNK * head_dim <= WARP_PRODUCTS * 4 else 8)
    if splits > 1:
        combine[(batch, kv_heads)](part_acc, part_stats, out, out.stride(0), out.stride(1), out.stride(2),
                                   GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, SPLITS=splits)
    return out


def flat_unavailable(device: torch.device, dtype: torch.dtype, k_pool: torch.Tensor) -> str | None:
    """Why `flat_attention` cannot be the flat step's attention for queries of `dtype` over this layer's paged pool on
    `device` (None: it can)."""
    if device.type != "cuda":
        return f"our Triton attention runs on CUDA, not {device.type}"
    if os.environ.get("INFERENCE_CORE_TRITON_FLAT", "1") == "0":
        return "INFERENCE_CORE_TRITON_FLAT=0"
    if not enabled():
        return "INFERENCE_CORE_TRITON_ATTENTION=0" if _triton() is not None else "Triton is not installed"
    reason = unsupported(dtype, k_pool, True)
    return None if reason is None else f"our Triton attention does not take {reason}"


def flat_attention(q, k, v, k_pool, v_pool, table, starts, cached, window, scale: float, positions=None,
                   seen=None) -> torch.Tensor:
    """The flat step's attention (what `model.attention_kernel.attend_flat` computes on the CPU) in one kernel launch:
    N new tokens of S sequences one after another, q [N, heads, d]; k, v [N, kv_heads, d]; k_pool, v_pool one layer's
    [blocks, block_size, kv_heads, d]; table [S, blocks] int32; starts [S + 1] (sequence s's tokens are rows
    [starts[s], starts[s + 1])), cached [S] (its keys in the pool before them); window [2] int32, a sliding window's
    size (0: none) and the attention sinks. Each token sees its own key, its sequence's cached keys and its earlier new
    keys, within the window or among the sinks. Returns fp32 [N, heads, d]. A draft tree's nodes among the tokens
    (`ModelRunner.run_tree`): `positions` [N] int64, each token's position (a node's: its depth's; default: its
    sequence's cached keys and the new tokens before it), and `seen` [N] int64, for a node the bits of the new keys of
    its sequence it sees (bit u: the u-th; its ancestors and itself), 0 for the others (the ones before it).

    A program per (block of FLAT_QUERIES new tokens of one sequence, KV head): a prompt's keys are read once a block,
    not once a query, and scored in matrix products (the tensor cores in bf16); a decode is a block of one token.
    The blocks are laid out here by tensor ops (no host sync), in a grid of N / FLAT_QUERIES + S programs a KV head
    (the most blocks N tokens of S sequences can make: a fixed grid for a CUDA graph), the ones past the step's
    blocks idle."""
    q, k, v = (tensor if tensor.stride(-1) == 1 else tensor.contiguous() for tensor in (q, k, v))
    tokens, kv_heads, head_dim = k.shape
    group = q.shape[1] // kv_heads
    group_pad = max(1, 1 << (group - 1).bit_length())
    out = torch.empty(tokens, q.shape[1], head_dim, dtype=torch.float32, device=q.device)
    # Each sequence's blocks, numbered one after another; an item past them has sequence -1.
    counts = starts[1:].long() - starts[:-1].long()
    blocks = (counts + FLAT_QUERIES - 1) // FLAT_QUERIES
    ends = torch.cumsum(blocks, 0)
    items = tokens // FLAT_QUERIES + len(counts)
    item_seq = torch.searchsorted(ends, torch.arange(items, device=q.device), right=True)
    inside = item_seq.clamp(max=len(counts) - 1)
    item_first = starts[inside].long() + (torch.arange(items, device=q.device) - ends[inside] + blocks[inside]) \
        * FLAT_QUERIES
    item_seq = torch.where(item_seq < len(counts), item_seq, -1)
    table = table if table.stride(-1) == 1 else table.contiguous()
    if positions is None:  # consecutive after each sequence's cached keys
        rows = torch.arange(tokens, device=q.device)
        token_seq = torch.searchsorted(starts[1:].long(), rows, right=True).clamp(max=len(counts) - 1)
        positions = cached.long()[token_seq] + rows - starts.long()[token_seq]
    if seen is None:
        seen = torch.zeros(tokens, dtype=torch.long, device=q.device)
    _, _, flat = _kernels()
    flat[(items, kv_heads)](
        q, k, v, k_pool, v_pool, table, starts, cached, positions, seen, item_seq, item_first, window, out, scale,
        q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_pool.stride(0), k_pool.stride(1),
        k_pool.stride(2), table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, QUERIES=FLAT_QUERIES, CHUNK=CHUNK, BLOCK=k_pool.shape[1],
        HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32 or _interpreted(),
        num_warps=4 if group_pad * FLAT_QUERIES <= 32 else 8)
    return out


def _interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`: the tests on a CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    """The kernels, imported on first use (so that importing this module needs no Triton, and a test can set
    `TRITON_INTERPRET` first)."""
    from inference_core.engine._triton_attention_kernel import attend, attend_flat, combine

    return attend, combine, attend_flat
