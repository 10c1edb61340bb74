"""Our kernel for the compiled decode step's projections on an AVX-512 or AVX2 CPU: y = x W^T for a few rows of x, with
W in bf16, in int8 with a scale per output feature (`quant.linear.QuantLinear`'s int8 scheme), or, on AVX-512 with
BF16 dot products, in int4 with a scale and zero per group (its int4 scheme, tinygemm's numbers).

A decode step multiplies one row (a few, batched) by every weight matrix, so its time is the time to stream the
weights from memory. Inductor's C++ GEMM template and oneDNN, which the compiled step otherwise uses for these
projections, read them well below the rate a plain pass over the same bytes reaches on the 2-core AVX-512 host
(measured in one process, 30 weights of [3072, 576]: 25-28 GB/s for the template against 29-32 for a sum of them at
quiet moments, 36-38 against 52-64 at the moments the host's memory gives more), while the loop here keeps up with
the sum at both (docs/benchmarks.md, "Our kernel for the decode projections").

The loop: the weight packed once into blocks of 48 output features, [blocks, in, 48] (`pack`), so that each block is
one contiguous run of memory; the threads walk the two halves of the blocks side by side, a pair (a block of each) at
a time, two threads from the two ends of a range until they meet (two streams from memory in flight per thread: over
the step's 121 weight shapes, 67.9 against 58.1 GB/s for one stream at moments the Zen 5 host's memory gives about
80, +3% at moments it gives about 50; no thread waits for a slower one at the end);
per input feature, 48 weights widened to fp32 (bf16 by a shift, int8 by a sign extension and a conversion) and one
fused multiply-add per input row into fp32 accumulators, rounded to bf16 at the end (int8: after the scale). The sums
are F.linear's (int8: `_weight_int8pack_mm`'s) in another order. Up to `MAX_ROWS` input rows share one read of the
weight from memory: rows past what one pass's registers hold (4 on AVX-512, 1 on AVX2, over two blocks) take turns
with the first pass over runs of 64 input features, which they then find in L1 (`blocks_rows`). On the 2-vCPU Intel
host the step's bf16 weights with 5 rows (a speculative chain of 4 drafts verified) then cost 1.3-1.5x one row, where
a second pass over each block cost 1.7x; past about 10 rows ATen's bf16 matmul (oneDNN), flat at about 2.4x one row up
to 16 rows there, is the faster (docs/benchmarks.md, "Compiled, each draft length").

Where the CPU has AVX-512 with BF16 (`pairs_form`), bf16 weights are packed in pairs instead (`pack_pairs`: [blocks,
in / 2, 96], each output feature's weights for two neighbouring input features side by side), the layout of BF16 dot
products: the loop then multiplies 16 output features' pairs by a pair of x in one vdpbf16ps, and, where the CPU also
has AMX and the kernel grants this process its tiles, rows from `amx_rows` up (measured per machine: `measure_amx`)
run as AMX tiles, [rows, 32] of x by [32, 16] of the weight in one tdpbf16ps, read straight from the same layout. Up
to 16 rows then cost about what one does (the weights' read from memory): on the 2-vCPU Intel host over the step's
121 weight shapes, 5 rows 0.99-1.12x one row's time and 16 rows 1.19x, against 1.39-1.51x and 3.6x for the loop and
2.5-2.9x for oneDNN; the compiled 5-token verification step took 14.6 ms against the loop's 17.3 and the decode
step's 10.0 (docs/benchmarks.md, "AMX for a verification's rows"). Without AMX, more rows than one pass over two
blocks holds walk one block at a time, 8 rows a pass (`wide`), so that each block's read from memory overlaps the dot
products of all of its rows: on the 2-vCPU Zen 4 host 8 rows then cost about one row's time. So the pairs form takes
up to PAIRS_MAX_ROWS rows (`max_rows`).

How many streams a thread walks (two, or four on AVX-512) and whether the loop asks for each stream's weights some
bytes ahead (software prefetch) is the host's `tuning`, chosen by measurement once per machine (`measure_tuning`, kept
beside the build) and changing no bit of any result: on a 2-vCPU Intel host with AMX, where one core reads at most
13 GB/s, four streams prefetched 1 KB ahead made the bf16 step 1.15x as fast; on the AMD hosts prefetching lost.

The build takes the CPU's widest vectors (`FLAGS`): AVX-512 (three 16-lane vectors a block's row, four input rows a
pass over two blocks) or AVX2 with FMA (six 8-lane vectors; its 16 registers hold one row's sums for two blocks, or
two rows' for one block). Measured per host (docs/benchmarks.md): on the AVX-512 Zen 5 host the bf16 form decodes at
about twice the rate of inductor's matmuls and an int8 form lost to inductor's int8 template (0.93x); on an AVX2 Zen
3 host the bf16 form is 1.22-1.26x inductor's matmuls and the int8 form 1.06-1.17x its template. So the bf16 form runs
wherever the build does, the int8 form on AVX2 and on AVX-512 hosts whose `tuning` took more streams or a prefetch
(`int8_form`); `EngineConfig(row_kernel=False)` (bench's `+inductor-mm`) keeps inductor's for all three.

The int4 form (`pack_int4`, `int4_form`) turns each nibble into the bf16 number 128 + q with one AND-OR and multiplies
32 of them by x's bf16 pairs in one vdpbf16ps, the group's scale and zero applied once per group: on the 2-vCPU Intel
host it read the step's int4 weights at 20 GB/s where tinygemm read them at 14.6, and the compiled int4 step with 8
steps a call decoded 1.21x inductor's int4 template (258.6 against 214.9 tok/s, 12 of 12 pairs).

They are torch custom ops, `torch.ops.inference_core.linear_rows(x, packed, out_features)`, `linear_rows_int8(x,
packed, scales, out_features)` and `linear_rows_int4(x, packed, group_size, out_features)`, built from the C++ below
the first time they are needed (about 35 s on the 2-core host, once per machine: the build is kept in the local
cache) with the compiler inductor uses anyway (and ninja, a pinned requirement). `tracing(True)` around an export
makes `model.llama.Linear` and `QuantLinear` call them for inputs they take (`takes`, `takes_int4`); the pack is
then part of the graph, on a weight that freezing made a constant, so the compiler folds it into the package once.
Where they cannot run (neither AVX-512 nor AVX2, not bf16 activations, more rows, a failed build: `unavailable`),
the projection stays `F.linear` (or ATen's int8 or int4 kernel), whose kernels inductor picks itself.

The same build holds our paged attention op (`model.attention_kernel`) and the host's work between compiled greedy
steps (`model.step_kernel`), the int4 KV cache's read (`model.kv_kernel`), int4 weights by int8 activations
(`model.w4a8_kernel`) and the flat step's MLP activation (`model.mlp_kernel`): one extension, one build, one
`unavailable`.
A compiled package calls each of our ops as a C function (`SHIMS`, `c_shims`), not through AOTInductor's proxy executor.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from inference_core.model import attention_kernel, kv_kernel, mlp_kernel, step_kernel, w4a8_kernel
from inference_core.model.paths import cache_root

BLOCK = 48  # output features per packed block (three 16-lane fp32 vectors, or six 8-lane ones)
MAX_ROWS = 8  # input rows the op takes; a batch above it uses inductor's matmul (compute, not memory, then matters)
PAIRS_MAX_ROWS = 16  # ... bf16 weights in pairs (`max_rows`): one AMX tile's rows, or two of the loop's wide passes
WIDE_ROWS = 8  # rows one wide pass over a block of pairs takes (the loop's WIDE_ROWS: `rows_at_one_row_cost`)
AMX_CANDIDATE_ROWS = (2, 3, 4, 6, 8)  # row counts `measure_amx` times both forms at

SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 48;

// The vector ISA the build's flags select (`FLAGS`): AVX-512, 16 fp32 lanes in 32 registers, or AVX2 with FMA, 8
// lanes in 16. The loops below are written once over `vec`; their sums are the same on both (fp32, in k's order).
#if defined(__AVX512F__)
using vec = __m512;
constexpr int LANES = 16;
constexpr int64_t ROWS_TWO = 4;  // input rows a pass over two blocks (two streams) computes: 24 accumulators
constexpr int64_t ROWS_ONE = 4;  // ... over one block
constexpr int64_t ROWS_FOUR = 2;  // ... over four blocks (four streams): 24 accumulators
constexpr int64_t TWO_STREAMS_UP_TO = 8;  // batches of at most this many rows walk two streams per thread
constexpr int64_t MAX_STREAMS = 4;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline vec widen(const uint16_t* p) {  // 16 bf16 -> 16 fp32: a bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vec widen(const int8_t* p) {  // 16 int8 -> 16 fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
using vec = __m256;
constexpr int LANES = 8;
constexpr int64_t ROWS_TWO = 1;  // 12 accumulators of 16 registers
constexpr int64_t ROWS_ONE = 2;
constexpr int64_t ROWS_FOUR = 1;  // (unused: four blocks' sums are 24 accumulators)
constexpr int64_t TWO_STREAMS_UP_TO = 1;  // more rows: one stream, two rows a pass (each block widened half as often)
constexpr int64_t MAX_STREAMS = 2;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline vec widen(const uint16_t* p) {  // 8 bf16 -> 8 fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec widen(const int8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
constexpr int NV = BLOCK / LANES;  // vectors a block's row of 48 output features is
// Input features a run of `blocks_rows` covers when several passes share the blocks: 64 rows of a block are 6 KB
// (bf16), two streams' 12 KB, well inside L1.
constexpr int64_t CARRY_RUN = 64;

// The host's tuning (`row_kernel.tuning`, chosen by measurement once per machine) for each form of the loop (0: bf16
// and int8 weights, 1: int4): streams from memory per thread for one row (2, or 4 where MAX_STREAMS allows), and how
// many bytes ahead of each stream the loop asks for the weights (0: no software prefetch). Neither changes a sum: each
// output feature's sum runs over k in order either way.
std::atomic<int64_t> g_streams[2] = {2, 2};
std::atomic<int64_t> g_prefetch[2] = {0, 0};

// A pass's sums [S][R][NV] as a run of input features starts: the carried ones (`carried`: after the first run),
// else 0.
template <int S, int R>
inline void start_sums(vec (&acc)[S][R][NV], const float* carry, bool carried) {
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[s][r][j] = carried ? vloadu(carry + (s * R + r) * BLOCK + LANES * j) : vzero();
}

// ... as it ends: back to `carry` where more runs follow (`last` false), else rounded to bf16 into the output (times
// `scales` per output feature where given).
template <int S, int R>
inline void finish_sums(vec (&acc)[S][R][NV], float* carry, bool last, const float* scales, at::BFloat16* out,
                        int64_t N, const int64_t* n0) {
  if (!last) {
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) vstore(carry + (s * R + r) * BLOCK + LANES * j, acc[s][r][j]);
    return;
  }
  for (int s = 0; s < S; ++s) {
    const int64_t cols = std::min<int64_t>(BLOCK, N - n0[s]);
    for (int r = 0; r < R; ++r) {
      alignas(64) float sums[BLOCK];
      for (int j = 0; j < NV; ++j) vstore(sums + LANES * j, acc[s][r][j]);
      if (scales)
        for (int64_t c = 0; c < cols; ++c) out[r * N + n0[s] + c] = at::BFloat16(sums[c] * scales[n0[s] + c]);
      else
        for (int64_t c = 0; c < cols; ++c) out[r * N + n0[s] + c] = at::BFloat16(sums[c]);
    }
  }
}

// R input rows against S blocks at once (S streams of the weight in flight per thread: at moments the host's memory
// gives more, two streams read 91-96 GB/s where one read 66-79, measured on one 270 MB weight). T: the weight's
// elements, bf16 (as uint16_t) or int8; `scales` (int8: one per output feature, applied to the sums; bf16: null).
// Over input features [k0, k1): with `carry` (the rows' sums [S][R][BLOCK] between runs of k, when more rows than
// one pass holds take turns over the blocks: `blocks_rows`) the sums start from it after the first run and go back to
// it before the last; the last run (k1 = K) writes the output.
template <int R, int S, bool PF, typename T>
void block_rows(const float* x, int64_t K, int64_t k0, int64_t k1, const T* const* w, const float* scales,
                at::BFloat16* out, int64_t N, const int64_t* n0, int64_t pf, float* carry) {
  vec acc[S][R][NV];
  start_sums<S, R>(acc, carry, carry && k0);
  for (int64_t k = k0; k < k1; ++k) {
    vec a[R];
    for (int r = 0; r < R; ++r) a[r] = vset1(x[r * K + k]);
    for (int s = 0; s < S; ++s) {
      const T* row = w[s] + k * BLOCK;
      if constexpr (PF) {  // the lines `pf` bytes ahead of this stream (prefetches never fault past the end)
        _mm_prefetch(reinterpret_cast<const char*>(row) + pf, _MM_HINT_T0);
        if constexpr (sizeof(T) * BLOCK > 64) _mm_prefetch(reinterpret_cast<const char*>(row) + pf + 64, _MM_HINT_T0);
      }
      for (int j = 0; j < NV; ++j) {
        const vec wj = widen(row + LANES * j);
        for (int r = 0; r < R; ++r) acc[s][r][j] = vfma(a[r], wj, acc[s][r][j]);
      }
    }
  }
  finish_sums<S, R>(acc, carry, !(carry && k1 < K), scales, out, N, n0);
}

// Every row of M, R at a time: `pass(m, r, pf)` for the rows from m, with r = min(R, M - m) and pf = whether to
// prefetch as compile-time constants (std::integral_constant, std::bool_constant), so that a pass's accumulators stay
// registers.
template <int R, class Pass>
void row_passes(int64_t M, bool pf, const Pass& pass) {
  for (int64_t m = 0; m < M; m += R) {
    if constexpr (R > 1) {
      if (M - m < R) return row_passes<R - 1>(M - m, pf, [&](int64_t from, auto r, auto p) { pass(m + from, r, p); });
    }
    if (pf)
      pass(m, std::integral_constant<int, R>(), std::true_type());
    else
      pass(m, std::integral_constant<int, R>(), std::false_type());
  }
}

// Every row of M against one set of S blocks: `pass(m, rows, prefetch, k0, k1, carry)` for the rows from m over the
// input positions [k0, k1) of K (rows and prefetch compile-time constants, as `row_passes` gives them). More rows than
// a pass's registers hold (ROWS): the passes take turns over runs of `run` positions, so that the blocks come from
// memory once (the first pass's; the others find the run in L1) instead of once a pass. Each sum still runs over k in
// order, carried in fp32 between runs: the same bits as whole passes (what it saves: the module docstring).
template <int ROWS, class Pass>
void take_rows(int64_t M, int64_t K, int64_t run, int64_t S, bool pf, const Pass& pass) {
  if (M <= ROWS) {
    row_passes<ROWS>(M, pf, [&](int64_t m, auto rows, auto prefetch) { pass(m, rows, prefetch, 0, K, nullptr); });
    return;
  }
  std::vector<float> carry(M * S * BLOCK);
  for (int64_t k0 = 0; k0 < K; k0 += run) {
    const int64_t k1 = std::min(K, k0 + run);
    row_passes<ROWS>(M, pf, [&](int64_t m, auto rows, auto prefetch) {
      float* sums = carry.data() + m * S * BLOCK;
      if (m == 0)  // the run's first pass reads it from memory: it alone asks for what comes next
        pass(m, rows, prefetch, k0, k1, sums);
      else
        pass(m, rows, std::false_type(), k0, k1, sums);
    });
  }
}

template <int S>
constexpr int rows_a_pass() { return S == 4 ? ROWS_FOUR : S == 2 ? ROWS_TWO : ROWS_ONE; }

template <int S, typename T>
void blocks_rows(const float* x, int64_t M, int64_t K, const T* const* w, const float* scales, at::BFloat16* out,
                 int64_t N, const int64_t* n0, int64_t pf) {
  take_rows<rows_a_pass<S>()>(M, K, CARRY_RUN, S, pf, [&](int64_t m, auto rows, auto prefetch, int64_t k0,
                                                          int64_t k1, float* carry) {
    block_rows<decltype(rows)::value, S, decltype(prefetch)::value>(x + m * K, K, k0, k1, w, scales, out + m * N, N,
                                                                    n0, pf, carry);
  });
}

// Walks a weight's blocks over the threads: `run(S, b)` computes every row against blocks b[0..S) (S streams of the
// weight in flight per thread; `S` a std::integral_constant), each block once: one at a time where `alone`, else two,
// or four where `four` (the rows fit four streams' sums) and the host's tuning of the loop's `form` asks for them.
template <class Run>
void walk_blocks(bool alone, int64_t blocks, bool four, int form, const Run& run) {
  if (alone) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) run(std::integral_constant<int, 1>(), &b);
    });
    return;
  }
  // S streams a thread: block c of a range's first part beside block c of each other part (S parts). No thread's share
  // is fixed in advance. With fixed halves, the bundled model's bf16 step on the 2-core AVX2 host spent 8-15% of each
  // op's time with one thread done and the other still reading (which thread varied from run to run); taken as they
  // come free, the step decoded 1.004x and 1.032x as fast (two runs of 30-40 alternating pairs). Each two threads
  // share a range (ranges in proportion to their threads), one taking pairs from its front and the other from its back
  // until they meet; a thread without a partner takes its range alone. Which thread computes a block changes none of
  // its sums.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks / 2));
  const int64_t ranges = (threads + 1) / 2;
  // Four streams where the host's tuning asks for them, for rows they hold, and where each range has at least 8 sets
  // of four blocks (fewer, and the two threads' shares of a small weight part unevenly); else two.
  const int64_t wanted = four ? std::min(g_streams[form].load(std::memory_order_relaxed), MAX_STREAMS) : 2;
  const int64_t S = wanted == 4 && blocks / ranges >= 32 ? 4 : 2;
  std::unique_ptr<std::atomic<int64_t>[]> claimed(new std::atomic<int64_t>[ranges]);
  for (int64_t r = 0; r < ranges; ++r) claimed[r].store(0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / 2, b0 = blocks * 2 * r / threads, b1 = blocks * std::min(2 * r + 2, threads) / threads;
      const int64_t part = (b1 - b0) / S;
      const bool back = t % 2 == 1, alone = (t ^ 1) >= threads;
      for (int64_t i = 0; claimed[r].fetch_add(1, std::memory_order_relaxed) < part; ++i) {
        const int64_t c = b0 + (back ? part - 1 - i : i);
        int64_t b[4];
        for (int64_t s = 0; s < S; ++s) b[s] = c + s * part;
        if (S == 4)
          run(std::integral_constant<int, MAX_STREAMS>(), b);
        else
          run(std::integral_constant<int, 2>(), b);
      }
      for (int64_t b = b0 + S * part; b < b1 && (back || alone); ++b)  // the range's last (b1 - b0) % S blocks
        run(std::integral_constant<int, 1>(), &b);
    }
  });
}

// x [M, K] bf16 by the packed weight [blocks, K, 48] (bf16, or int8 with fp32 scales [N]) -> [M, N] bf16.
template <typename T>
at::Tensor rows_by_blocks(const at::Tensor& x, const T* wp, const float* scales, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const auto xc = x.contiguous();
  std::vector<float> xf(M * K);
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  auto out = at::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t pf = g_prefetch[0].load(std::memory_order_relaxed);
  // More rows than two streams' passes take: each block alone (AVX2's registers hold two rows of one block, not of
  // two).
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  walk_blocks(M > TWO_STREAMS_UP_TO, blocks, M <= ROWS_FOUR, 0, [&](auto streams, const int64_t* b) {
    constexpr int S = decltype(streams)::value;
    int64_t n0[S];
    const T* w[S];
    for (int s = 0; s < S; ++s) {
      n0[s] = b[s] * BLOCK;
      w[s] = wp + b[s] * K * BLOCK;
    }
    blocks_rows<S>(xf.data(), M, K, w, scales, op, N, n0, pf);
  });
  return out;
}

std::atomic<int64_t> g_amx_from{2};  // the fewest rows that take the AMX form where it is usable (0: never)

// int4 weights (`pack_int4`: tinygemm's numbers, w = (q - 8) * scale + zero, a bf16 scale and zero per group of G
// input features and output feature), on AVX-512 with BF16 dot products. Each block of 48 output features holds, per
// group, G / 8 octets of three 64-byte vectors and then the group's 48 scales and 48 zeros (bf16): in vector j of
// octet o, lane i (output 16j + i) is two 16-bit words t = 0, 1 whose nibble h is q for input feature 8o + 2h + t.
// A nibble masked out of its word and or-ed with 0x4300 is the bf16 number 128 + q (exact: bf16 holds 8 bits), so
// one AND-OR (vpternlog) per four-nibble step makes 32 bf16 weights, and one vdpbf16ps multiplies them by the
// matching pairs of x (bf16, exact products, fp32 sums). Per group: gsum = sum x (128 + q); the output gains
// scale * gsum + (zero - 136 scale) * sum x, which is sum x ((q - 8) scale + zero).
#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// bf16 weights in pairs (`pack_pairs`: [blocks, K / 2, 96], each output feature's weights for input features 2p and
// 2p + 1 side by side), where the CPU has BF16 dot products: one vdpbf16ps multiplies 16 output features' pairs by a
// pair of x (bf16, as the activations are: exact products, fp32 sums), where the widening form spends a shift and two
// fused multiply-adds. Half the instructions a row, which is what each row past the first costs once the weights
// come from memory anyway (a verification's rows: the module docstring).
template <int R, int S, bool PF>
void pair_block_rows(const uint32_t* x, int64_t K2, int64_t p0, int64_t p1, const uint16_t* const* w,
                     at::BFloat16* out, int64_t N, const int64_t* n0, int64_t pf, float* carry) {
  vec acc[S][R][NV];
  start_sums<S, R>(acc, carry, carry && p0);
  for (int64_t p = p0; p < p1; ++p) {
    __m512i a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_set1_epi32(static_cast<int32_t>(x[r * K2 + p]));
    for (int s = 0; s < S; ++s) {
      const uint16_t* row = w[s] + p * 2 * BLOCK;
      if constexpr (PF) {
        const char* c = reinterpret_cast<const char*>(row) + pf;
        _mm_prefetch(c, _MM_HINT_T0);
        _mm_prefetch(c + 64, _MM_HINT_T0);
        _mm_prefetch(c + 128, _MM_HINT_T0);
      }
      for (int j = 0; j < NV; ++j) {
        const __m512bh wj = (__m512bh)_mm512_loadu_si512(row + 32 * j);
        for (int r = 0; r < R; ++r) acc[s][r][j] = _mm512_dpbf16_ps(acc[s][r][j], (__m512bh)a[r], wj);
      }
    }
  }
  finish_sums<S, R>(acc, carry, !(carry && p1 < K2), nullptr, out, N, n0);
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// The same layout through AMX, where the CPU has it and the kernel lets this process use it (`amx_usable`): per 32
// input features one tile of x's rows (A, [M, 32] bf16) and, per 16 output features, one of the weights (B: the
// pairs of 16 consecutive p, a 64-byte run every 192 bytes), multiplied into fp32 tiles (C, [M, 16]) by one
// tdpbf16ps each. One tdpbf16ps does the work of 16 vdpbf16ps a row, so up to 16 rows cost about what one does: the
// time is the weights' read from memory. Tiles: C for each (stream, vector) in 0..5, A in 6, B in 7 (S <= 2).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_a_row[16] = {};
  uint8_t rows[16] = {};
};

bool amx_usable() {  // the CPU's AMX with BF16, and the kernel's permission for this process's tile data
  static const bool usable = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                             syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return usable;
}

template <int S, bool PF>
void amx_block_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint16_t* const* w, at::BFloat16* out,
                    int64_t N, const int64_t* n0, int64_t pf) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t == 7 ? 16 : static_cast<uint8_t>(M);
    config.bytes_a_row[t] = 64;
  }
  _tile_loadconfig(&config);
  _tile_zero(0); _tile_zero(1); _tile_zero(2);
  if constexpr (S == 2) { _tile_zero(3); _tile_zero(4); _tile_zero(5); }
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, x + k, K * 2);
    const uint16_t* b0 = w[0] + k * BLOCK;  // pair k / 2 of the block: 96 bf16 a pair
    if constexpr (PF) {
      for (int64_t off = 0; off < 16 * 192; off += 64) _mm_prefetch(reinterpret_cast<const char*>(b0) + pf + off,
                                                                     _MM_HINT_T0);
    }
    _tile_loadd(7, b0, 192); _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, b0 + 32, 192); _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, b0 + 64, 192); _tile_dpbf16ps(2, 6, 7);
    if constexpr (S == 2) {
      const uint16_t* b1 = w[1] + k * BLOCK;
      if constexpr (PF) {
        for (int64_t off = 0; off < 16 * 192; off += 64) _mm_prefetch(reinterpret_cast<const char*>(b1) + pf + off,
                                                                       _MM_HINT_T0);
      }
      _tile_loadd(7, b1, 192); _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(7, b1 + 32, 192); _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, b1 + 64, 192); _tile_dpbf16ps(5, 6, 7);
    }
  }
  alignas(64) float sums[2][16][BLOCK];  // [stream][row][output feature]
  _tile_stored(0, &sums[0][0][0], BLOCK * 4); _tile_stored(1, &sums[0][0][16], BLOCK * 4);
  _tile_stored(2, &sums[0][0][32], BLOCK * 4);
  if constexpr (S == 2) {
    _tile_stored(3, &sums[1][0][0], BLOCK * 4); _tile_stored(4, &sums[1][0][16], BLOCK * 4);
    _tile_stored(5, &sums[1][0][32], BLOCK * 4);
  }
  _tile_release();
  for (int s = 0; s < S; ++s) {
    const int64_t cols = std::min<int64_t>(BLOCK, N - n0[s]);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < cols; ++c) out[r * N + n0[s] + c] = at::BFloat16(sums[s][r][c]);
  }
}
#pragma GCC pop_options

constexpr int WIDE_ROWS = 8;  // rows a pass over one block of pairs computes when more than ROWS_TWO come

// x [M, K] bf16 by the pair-packed weight [blocks, K / 2, 96] -> [M, N] bf16.
at::Tensor pair_rows_by_blocks(const at::Tensor& x, const uint16_t* wp, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), K2 = K / 2;
  const auto xc = x.contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  auto out = at::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t pf = g_prefetch[0].load(std::memory_order_relaxed);
  const int64_t amx_from = g_amx_from.load(std::memory_order_relaxed);
  const bool amx = amx_from > 0 && M >= amx_from && M <= 16 && K % 32 == 0 && amx_usable();
  // More rows than a pass over two blocks holds (`wide`): each block alone, WIDE_ROWS rows a pass (24 sums; x's
  // pairs broadcast from memory). Each block then comes from memory while all of its rows are multiplied, where passes
  // over two blocks took turns over runs of them (`take_rows`), memory idle while the later passes ran from L1: on
  // the 2-vCPU Zen 4 host over the step's 120 layer weights, 8 rows then cost 1.00x one row's time against 1.31x,
  // 6 rows 0.97x against 1.11x, 16 rows (two passes) 1.97x (docs/benchmarks.md, "Eight rows for the price of one").
  const bool wide = !amx && M > ROWS_TWO;
  walk_blocks(wide, (N + BLOCK - 1) / BLOCK, !amx && M <= ROWS_FOUR, 0,  // AMX: two streams
              [&](auto streams, const int64_t* b) {
    constexpr int S = decltype(streams)::value;
    int64_t n0[S];
    const uint16_t* w[S];
    for (int s = 0; s < S; ++s) {
      n0[s] = b[s] * BLOCK;
      w[s] = wp + b[s] * K * BLOCK;
    }
    if (amx) {
      if constexpr (S <= 2) {
        if (pf)
          amx_block_rows<S, true>(xc.data_ptr<at::BFloat16>(), M, K, w, op, N, n0, pf);
        else
          amx_block_rows<S, false>(xc.data_ptr<at::BFloat16>(), M, K, w, op, N, n0, pf);
      }
      return;
    }
    // One stream: the wide passes (`wide`, the blocks walked alone); else a pass's rows over two or four blocks.
    constexpr int ROWS = S == 1 ? WIDE_ROWS : rows_a_pass<S>();
    take_rows<ROWS>(M, K2, CARRY_RUN / 2, S, pf, [&](int64_t m, auto rows, auto prefetch, int64_t p0, int64_t p1,
                                                     float* carry) {
      pair_block_rows<decltype(rows)::value, S, decltype(prefetch)::value>(xp + m * K2, K2, p0, p1, w, op + m * N, N,
                                                                           n0, pf, carry);
    });
  });
  return out;
}

constexpr int INT4_ROWS = 2;  // input rows a pass computes (S = 4 streams: one)

template <int R, int S, bool PF>
void int4_block_rows(const uint16_t* x, const float* xsum, int64_t K, int64_t G, const uint8_t* const* w,
                     at::BFloat16* out, int64_t N, const int64_t* n0, int64_t pf) {
  const int64_t groups = K / G, octets = G / 8, stride = octets * 192 + 192;
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const __m512 b136 = _mm512_set1_ps(136.0f);
  alignas(64) float acc[S][R][BLOCK] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[S][R][NV];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) gacc[s][r][j] = _mm512_setzero_ps();
    for (int64_t o = 0; o < octets; ++o) {
      const int64_t k = g * G + 8 * o;
      __m512i xp[R][4];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 4; ++h) {
          int32_t pair;
          std::memcpy(&pair, x + r * K + k + 2 * h, sizeof(pair));
          xp[r][h] = _mm512_set1_epi32(pair);
        }
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = w[s] + g * stride + o * 192;
        if constexpr (PF) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + pf, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p) + pf + 64, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p) + pf + 128, _MM_HINT_T0);
        }
        for (int j = 0; j < NV; ++j) {
          const __m512i words = _mm512_loadu_si512(p + 64 * j);
          for (int h = 0; h < 4; ++h) {
            const __m512i shifted = h ? _mm512_srli_epi16(words, 4 * h) : words;
            const __m512bh wv = (__m512bh)_mm512_ternarylogic_epi32(shifted, low4, bias, 0xEA);  // (a & b) | c
            for (int r = 0; r < R; ++r) gacc[s][r][j] = _mm512_dpbf16_ps(gacc[s][r][j], (__m512bh)xp[r][h], wv);
          }
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const uint16_t* scale = reinterpret_cast<const uint16_t*>(w[s] + g * stride + octets * 192);
      for (int j = 0; j < NV; ++j) {
        const __m512 sc = widen(scale + 16 * j), offset = _mm512_fnmadd_ps(b136, sc, widen(scale + BLOCK + 16 * j));
        for (int r = 0; r < R; ++r) {
          float* a = acc[s][r] + 16 * j;
          const __m512 sum = _mm512_fmadd_ps(sc, gacc[s][r][j], _mm512_load_ps(a));
          _mm512_store_ps(a, _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), sum));
        }
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t cols = std::min<int64_t>(BLOCK, N - n0[s]);
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) out[r * N + n0[s] + c] = at::BFloat16(acc[s][r][c]);
  }
}

// x [M, K] bf16 by the packed int4 weight [blocks, K / G, G / 8 * 192 + 192] bytes -> [M, N] bf16.
at::Tensor int4_rows_by_blocks(const at::Tensor& x, const uint8_t* wp, int64_t G, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / G, block_bytes = groups * (G / 8 * 192 + 192);
  const auto xc = x.contiguous();
  const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb);
  std::vector<float> xsum(M * groups, 0.0f);  // each row's sum over each group, in order
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / G] += static_cast<float>(xb[m * K + k]);
  auto out = at::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t pf = g_prefetch[1].load(std::memory_order_relaxed);
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  walk_blocks(M > TWO_STREAMS_UP_TO, blocks, M <= ROWS_FOUR, 1, [&](auto streams, const int64_t* b) {
    constexpr int S = decltype(streams)::value;
    constexpr int ROWS = S == 4 ? 1 : INT4_ROWS;
    int64_t n0[S];
    const uint8_t* w[S];
    for (int s = 0; s < S; ++s) {
      n0[s] = b[s] * BLOCK;
      w[s] = wp + b[s] * block_bytes;
    }
    row_passes<ROWS>(M, pf, [&](int64_t m, auto rows, auto prefetch) {
      int4_block_rows<decltype(rows)::value, S, decltype(prefetch)::value>(
          xp + m * K, xsum.data() + m * groups, K, G, w, op + m * N, N, n0, pf);
    });
  });
  return out;
}
#pragma GCC pop_options
#endif

// `pairs`: the [blocks, in / 2, 96] layout of row_kernel.pack_pairs (bf16 weights only).
void check_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::ScalarType weight, const char* op,
                bool pairs = false) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be a 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == weight && packed.size(2) == (pairs ? 2 : 1) * BLOCK &&
              packed.size(1) * (pairs ? 2 : 1) == x.size(1) && packed.size(0) * BLOCK >= N && packed.is_contiguous(),
              op, ": packed must be the [blocks, in, 48] weight of row_kernel.pack (or [blocks, in / 2, 96] of "
              "row_kernel.pack_pairs)");
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * BLOCK;
  check_rows(x, packed, N, at::kBFloat16, "linear_rows", pairs);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (!pairs) return rows_by_blocks(x, wp, nullptr, N);
#if defined(__AVX512F__)
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "linear_rows: pair-packed weights need AVX-512 with BF16");
  return pair_rows_by_blocks(x, wp, N);
#else
  TORCH_CHECK(false, "linear_rows: pair-packed weights need AVX-512 with BF16");
#endif
}

at::Tensor linear_rows_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N) {
  check_rows(x, packed, N, at::kChar, "linear_rows_int8");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "linear_rows_int8: scales must be fp32 [out_features]");
  return rows_by_blocks(x, packed.data_ptr<int8_t>(), scales.data_ptr<float>(), N);
}

at::Tensor linear_rows_int4(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_rows_int4: x must be a 2-D bf16 tensor");
  const int64_t K = x.size(1), G = group_size;
  TORCH_CHECK(G % 8 == 0 && G > 0 && K % G == 0 && packed.dim() == 3 && packed.scalar_type() == at::kByte &&
              packed.size(1) == K / G && packed.size(2) == G / 8 * 192 + 192 && packed.size(0) * BLOCK >= N &&
              packed.is_contiguous(), "linear_rows_int4: packed must be the int4 weight of row_kernel.pack_int4");
#if defined(__AVX512F__)
  return int4_rows_by_blocks(x, packed.data_ptr<uint8_t>(), G, N);
#else
  TORCH_CHECK(false, "linear_rows_int4 needs AVX-512 with BF16");
#endif
}

void set_row_tuning(int64_t streams, int64_t prefetch, int64_t form) {
  TORCH_CHECK((streams == 2 || streams == 4) && streams <= MAX_STREAMS && prefetch >= 0 && prefetch <= 65536,
              "set_row_tuning: streams must be 2 (or 4 with AVX-512) and prefetch 0-65536 bytes");
  TORCH_CHECK(form == 0 || form == 1, "set_row_tuning: form 0 (bf16 and int8 weights) or 1 (int4)");
  g_streams[form].store(streams);
  g_prefetch[form].store(prefetch);
}

bool amx_available() {
#if defined(__AVX512F__)
  return amx_usable();
#else
  return false;
#endif
}

void set_amx_from(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_amx_from: rows must be 0 (never) or more");
  g_amx_from.store(rows);
}

}  // namespace

TORCH_LIBRARY(inference_core, m) {
  m.def("linear_rows(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("linear_rows_int8(Tensor x, Tensor packed, Tensor scales, int out_features) -> Tensor");
  m.def("linear_rows_int4(Tensor x, Tensor packed, int group_size, int out_features) -> Tensor");
  m.def("set_row_tuning(int streams, int prefetch, int form=0) -> ()", set_row_tuning);  // no tensors: one kernel
  m.def("set_amx_from(int rows) -> ()", set_amx_from);
  m.def("amx_available() -> bool", amx_available);
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) {
  m.impl("linear_rows", linear_rows);
  m.impl("linear_rows_int8", linear_rows_int8);
  m.impl("linear_rows_int4", linear_rows_int4);
}
"""

