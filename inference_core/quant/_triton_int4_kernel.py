"""The Triton kernel of `triton_int4` (a module of its own: it imports Triton, which only that module's callers load,
on first use). What it computes and why: `triton_int4`'s docstring."""

import triton
import triton.language as tl


@triton.jit
def int4_rows(x_ptr, q_ptr, sz_ptr, out_ptr, M, N, K, x_row, q_row, sz_group, out_row, GROUP: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """One program per (BLOCK_N output features, 1/SPLIT_K of the input features): out[m, n] = sum_k x[m, k] w[n, k]
    for the M (<= BLOCK_M) rows of x, w[n, k] = (q[n, k] - 8) * scale[k // GROUP, n] + zero[k // GROUP, n] in fp32.
    q is two nibbles a byte, [N, K / 2]: input feature 2j in the high nibble of byte j, 2j + 1 in the low one;
    scales and zeros interleaved, [K / GROUP, N, 2]. With one split the program writes bf16 `out`; with more, it adds
    its fp32 partial sums into `out` (zeroed by the caller) atomically."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.arange(0, BLOCK_K // 2)
    rows = tl.arange(0, BLOCK_M)
    feature_ok = features < N
    row_ok = rows < M
    per_split = K // SPLIT_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # A step reads BLOCK_K // GROUP groups whole; an input pair never straddles two (GROUP is even).
    for k0 in range(pid_k * per_split, pid_k * per_split + per_split, BLOCK_K):
        packed = tl.load(q_ptr + features[:, None] * q_row + (k0 // 2 + pairs)[None, :], mask=feature_ok[:, None],
                         other=0)  # [N, K / 2] bytes
        packed = tl.reshape(packed, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2])  # by group
        where = (k0 // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, :] * sz_group + features[:, None] * 2
        scale = tl.load(sz_ptr + where, mask=feature_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        zero = tl.load(sz_ptr + where + 1, mask=feature_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        high = ((packed >> 4).to(tl.float32) - 8.0) * scale + zero  # input features k0 + 2j
        low = ((packed & 15).to(tl.float32) - 8.0) * scale + zero  # k0 + 2j + 1
        high = tl.reshape(high, [BLOCK_N, BLOCK_K // 2])
        low = tl.reshape(low, [BLOCK_N, BLOCK_K // 2])
        columns = rows[:, None] * x_row + (k0 + 2 * pairs)[None, :]
        even = tl.load(x_ptr + columns, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [M, K / 2]
        odd = tl.load(x_ptr + columns + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(even[:, None, :] * high[None, :, :] + odd[:, None, :] * low[None, :, :], axis=2)
    where = rows[:, None] * out_row + features[None, :]
    done = row_ok[:, None] & feature_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + where, acc.to(out_ptr.dtype.element_ty), mask=done)
    else:
        tl.atomic_add(out_ptr + where, acc, mask=done)
