"""The Triton kernel of `triton_attention` (a module of its own: it imports Triton, which only that module's callers
load, on first use). What it computes and why: `triton_attention`'s docstring."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["keys"])
def attend(q_ptr, k_ptr, v_ptr, k_pool, v_pool, index_ptr, mask_ptr, lengths_ptr, out_ptr, keys, scale,
           q_batch, q_head, k_batch, k_head, v_batch, v_head, block_stride, position_stride, head_stride,
           index_stride, mask_stride, out_batch, out_head, out_group,
           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
           HEAD_DIM: tl.constexpr, PAGED: tl.constexpr):
    """One program per (sequence, KV head): the group's query heads against the sequence's cached positions
    [0, min(lengths[seq], keys)), CHUNK at a time (paged: position p lies in block read_index[seq, p // BLOCK], at
    p % BLOCK; contiguous: in slot read_index[seq]), those with a False key mask left out, and the own key and value.
    Nothing of the block table or the mask past the sequence's own length is read."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    groups = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    lanes = tl.arange(0, CHUNK)
    in_group = groups < GROUP
    q = tl.load(q_ptr + seq * q_batch + (head * GROUP + groups)[:, None] * q_head + dims[None, :],
                mask=in_group[:, None], other=0.0).to(tl.float32)  # [G, D]
    own_k = tl.load(k_ptr + seq * k_batch + head * k_head + dims).to(tl.float32)
    own_v = tl.load(v_ptr + seq * v_batch + head * v_head + dims).to(tl.float32)
    # The online softmax starts from the own key: its score is the running max, its weight 1.
    best = tl.sum(q * own_k[None, :], axis=1) * scale  # [G]
    total = tl.full([GROUP_PAD], 1.0, tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + own_v[None, :]
    if not PAGED:
        slot = tl.load(index_ptr + seq * index_stride).to(tl.int64)
    length = tl.minimum(tl.load(lengths_ptr + seq).to(tl.int32), keys)
    for start in range(0, length, CHUNK):
        positions = start + lanes
        inside = positions < length
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
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * chunk_v[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + seq * out_batch + head * out_head + groups[:, None] * out_group + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