# The ops' C entry points for AOTInductor (`c_shims`): a compiled package calls each op as a C function instead of
# through its proxy executor, which builds a boxed call of the op for every call. Measured on the 2-core AVX2 host:
# 150 calls of the op in a package (bf16 [64, 64] weights, frozen) took 11.3 us a call through the proxy executor and
# 7.4 us through the shim; the bundled model's compiled bf16 step (150 calls of our ops) decoded 1.032x faster
# through them (median of 30 alternating pairs in one process, faster in 19, the same greedy ids). Each records itself
# under the op's name for the torch profiler, as the dispatcher did (`bench.profile` reads the names).
SHIMS = r"""
#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

namespace {
const at::Tensor& tensor(AtenTensorHandle handle) {
  return *torch::aot_inductor::tensor_handle_to_tensor_pointer(handle);
}
}  // namespace

extern "C" {
AOTITorchError aoti_torch_cpu_linear_rows(AtenTensorHandle x, AtenTensorHandle packed, int64_t n,
                                          AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::linear_rows", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(linear_rows(tensor(x), tensor(packed), n));
  });
}
AOTITorchError aoti_torch_cpu_linear_rows_int8(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scales,
                                               int64_t n, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::linear_rows_int8", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(linear_rows_int8(tensor(x), tensor(packed), tensor(scales), n));
  });
}
AOTITorchError aoti_torch_cpu_linear_rows_int4(AtenTensorHandle x, AtenTensorHandle packed, int64_t group_size,
                                               int64_t n, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::linear_rows_int4", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(linear_rows_int4(tensor(x), tensor(packed), group_size, n));
  });
}
AOTITorchError aoti_torch_cpu_attend_paged(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                           AtenTensorHandle k_pool, AtenTensorHandle v_pool, AtenTensorHandle table,
                                           AtenTensorHandle key_mask, double scale, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::attend_paged", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(attention::attend_paged(
        tensor(q), tensor(k), tensor(v), tensor(k_pool), tensor(v_pool), tensor(table), tensor(key_mask), scale));
  });
}
AOTITorchError aoti_torch_cpu_attend_paged_queries(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                   AtenTensorHandle k_pool, AtenTensorHandle v_pool,
                                                   AtenTensorHandle table, AtenTensorHandle key_mask,
                                                   AtenTensorHandle new_mask, double scale, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::attend_paged_queries", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(attention::attend_paged_queries(
        tensor(q), tensor(k), tensor(v), tensor(k_pool), tensor(v_pool), tensor(table), tensor(key_mask),
        tensor(new_mask), scale));
  });
}
AOTITorchError aoti_torch_cpu_attend_paged_flat(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                AtenTensorHandle k_pool, AtenTensorHandle v_pool,
                                                AtenTensorHandle table, AtenTensorHandle starts,
                                                AtenTensorHandle cached, AtenTensorHandle window, double scale,
                                                AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::attend_paged_flat", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(attention::attend_paged_flat(
        tensor(q), tensor(k), tensor(v), tensor(k_pool), tensor(v_pool), tensor(table), tensor(starts),
        tensor(cached), tensor(window), scale));
  });
}
AOTITorchError aoti_torch_cpu_int4_kv_read(AtenTensorHandle codes, AtenTensorHandle ranges, AtenTensorHandle blocks,
                                           AtenTensorHandle tails, AtenTensorHandle tail_k, AtenTensorHandle tail_v,
                                           int64_t group, AtenTensorHandle* k_out, AtenTensorHandle* v_out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::int4_kv_read", std::vector<c10::IValue>());
    auto [k, v] = int4kv::int4_kv_read(tensor(codes), tensor(ranges), tensor(blocks), tensor(tails), tensor(tail_k),
                                       tensor(tail_v), group);
    *k_out = torch::aot_inductor::new_tensor_handle(std::move(k));
    *v_out = torch::aot_inductor::new_tensor_handle(std::move(v));
  });
}
}
"""

