"""The Triton kernels of `triton_attention` (a module of their own: it imports Triton, which only that module's
callers load, on first use). What they compute and why: `triton_attention`'s docstring."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["keys"])
def attend(q_ptr, k_ptr, v_ptr, k_pool, v_pool, index_ptr, mask_ptr, lengths_ptr, out_ptr, part_acc, part_stats,
           keys, scale, q_batch, q_head, k_batch, k_head, v_batch, v_head, block_stride, position_stride,
           head_stride, index_stride, mask_stride, out_batch, out_head, out_group,
           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
           HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, SPLITS: tl.constexpr):
    """One program per (sequence, KV head, split): the group's query heads against its split of the sequence's
    cached positions [0, min(lengths[seq], keys)), CHUNK at a time (paged: position p lies in block
    read_index[seq, p // BLOCK], at p % BLOCK; contiguous: in slot read_index[seq]), those with a False key mask left
    out; split 0 also takes the own key and value. Each split takes an equal run of whole chunks of the sequence's
    own length (a split past the length takes none). With one split the program writes the output; with more, its
    running max and sum (`part_stats` [B, kv_heads, SPLITS, 2, GROUP_PAD]) and unnormalized sums of values
    (`part_acc` [B, kv_heads, SPLITS, GROUP_PAD, HEAD_DIM]), fp32, for `combine`. Nothing of the block table or the
    mask past the sequence's own length is read."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    lanes = tl.arange(0, CHUNK)
    in_group = groups < GROUP
    q = tl.load(q_ptr + seq * q_batch + (head * GROUP + groups)[:, None] * q_head + dims[None, :],
                mask=in_group[:, None], other=0.0).to(tl.float32)  # [G, D]
    own_k = tl.load(k_ptr + seq * k_batch + head * k_head + dims).to(tl.float32)
    own_v = tl.load(v_ptr + seq * v_batch + head * v_head + dims).to(tl.float32)
    # The online softmax of split 0 starts from the own key: its score is the running max, its weight 1 (so the
    # whole never divides by zero); the other splits start empty.
    first = split == 0
    best = tl.where(first, tl.sum(q * own_k[None, :], axis=1) * scale, float("-inf"))  # [G]
    total = tl.where(first, 1.0, 0.0) + tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.where(first, 1.0, 0.0) * own_v[None, :] + tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if not PAGED:
        slot = tl.load(index_ptr + seq * index_stride).to(tl.int64)
    length = tl.minimum(tl.load(lengths_ptr + seq).to(tl.int32), keys)
    span = tl.cdiv(tl.cdiv(length, SPLITS), CHUNK) * CHUNK
    end = tl.minimum(split * span + span, length)
    for start in range(split * span, end, CHUNK):
        positions = start + lanes
        inside = positions < end
        if PAGED:
            block = tl.load(index_ptr + seq * index_stride + positions // BLOCK, mask=inside, other=0).to(tl.int64)
            rows = block * block_stride + (positions % BLOCK) * position_stride
        else:
            rows = slot * block_stride + positions * position_stride
        keep = inside & (tl.load(mask_ptr + seq * mask_stride + positions, mask=inside, other=0) != 0)
        offsets = rows[:, None] + head * head_stride + dims[None, :]  # [C, D]
        chunk_k = tl.load(k_pool + offsets, mask=keep[:, None], other=0.0).to(tl.float32)
        chunk_v = tl.load(v_pool + offsets, mask=keep[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * chunk_k[None, :, :], axis=2) * scale  # [G, C]
        scores = tl.where(keep[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # A split whose keys so far are all masked has no max yet: subtract 0 there (every weight is exp(-inf) = 0).
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * chunk_v[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + seq * out_batch + head * out_head + groups[:, None] * out_group + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
    else:
        part = (seq * tl.num_programs(1) + head) * SPLITS + split
        tl.store(part_acc + (part * GROUP_PAD + groups[:, None]) * HEAD_DIM + dims[None, :], acc)
        tl.store(part_stats + part * 2 * GROUP_PAD + groups, best)
        tl.store(part_stats + part * 2 * GROUP_PAD + GROUP_PAD + groups, total)


@triton.jit
def combine(part_acc, part_stats, out_ptr, out_batch, out_head, out_group, GROUP: tl.constexpr,
            GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One program per (sequence, KV head): the splits' partial softmaxes (`attend` with SPLITS > 1) rescaled to
    their common max and summed, in fp32. Split 0 holds the own key, so the max is finite and the sum positive."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    parts = (seq * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)  # [S]
    best = tl.load(part_stats + parts[:, None] * 2 * GROUP_PAD + groups[None, :])  # [S, G]
    total = tl.load(part_stats + parts[:, None] * 2 * GROUP_PAD + GROUP_PAD + groups[None, :])
    top = tl.max(best, axis=0)  # [G]
    weights = tl.exp(best - top[None, :])  # an empty split's -inf gives 0
    acc = tl.load(part_acc + (parts[:, None, None] * GROUP_PAD + groups[None, :, None]) * HEAD_DIM
                  + dims[None, None, :])  # [S, G, D]
    out = tl.sum(weights[:, :, None] * acc, axis=0) / tl.sum(weights * total, axis=0)[:, None]
    tl.store(out_ptr + seq * out_batch + head * out_head + groups[:, None] * out_group + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(groups < GROUP)[:, None])


@triton.jit
def attend_flat(q_ptr, k_ptr, v_ptr, k_pool, v_pool, table_ptr, starts_ptr, cached_ptr, seq_ptr, window_ptr, out_ptr,
                scale, q_token, q_head, k_token, k_head, v_token, v_head, block_stride, position_stride, head_stride,
                table_stride, out_token, out_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (new token, KV head) of a flat step: the group's query heads of token t, the u-th new token of
    sequence s = seq_ptr[t] (at position p = cached[s] + u), against its own key, then the sequence's cached keys
    [0, cached[s]) in the pool through its block table, then its earlier new keys (rows [starts[s], t)), CHUNK at a
    time with an online softmax in fp32. A key at position j is seen where no sliding window cuts it: window[0] == 0,
    or j > p - window[0], or j < window[1] (the attention sinks). The output is fp32, [N, heads, d] as `out_token`,
    `out_head` stride it."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    lanes = tl.arange(0, CHUNK)
    in_group = groups < GROUP
    seq = tl.load(seq_ptr + token).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    cached = tl.load(cached_ptr + seq).to(tl.int64)
    new = token - start  # the new tokens before this one
    position = cached + new
    size = tl.load(window_ptr).to(tl.int64)
    sinks = tl.load(window_ptr + 1).to(tl.int64)
    cut_from = tl.where(size > 0, position - size, -1)  # keys at or before it are out of the window
    q = tl.load(q_ptr + token * q_token + (head * GROUP + groups)[:, None] * q_head + dims[None, :],
                mask=in_group[:, None], other=0.0).to(tl.float32)  # [G, D]
    own_k = tl.load(k_ptr + token * k_token + head * k_head + dims).to(tl.float32)
    own_v = tl.load(v_ptr + token * v_token + head * v_head + dims).to(tl.float32)
    # The own key is always seen: the softmax starts from it (its score the running max, its weight 1).
    best = tl.sum(q * own_k[None, :], axis=1) * scale  # [G]
    total = tl.full([GROUP_PAD], 1.0, tl.float32)
    acc = own_v[None, :] + tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Keys before the window (and past the sinks) are skipped a chunk at a time.
    lowest = tl.where(size > 0, tl.maximum(position - size + 1, 0), 0)
    skip = tl.where(sinks > 0, 0, lowest // CHUNK * CHUNK)
    for first in range(skip, position, CHUNK):
        positions = first + lanes
        is_cached = positions < cached
        is_new = (positions >= cached) & (positions < position)
        seen = (is_cached | is_new) & ((positions > cut_from) | (positions < sinks))
        block = tl.load(table_ptr + seq * table_stride + positions // BLOCK, mask=seen & is_cached, other=0)
        pool_rows = block.to(tl.int64) * block_stride + (positions % BLOCK) * position_stride
        pool_at = pool_rows[:, None] + head * head_stride + dims[None, :]  # [C, D]
        rows = start + positions - cached  # a new key's row in the step
        pooled = (seen & is_cached)[:, None]
        fresh = (seen & is_new)[:, None]
        chunk_k = tl.load(k_pool + pool_at, mask=pooled, other=0.0).to(tl.float32) + tl.load(
            k_ptr + rows[:, None] * k_token + head * k_head + dims[None, :], mask=fresh, other=0.0).to(tl.float32)
        chunk_v = tl.load(v_pool + pool_at, mask=pooled, other=0.0).to(tl.float32) + tl.load(
            v_ptr + rows[:, None] * v_token + head * v_head + dims[None, :], mask=fresh, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * chunk_k[None, :, :], axis=2) * scale  # [G, C]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))  # finite: the own key's score is in `best`
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * chunk_v[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + token * out_token + (head * GROUP + groups)[:, None] * out_head + dims[None, :], out,
             mask=in_group[:, None])
