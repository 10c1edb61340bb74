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
def attend_flat(q_ptr, k_ptr, v_ptr, k_pool, v_pool, table_ptr, starts_ptr, cached_ptr, positions_ptr, seen_ptr,
                item_seq_ptr, item_first_ptr, window_ptr, out_ptr, scale, q_token, q_head, k_token, k_head, v_token,
                v_head, block_stride, position_stride, head_stride, table_stride, out_token, out_head,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERIES: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    """One program per (block of up to QUERIES new tokens of one sequence, KV head) of a flat step: the block is
    sequence s = item_seq_ptr[item]'s rows [item_first_ptr[item], its end) (s < 0: a program with no work), and its
    rows are the block's tokens by the group's query heads, [QUERIES * GROUP_PAD, d], scored against CHUNK keys at a
    time with two matrix products and an online softmax in fp32 (FlashAttention's): the sequence's cached keys
    [0, cached[s]) from the pool through its block table, then its new keys (rows [starts[s], ...)) up to the block's
    last token. Row r (token t, the sequence's u-th new token, at position p = positions[t]) sees every cached key and
    the new keys before it and its own (u' <= u), or, where seen[t] is not 0 (a draft tree's node), the new keys u'
    whose bit seen[t] >> u' & 1 is set (its ancestors and itself); of those, the ones no sliding window cuts: a key at
    position j is seen where window[0] == 0, or j > p - window[0], or j < window[1] (the attention sinks). A new key's
    position is positions[its row] (a tree's node: its depth's), a cached key's its slot. The keys before the block's
    window (where there are no sinks) are skipped a chunk at a time. `IEEE`: the products in fp32 (an fp32 model's,
    and under Triton's interpreter, whose bf16 products are wrong), else in the inputs' dtype, bf16 or fp16, on the
    tensor cores. The output is fp32, [N, heads, d] as `out_token`, `out_head` stride it."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(item_seq_ptr + item).to(tl.int64)
    busy = seq >= 0
    seq = tl.maximum(seq, 0)
    first = tl.load(item_first_ptr + item).to(tl.int64)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    end = tl.where(busy, tl.load(starts_ptr + seq + 1).to(tl.int64), first)
    cached = tl.load(cached_ptr + seq).to(tl.int64)
    size = tl.load(window_ptr).to(tl.int64)
    sinks = tl.load(window_ptr + 1).to(tl.int64)
    rows = tl.arange(0, QUERIES * GROUP_PAD)
    tokens = first + rows // GROUP_PAD
    groups = rows % GROUP_PAD
    real = (tokens < end) & (groups < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    lanes = tl.arange(0, CHUNK)
    index = tokens - start  # [R] each row's token among its sequence's new ones
    positions = tl.load(positions_ptr + tokens, mask=real, other=0).to(tl.int64)
    bits = tl.load(seen_ptr + tokens, mask=real, other=0).to(tl.int64)
    cut_from = tl.where(size > 0, positions - size, -1)  # keys at or before it are out of the window
    q = tl.load(q_ptr + tokens[:, None] * q_token + (head * GROUP + groups)[:, None] * q_head + dims[None, :],
                mask=real[:, None], other=0.0)  # [R, D]
    if IEEE:
        q = q.to(tl.float32)
    best = tl.full([QUERIES * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([QUERIES * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERIES * GROUP_PAD, HEAD_DIM], tl.float32)
    # The block's last key: its last token's (an idle program's loop is empty).
    last = tl.where(busy, cached + tl.minimum(first + QUERIES, end) - 1 - start, -1)
    nearest = tl.min(tl.where(real, positions, cached + QUERIES + first - start))  # the block's first position
    lowest = tl.where(size > 0, tl.maximum(nearest - size + 1, 0), 0)  # where its window starts
    skip = tl.where(sinks > 0, 0, lowest // CHUNK * CHUNK)
    for key0 in range(skip, last + 1, CHUNK):
        keys = key0 + lanes
        is_cached = keys < cached
        is_new = (keys >= cached) & (keys <= last)
        block = tl.load(table_ptr + seq * table_stride + keys // BLOCK, mask=is_cached, other=0)
        pool_at = (block.to(tl.int64) * block_stride + (keys % BLOCK) * position_stride)[:, None] \
            + head * head_stride + dims[None, :]  # [C, D]
        new_index = tl.maximum(keys - cached, 0)  # a cached key's: not read
        new_rows = start + new_index
        pooled = is_cached[:, None]
        chunk_k = tl.where(pooled, tl.load(k_pool + pool_at, mask=pooled, other=0.0).to(q.dtype), tl.load(
            k_ptr + new_rows[:, None] * k_token + head * k_head + dims[None, :], mask=is_new[:, None],
            other=0.0).to(q.dtype))
        chunk_v = tl.where(pooled, tl.load(v_pool + pool_at, mask=pooled, other=0.0).to(q.dtype), tl.load(
            v_ptr + new_rows[:, None] * v_token + head * v_head + dims[None, :], mask=is_new[:, None],
            other=0.0).to(q.dtype))
        if IEEE:
            scores = tl.dot(q, tl.trans(chunk_k), input_precision="ieee") * scale  # [R, C]
        else:
            scores = tl.dot(q, tl.trans(chunk_k)) * scale
        key_positions = tl.where(is_cached, keys, tl.load(positions_ptr + new_rows, mask=is_new, other=0))
        ancestor = ((bits[:, None] >> tl.minimum(new_index, 63)[None, :]) & 1) != 0
        before = tl.where(bits[:, None] != 0, ancestor, new_index[None, :] <= index[:, None])
        seen = ((is_cached[None, :] | (is_new[None, :] & before))
                & ((key_positions[None, :] > cut_from[:, None]) | (key_positions[None, :] < sinks)))
        scores = tl.where(seen, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # A row with no key seen yet (a padding row, or keys before its window) subtracts 0: its weights are 0.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights, chunk_v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(chunk_v.dtype), chunk_v)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * out_token + (head * GROUP + groups)[:, None] * out_head + dims[None, :], out,
             mask=real[:, None])