# The build's flags by the instruction set torch found on this CPU: the source's loops (both ops') take the widest
# vectors the flags allow. -fopenmp: at::parallel_for is an OpenMP loop in torch's headers, ignored (one thread)
# without it. -mfma on AVX-512 too: GCC's -mavx512f does not imply it, and the int8-activation op's 256-bit code
# (`model.w4a8_kernel`) calls FMA intrinsics on every host (every AVX-512 CPU has FMA); `tests/model/
# test_row_kernel_flags.py` compiles the source with each set's flags, whichever CPU runs the suite.
FLAGS = {"AVX512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"],
         "AVX2": ["-O3", "-mavx2", "-mfma", "-fopenmp"]}

_state = threading.local()
_BUILD_LOCK = threading.Lock()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / BLOCK), in, BLOCK], the output features padded with zeros to whole blocks."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % BLOCK))
    return padded.view(-1, BLOCK, in_features).transpose(1, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] (in even) -> [ceil(out / BLOCK), in / 2, 2 * BLOCK], the bf16 dot products' layout: in block b, at
    pair p, output feature c's weights for input features 2p and 2p + 1 at 2c and 2c + 1."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % BLOCK))
    return padded.view(-1, BLOCK, in_features // 2, 2).transpose(1, 2).reshape(-1, in_features // 2, 2 * BLOCK)


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """An int4 weight, q [out, in] in 0..15 and tinygemm's bf16 (scale, zero) [in / group, out, 2], -> the bytes
    `linear_rows_int4` reads: [ceil(out / BLOCK), in / group, group / 8 * 192 + 192], per block and group the nibbles
    (octets of three 64-byte vectors: lane i of vector j, output 16j + i, holds input feature 8o + 2h + t at nibble h
    of its word t) and then the group's 48 scales and 48 zeros."""
    out_features, in_features = q.shape
    groups = scales_and_zeros.shape[0]
    pad = -out_features % BLOCK
    nibbles = F.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(-1, BLOCK // 16, 16, in_features // 8, 4, 2)
    words = torch.stack([nibbles[..., 0, :] | (nibbles[..., 1, :] << 4),  # [block, j, i, octet, t, byte]
                         nibbles[..., 2, :] | (nibbles[..., 3, :] << 4)], -1)
    blocks = words.shape[0]
    words = words.permute(0, 3, 1, 2, 4, 5).reshape(blocks, groups, -1)
    numbers = F.pad(scales_and_zeros.to(torch.bfloat16), (0, 0, 0, pad))  # [groups, out, 2]
    numbers = numbers.view(groups, blocks, BLOCK, 2).permute(1, 0, 3, 2).contiguous()  # [block, group, 2, 48]
    return torch.cat([words, numbers.view(torch.uint8).view(blocks, groups, 4 * BLOCK)], -1).contiguous()


def unavailable() -> str | None:
    """Why the op cannot run here (None: it is built and registered). Builds it the first time on a machine (about
    35 s) into the local cache, in a directory named after the source, the flags (`FLAGS`, by the CPU's instruction
    set) and torch's version; loads that build later. Engines started at once (two race lanes) wait for one build."""
    with _BUILD_LOCK:
        return _build()


def loaded() -> bool:
    """Whether the extension is built and registered in this process already (asking builds nothing)."""
    return _build.cache_info().currsize > 0 and _build() is None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of fp32 rows [R, V], the same ids (the first index of the maximum, a NaN above all):
    through our op (`step_kernel`'s, a vector pass a row, the rows shared among the threads) where the extension is
    loaded here and the rows lie on the CPU, torch's elsewhere. Torch's reads a row of the bundled model's 49,152
    logits in about 22 us on one thread (0.18 ms for an 8-row decode step's, 2-vCPU Zen 4 host)."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[1]
            and logits.stride(1) == 1 and loaded()):
        return torch.ops.inference_core.argmax_rows(logits)
    return logits.argmax(dim=-1)


def full_source() -> str:
    """The C++ of all of our ops, the one extension's source (`load_inline` puts torch's header before it)."""
    return (SOURCE + attention_kernel.SOURCE + step_kernel.SOURCE + kv_kernel.SOURCE + w4a8_kernel.SOURCE
            + mlp_kernel.SOURCE + SHIMS + w4a8_kernel.SHIM + mlp_kernel.SHIM)


@functools.cache
def _build() -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        return f"it needs AVX-512 or AVX2 (this CPU: {capability})"
    flags = FLAGS[capability]
    source = full_source()
    name = "inference_core_rows_" + hashlib.blake2b((source + repr(flags) + torch.__version__).encode(),
                                                     digest_size=6).hexdigest()
    directory = cache_root() / "row-kernel" / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        library = torch.utils.cpp_extension.load_inline(name, cpp_sources=source, extra_cflags=flags,
                                                        extra_ldflags=["-fopenmp"], build_directory=str(directory),
                                                        is_python_module=False)
        # Its symbols visible to libraries loaded later: a compiled package calls the ops' C entry points (`c_shims`).
        ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (RuntimeError, OSError) as error:  # no compiler, no ninja, a failed build: inductor's matmuls instead
        return f"its build failed ({str(error).splitlines()[0][:200]})"
    for op in ("linear_rows", "linear_rows_int8", "linear_rows_int4"):
        torch.library.register_fake(f"inference_core::{op}")(_projection_output_shape)
    attention_kernel.register_fake()
    kv_kernel.register_fake()
    w4a8_kernel.register_fake()
    mlp_kernel.register_fake()
    _state_tuning.update(_tuned(directory / "tuning.json", capability))
    apply_tuning()
    return None


# The projection loop's tuning candidates by instruction set, (streams per thread, prefetch distance in bytes), the
# first the default: on the 2-vCPU Intel AVX-512 host with AMX, a core read 13 GB/s whatever it did, and four streams
# with the weights asked for 1 KB ahead read 22.4 against 18.1 GB/s for two streams without (the step's 121 weight
# shapes, 8 rounds interleaved); on the AMD Zen 5 host a prefetch 2 KB ahead lost 4-15% (docs/benchmarks.md, "An
# Intel host with AMX"). AVX2 has too few registers for four streams' sums.
TUNING_CANDIDATES = {"AVX512": ((2, 0), (2, 1024), (4, 0), (4, 1024)), "AVX2": ((2, 0), (2, 1024))}
TUNING_MARGIN = 0.97  # a candidate replaces the default only where it takes at most this share of its time
A8_MARGIN = 0.97  # int8 activations are the fastest int4 (`a8_faster`) where they take at most this share of its time
# The loop's forms, each tuned on its own (the op's `form`): bf16 weights (whose tuning int8 ones share) and int4. The
# int4 form reads a third of the bytes for the same work, and may want other settings: on the Intel host one
# measurement of the bf16 passes chose (2, 1 KB) over (4, 1 KB) by a hair (0.832 against 0.838), and with it the
# compiled int4 step decoded at 0.94x its speed with four streams (two runs of 10 alternating pairs: 1.060x and
# 1.054x for four, faster in 10 and 9).
FORMS = {"bf16": 0, "int4": 1}
_state_tuning: dict = {}


def tuning() -> dict:
    """The projection loop's tuning on this machine: `streams` and `prefetch` of the bf16 (and int8) form, with the
    measurement that chose them (`ratios`: each candidate's median time over the default's), and where the int4 form
    runs (`int4_form`) the same for it under `int4`; empty until `unavailable()` has built the op."""
    return dict(_state_tuning)


def apply_tuning() -> None:
    """Sets the op to this machine's `tuning`, every form of it (after a measurement or a test tried others)."""
    tuned = tuning()
    torch.ops.inference_core.set_row_tuning(tuned["streams"], tuned["prefetch"])
    torch.ops.inference_core.set_amx_from(amx_rows())
    if "int4" in tuned:
        torch.ops.inference_core.set_row_tuning(tuned["int4"]["streams"], tuned["int4"]["prefetch"], FORMS["int4"])


def _tuned(path, capability: str) -> dict:
    """The tuning kept at `path`, or measured now (`measure_tuning`, each form the CPU runs; where the int4 form runs,
    `measure_a8` too; a kept tuning without the int4 form's measurements gains them) and kept there;
    `INFERENCE_CORE_ROW_TUNING=2,1024` sets it for every form instead (for A/B runs; nothing kept)."""
    candidates = TUNING_CANDIDATES[capability]
    forced = os.environ.get("INFERENCE_CORE_ROW_TUNING")
    if forced:
        choices = {f"{streams},{prefetch}": (streams, prefetch) for streams, prefetch in candidates}
        choice = choices.get(forced.replace(" ", ""))
        if choice is None:
            raise ValueError(f"INFERENCE_CORE_ROW_TUNING={forced!r}: on this CPU ({capability}) it takes one of "
                             f"{', '.join(choices)} (streams per thread, prefetch distance in bytes)")
        setting = {"streams": choice[0], "prefetch": choice[1], "forced": True}
        if amx_capable():
            setting.update(measure_amx())
        return {**setting, "int4": {**setting, "versus_aten": None}} if int4_capable() else setting

    def valid(entry) -> bool:
        return isinstance(entry, dict) and (entry.get("streams"), entry.get("prefetch")) in candidates

    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    chosen = kept if valid(kept) else measure_tuning(candidates)
    if int4_capable() and not (valid(chosen.get("int4")) and "versus_aten" in chosen["int4"]):
        chosen = {**chosen, "int4": measure_tuning(candidates, form="int4")}
    if int4_capable() and "a8_versus_int4" not in chosen["int4"]:
        torch.ops.inference_core.set_row_tuning(chosen["int4"]["streams"], chosen["int4"]["prefetch"], FORMS["int4"])
        chosen = {**chosen, "int4": {**chosen["int4"], **measure_a8()}}
    if amx_capable() and "amx_from" not in chosen:
        torch.ops.inference_core.set_row_tuning(chosen["streams"], chosen["prefetch"])  # the loop as it will run
        chosen = {**chosen, **measure_amx()}
    if chosen is kept:
        return kept
    int4 = chosen.get("int4", {})
    if chosen.get("busy") or int4.get("busy") or int4.get("a8_versus_int4", 0) is None or chosen.get("amx_busy"):
        return chosen  # the default for now, and a new measurement next time
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # engines in other processes may measure at the same time
    partial.write_text(json.dumps(chosen, indent=1))
    partial.replace(path)
    return chosen


def _busy(times: list[float]) -> bool:
    """Whether a measurement's passes of the same work differ by more than a quarter: the host's memory or cores were
    taken by others, not a fair moment to decide anything by."""
    return max(times) > 1.25 * min(times)


def _int4_probe() -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight the measurements time, [2048, 1024] in groups of 32 (zeros: no op's time depends on the
    values): its q and tinygemm's scales and zeros, as `pack_int4` takes them."""
    return torch.zeros(2048, 1024, dtype=torch.int32), torch.ones(1024 // 32, 2048, 2, dtype=torch.bfloat16)


def measure_tuning(candidates, megabytes: int = 256, rounds: int = 7, form: str = "bf16") -> dict:
    """Each candidate's time for one pass of one row over `megabytes` of the `form`'s packed weights ([2048, 1024]
    each, more than the caches hold), in `rounds` rounds with the candidates' order rotated; the median over rounds of
    each candidate's time over the default's (the first) decides, by `TUNING_MARGIN`. Where the default's own passes
    differ by more than a quarter, the host is `busy` and the default stands. The int4 form's rounds also time ATen's
    int4 kernel on the same weights (`versus_aten`: the chosen setting's time over its; None where busy). About 0.5 s
    a form on the 2-core hosts."""
    ops = torch.ops.inference_core
    x = torch.ones(1, 1024, dtype=torch.bfloat16)
    aten = None  # the int4 form: ATen's kernel on the same weights in its own layout, timed in the same rounds
    if form == "int4":
        q, scales = _int4_probe()
        weight = pack_int4(q, scales)
        project = functools.partial(ops.linear_rows_int4, x, group_size=32, out_features=2048)
        aten_weights = [torch._convert_weight_to_int4pack_for_cpu(q, 1)
                        for _ in range(megabytes * 2**20 // weight.nbytes)]

        def aten() -> float:
            started = time.perf_counter()
            for packed in aten_weights:
                torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales)
            return time.perf_counter() - started
    else:
        weight = torch.ones(2048 // BLOCK + 1, *((512, 2 * BLOCK) if pairs_form() else (1024, BLOCK)),
                            dtype=torch.bfloat16)  # the layout the bf16 form runs (`pack_pairs` or `pack`)
        project = functools.partial(ops.linear_rows, x, out_features=2048)
    weights = [weight.clone() for _ in range(megabytes * 2**20 // weight.nbytes)]

    def one_pass(streams: int, prefetch: int) -> float:
        ops.set_row_tuning(streams, prefetch, FORMS[form])
        started = time.perf_counter()
        for packed in weights:
            project(packed=packed)
        return time.perf_counter() - started

    one_pass(*candidates[0])
    ratios, defaults, aten_ratios = {candidate: [] for candidate in candidates}, [], []
    for round_ in range(rounds):
        order = candidates[round_ % len(candidates):] + candidates[:round_ % len(candidates)]
        before = aten() if aten and round_ % 2 else None  # ATen's pass first in odd rounds, last in even ones
        times = {candidate: one_pass(*candidate) for candidate in order}
        defaults.append(times[candidates[0]])
        for candidate in candidates:
            ratios[candidate].append(times[candidate] / times[candidates[0]])
        if aten:
            aten_ratios.append((before or aten()) / times[candidates[0]])
    medians = {candidate: statistics.median(values) for candidate, values in ratios.items()}
    best = min(candidates, key=medians.get)
    busy = _busy(defaults)
    streams, prefetch = best if medians[best] <= TUNING_MARGIN and not busy else candidates[0]
    measured = {"streams": streams, "prefetch": prefetch, "threads": torch.get_num_threads(), "busy": busy,
                "ratios": {f"{s},{p}": round(ratio, 3) for (s, p), ratio in medians.items()},
                "default_pass_ms": [round(seconds * 1e3, 2) for seconds in defaults],
                "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if aten:  # the chosen setting's time over ATen's kernel's (int4_form takes our loop where it is at most 1); on a
        # busy host none (not measured: the loop runs, as where the environment sets the tuning), since the default
        # setting that then stands may be far from the loop's best (1.13x ATen's time against 0.86x for the best, in
        # one busy measurement on the Intel host)
        measured["versus_aten"] = None if busy else round(
            medians[(streams, prefetch)] / statistics.median(aten_ratios), 3)
    return measured


def measure_amx(megabytes: int = 128, rounds: int = 5) -> dict:
    """Where the AMX form beats the AVX-512 pairs loop on this machine: for each of AMX_CANDIDATE_ROWS rows, the median
    over `rounds` of the AMX form's time for one pass over `megabytes` of pair-packed weights ([2048, 1024] each) over
    the loop's, the two timed side by side in alternating order. `amx_from`: the fewest rows from which it is faster
    at every count measured (0: at none, and the op takes at most MAX_ROWS rows). On the 2-vCPU Intel host, over the
    step's 121 weight shapes: 1.13x one row's time at 2 rows against the loop's 1.00, 1.15x at 4 against 1.24-1.28,
    1.19x at 16 against 3.6 (docs/benchmarks.md). Where the loop's own passes differ by more than a quarter the host
    is busy (`amx_busy`, measured again next start) and the AMX form takes 4 rows and more. About 0.4 s."""
    ops = torch.ops.inference_core
    weight = torch.ones(2048 // BLOCK + 1, 512, 2 * BLOCK, dtype=torch.bfloat16)
    weights = [weight.clone() for _ in range(megabytes * 2**20 // weight.nbytes)]

    def one_pass(x: torch.Tensor, amx: bool) -> float:
        ops.set_amx_from(1 if amx else 0)
        started = time.perf_counter()
        for packed in weights:
            ops.linear_rows(x, packed, 2048)
        return time.perf_counter() - started

    ratios, loop_times = {rows: [] for rows in AMX_CANDIDATE_ROWS}, []
    for amx in (True, False):  # a pass of each first, untimed
        one_pass(torch.ones(AMX_CANDIDATE_ROWS[0], 1024, dtype=torch.bfloat16), amx)
    for turn in range(rounds):
        for rows in AMX_CANDIDATE_ROWS:
            x = torch.ones(rows, 1024, dtype=torch.bfloat16)
            times = {amx: one_pass(x, amx) for amx in ((True, False) if turn % 2 else (False, True))}
            ratios[rows].append(times[True] / times[False])
            if rows == AMX_CANDIDATE_ROWS[0]:
                loop_times.append(times[False])
    medians = {rows: statistics.median(values) for rows, values in ratios.items()}
    busy = _busy(loop_times)
    amx_from = 0
    for rows in reversed(AMX_CANDIDATE_ROWS):  # from the most rows down, while it wins
        if medians[rows] >= 1.0:
            break
        amx_from = rows
    return {"amx_from": 4 if busy else amx_from, "amx_busy": busy,
            "amx_ratios": {str(rows): round(ratio, 3) for rows, ratio in medians.items()}}


def measure_a8(megabytes: int = 64, rounds: int = 7) -> dict:
    """Where the CPU runs the loop's int4 form, whether int4 weights by int8 activations (`model.w4a8_kernel`'s op,
    integer dot products) decode faster here: one row's pass over `megabytes` of int4 weights ([2048, 1024], groups
    of 32) through that op against the int4 loop (this machine's int4 tuning applied), the two in alternating order,
    `rounds` times; `a8_versus_int4` is the median of its time over the loop's (None where the loop's own passes differ
    by more than a quarter: a busy host, measured again next start). On the 2-vCPU AMD Zen 4 host (AVX-512 with BF16
    and VNNI, no AMX) the compiled int4 step decoded at 251.5 tokens/s and the one by int8 activations at 275.8, whose
    512-token prefill ran 1.9x as fast (docs/benchmarks.md, section 1). About 0.3 s."""
    ops = torch.ops.inference_core
    q, scales = _int4_probe()
    loop_weight = pack_int4(q, scales)
    nibbles, numbers = w4a8_kernel.pack(q, torch.ones(2048, 32), torch.zeros(2048, 32))
    count = max(1, megabytes * 2**20 // loop_weight.nbytes)
    loop_weights = [loop_weight.clone() for _ in range(count)]
    a8_weights = [(nibbles.clone(), numbers.clone()) for _ in range(count)]
    x = torch.ones(1, 1024, dtype=torch.bfloat16)

    def one_pass(a8: bool) -> float:
        started = time.perf_counter()
        if a8:
            for packed, scales in a8_weights:
                ops.linear_int4_a8(x, packed, scales, 32, 2048)
        else:
            for packed in loop_weights:
                ops.linear_rows_int4(x, packed, 32, 2048)
        return time.perf_counter() - started

    one_pass(True), one_pass(False)
    ratios, loop_times = [], []
    for turn in range(rounds):
        times = {a8: one_pass(a8) for a8 in ((True, False) if turn % 2 else (False, True))}
        ratios.append(times[True] / times[False])
        loop_times.append(times[False])
    busy = _busy(loop_times)
    return {"a8_versus_int4": None if busy else round(statistics.median(ratios), 3)}


def a8_faster() -> bool:
    """Whether int4 weights by int8 activations decode faster here than the loop's int4 form where that runs
    (`measure_a8`, kept in this machine's `tuning`): at most A8_MARGIN of its time. False where it was not measured
    (no int4 form, a busy host)."""
    ratio = tuning().get("int4", {}).get("a8_versus_int4")
    return int4_capable() and ratio is not None and ratio <= A8_MARGIN


def amx_capable() -> bool:
    """Whether this machine runs the AMX form: the pairs layout (`pairs_form`) and AMX with BF16 that the kernel lets
    this process use (call after `unavailable()` returned None)."""
    if not pairs_form():
        return False
    try:
        return torch.ops.inference_core.amx_available()
    except (AttributeError, RuntimeError):  # not built (yet) in this process
        return False


def amx_rows() -> int:
    """The fewest input rows the op takes through AMX on this machine (0: none): this machine's `measure_amx`, or
    `INFERENCE_CORE_AMX_ROWS` (for A/B runs; 0 turns the form off)."""
    forced = os.environ.get("INFERENCE_CORE_AMX_ROWS")
    if forced is not None:
        if not forced.strip().isdigit():
            raise ValueError(f"INFERENCE_CORE_AMX_ROWS={forced!r}: a row count (0: never)")
        return int(forced) if amx_capable() else 0
    return tuning().get("amx_from", 0) if amx_capable() else 0


def pairs_form() -> bool:
    """Whether bf16 weights are packed in pairs for BF16 dot products (`pack_pairs`): on AVX-512 with BF16 (where the
    int4 form runs too). Measured on the 2-vCPU Intel host over the step's 121 weight shapes: the pairs loop's pass
    equals the widening one's at 1 and 2 rows and takes 0.91-0.93x its time at 4 and 5."""
    return int4_capable()


def rows_at_one_row_cost() -> int | None:
    """How many input rows a bf16 projection through the op takes at about one row's time here: WIDE_ROWS where the
    weights are packed in pairs and AMX does not take the rows (the wide pass: a block's read from memory overlaps
    all of its rows' dot products; past it the passes take turns, 16 rows 1.9x one row's time on the Zen 4 host), None
    where that was not measured (AMX, the widening form; call after `unavailable()` returned None)."""
    return WIDE_ROWS if pairs_form() and not amx_rows() else None


def max_rows(in_features: int) -> int:
    """The most input rows the op takes for a bf16 weight of `in_features`: PAIRS_MAX_ROWS where the weight is
    packed in pairs (`pack_for_op`), else MAX_ROWS."""
    return PAIRS_MAX_ROWS if pairs_form() and in_features % 2 == 0 else MAX_ROWS


def c_shims() -> dict:
    """AOTInductor's `custom_ops_to_c_shims` for our ops (call after `unavailable()` returned None): each op by the
    declaration of its C entry point in `SHIMS`."""
    bf16 = "AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*"
    int8 = "AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, int64_t, AtenTensorHandle*"
    attention = ", ".join(["AtenTensorHandle"] * 7 + ["double", "AtenTensorHandle*"])
    queries = ", ".join(["AtenTensorHandle"] * 8 + ["double", "AtenTensorHandle*"])
    flat = ", ".join(["AtenTensorHandle"] * 9 + ["double", "AtenTensorHandle*"])
    int4 = "AtenTensorHandle, AtenTensorHandle, int64_t, int64_t, AtenTensorHandle*"
    int4_kv = ", ".join(["AtenTensorHandle"] * 6 + ["int64_t", "AtenTensorHandle*", "AtenTensorHandle*"])
    arguments = {"linear_rows": bf16, "linear_rows_int8": int8, "linear_rows_int4": int4, "attend_paged": attention,
                 "attend_paged_queries": queries, "attend_paged_flat": flat, "int4_kv_read": int4_kv,
                 "linear_int4_a8": w4a8_kernel.SHIM_ARGUMENTS, "silu_mul": mlp_kernel.SHIM_ARGUMENTS}
    return {getattr(torch.ops.inference_core, name).default: [f"AOTITorchError aoti_torch_cpu_{name}({types})"]
            for name, types in arguments.items()}


def _projection_output_shape(x: torch.Tensor, *weights_and_out_features) -> torch.Tensor:
    """The projection ops' output shape for export: [rows of x, out_features], their last argument."""
    return x.new_empty(x.shape[0], weights_and_out_features[-1])


@contextlib.contextmanager
def tracing(enabled: bool):
    """While tracing a decode step: `model.llama.Linear` calls the op for the inputs it takes (`takes`)."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def int8_form() -> bool:
    """Whether int8 projections run through our loop instead of inductor's int8 template, by measurement (the compiled
    step's A/B, docs/benchmarks.md):
    - on AVX2: 1.06-1.17x the template on the Zen 3 host (two runs);
    - on AVX-512 where this machine's `tuning` took four streams or a prefetch: 1.26x the template on the Intel host
      with AMX, with four streams and 1 KB ahead (12 of 12 pairs);
    - not on AVX-512 where the tuning kept two streams without prefetch: there a one-stream form lost on the Zen 5
      host (0.93x)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2":
        return True
    tuned = tuning()
    return capability == "AVX512" and bool(tuned) and (
        (tuned["streams"], tuned["prefetch"]) != TUNING_CANDIDATES["AVX512"][0])


def int4_capable() -> bool:
    """Whether this CPU runs the loop's int4 form: AVX-512 with BF16 dot products (the build has it on AVX-512)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_bf16_supported()


def int4_form() -> bool:
    """Whether int4 projections (`linear_int4`) run through our loop: where the CPU can (`int4_capable`) and this
    machine's int4 tuning measured the loop at most as slow as ATen's int4 kernel (tinygemm's, which inductor's int4
    template otherwise competes with) on the same weights (`tuning()["int4"]["versus_aten"]`; on the Intel host with
    AMX 0.79; None where `INFERENCE_CORE_ROW_TUNING` set the tuning instead or the host was busy: the loop then runs);
    False until `unavailable()` has built the op."""
    ratio = tuning().get("int4", {}).get("versus_aten", 2.0)
    return int4_capable() and (ratio is None or ratio <= 1.0)


def _takes_rows(x: torch.Tensor, most: int = MAX_ROWS) -> bool:
    """Inside `tracing(True)`, on the CPU, 2-D bf16 x of at most `most` rows: the inputs every projection op takes
    (torch.compile, which never traces inside `tracing(True)`, reads no more than the flag)."""
    return (getattr(_state, "enabled", False) and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[0] <= most)


def takes_int4(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether an int4 projection of `x` by tinygemm's CPU-packed weight [out, in / 2] runs through the op: as `takes`,
    where `int4_form` says so, for out features a multiple of 64 (the layout `quant.kernels.unpack_int4_cpu` reads)."""
    return (_takes_rows(x) and packed.dtype == torch.uint8 and packed.dim() == 2 and packed.shape[0] % 64 == 0
            and int4_form())


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of `x` by `weight` runs through the op: inside `tracing(True)`, on the CPU, 2-D bf16 x, a
    bf16 weight of at most `max_rows` rows, or an int8 one (`linear_int8`) of at most MAX_ROWS where `int8_form` says
    so."""
    if not _takes_rows(x, PAIRS_MAX_ROWS):  # (first: eager forwards ask too)
        return False
    if weight.dtype == torch.bfloat16:
        return x.shape[0] <= max_rows(weight.shape[1])
    return x.shape[0] <= MAX_ROWS and weight.dtype == torch.int8 and int8_form()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) through the op (call where `takes` says so, after `unavailable()` returned None)."""
    out = torch.ops.inference_core.linear_rows(x, pack_for_op(weight), weight.shape[0])
    return out if bias is None else out + bias


def pack_for_op(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out, in] in the layout `linear_rows` runs best here: in pairs (`pack_pairs`) where `pairs_form`
    says so, else in blocks (`pack`)."""
    return pack_pairs(weight) if pairs_form() and weight.shape[1] % 2 == 0 else pack(weight)


def linear_int4(x: torch.Tensor, q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x w^T for an int4 weight, q [out, in] in 0..15, w = (q - 8) scale + zero with tinygemm's bf16 scales and zeros
    [in / group, out, 2] (`quant.linear.QuantLinear`'s int4 scheme): fp32 sums, rounded once to bf16 (call where
    `takes_int4` says so)."""
    group = q.shape[1] // scales_and_zeros.shape[0]
    return torch.ops.inference_core.linear_rows_int4(x, pack_int4(q, scales_and_zeros), group, q.shape[0])


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (q s)^T for an int8 weight q [out, in] with a scale per output feature s [out] (`quant.linear.QuantLinear`'s
    int8 scheme): the sums of x q in fp32, times s, rounded once to bf16 (call where `takes` says so)."""
    return torch.ops.inference_core.linear_rows_int8(x, pack(qweight), scales.float(), qweight.shape[0])
