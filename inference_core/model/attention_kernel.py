"""Our kernel for the compiled steps' paged attention on an AVX-512 or AVX2 CPU: each sequence's new queries (one in a
decode step, several in the query step: a speculative chain's or tree's verification) against its cached keys, read
through the block table from the pool in place (bf16, or fp32: an fp32 model's), and its new keys.

What inductor generates for `_attend_one_fused` (in `engine.compiled`) reads each cached key once per query head,
reduces every dot product on its own, and runs the mask and the softmax on one thread between its parallel loops: on the
2-core Zen 5 host the compiled step took 2.4 us more a cached key (for all 30 layers of the bundled model), about 10
GB/s of the cache read. Here each thread takes a contiguous range of the key blocks; per KV head it reads each cached
key once for all of the sequence's query rows (its queries times the group's query heads, as many at once as the
registers hold: fp32 sums of the pool's values, bf16 ones widened by a shift), stores the scores, takes their
exponentials a vector at a time (`exp_neg`, a polynomial), and sums the values weighted by them. The threads' partial
softmaxes (the maximum, the sum, the weighted values) and the new keys each query sees (`new_mask`: causal for a chain,
the tree's mask for a tree) are then combined in fp32. A mask per query over the cached keys carries a sliding window.
Its outputs equal `_attend_one_fused`'s and `query_graph.attend_queries`'s to fp32 rounding
(`tests/model/test_attention_kernel.py`), with AVX-512's vectors or AVX2's (the build's flags choose:
`model.row_kernel.FLAGS`). For the query step it replaced inductor's fp32 matmuls over the context cast per layer: the
bundled model's 5-token step then spent 5.6x the decode step's attention time, and its package compiled in about 190 s
instead of 40.

Three ops: `attend_paged` (the decode step's: q [B, H, D]) and `attend_paged_queries` (the query step's: q [B, T, H, D],
a mask per query), the first the second's case T = 1, called from the compiled steps where `takes` says so while
exporting (paged, bf16 or fp32 pool, head_dim 16 to 128, at most 8 query heads a KV head); and `attend_paged_flat` (the
flat step's: the new tokens of several sequences one after another, q [N, H, D], any number a sequence, causal after its
cached keys, within a sliding window and beside attention sinks given as inputs; bf16 or fp32 pools, head_dim 16 to
128), the flat step's only attention (`takes_flat`). A flat step's short sequences (decodes, fewer than 8 new
tokens) go through the same loops as the others; longer ones (prompts, chunks) through tiled loops with an online
softmax (FlashAttention's): a block of queries against chunks of keys, the scores a small matrix product held in
registers, causal work skipped a chunk at a time. A 512-token prompt's attention took 6.6 ms a layer so against 15.6
through ATen's SDPA on its keys gathered in fp32 (the bundled model's heads, the AVX2 Zen 1 host, 2 threads), which
skips causal work only by whole blocks of 512 keys; the bundled model's 512-token prefill went from 274 to 301-310
tokens/s. Where the CPU has AVX-512 BF16 dot products, a bf16 pool's long sequences take the same tiles with both
products in bf16 pairs (`attend_block_pairs`: one vdpbf16ps a pair of multiply-adds, the queries, keys and values
read as the model holds them, the exponentials rounded to bf16 for the weighted values as FlashAttention's GPU
kernels round them): on the 2-vCPU Zen 4 host a 512-token prompt's attention took 1.12 ms a layer against 1.95 in
fp32 products, which stay the reference (`pairs_form(False)`) and every other CPU's form. They are built into the
same extension as the projection kernel (`model.row_kernel`, which owns the build).
"""

from __future__ import annotations

import contextlib

import torch

MAX_GROUP = 8  # query heads a KV head the op takes
HEAD_DIMS = (16, 32, 64, 128)  # head sizes the ops take

SOURCE = r"""
#include <cmath>
#include <limits>
#include <memory>

namespace attention {

// The vector ops the loops below need, beside those of the projection op's source (`vec`, `LANES`, `vzero`, `vset1`,
// `vfma`, `widen`: the extension is one source, the projection op's first), on the ISA the build's flags select.
#if defined(__AVX512F__)
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec round_nearest(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec times_pow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// The first `count` lanes (count <= LANES; the others 0, or left as they are in memory).
inline __mmask16 first(int64_t count) { return (__mmask16)((1u << count) - 1); }
inline vec load_first(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first(count), p); }
inline vec keep_first(vec a, int64_t count) { return _mm512_maskz_mov_ps(first(count), a); }
inline void store_first(float* p, vec a, int64_t count) { _mm512_mask_storeu_ps(p, first(count), a); }
#else
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vec round_nearest(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec times_pow2(vec p, vec n) {  // p * 2^n for whole n in [-127, 0] (exp_neg's): 2^n built as an fp32's bits
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
inline __m256i first(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec load_first(const float* p, int64_t count) { return _mm256_maskload_ps(p, first(count)); }
inline vec keep_first(vec a, int64_t count) { return _mm256_and_ps(a, _mm256_castsi256_ps(first(count))); }
inline void store_first(float* p, vec a, int64_t count) { _mm256_maskstore_ps(p, first(count), a); }
#endif

// e^x for x <= 0 (a score minus its row's maximum): 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error about 2e-7); below -87 the result is 0 as in fp32.
inline vec exp_neg(vec x) {
  const vec t = vmul(vmax(x, vset1(-88.f)), vset1(1.4426950408889634f));
  const vec n = round_nearest(t);
  const vec f = vsub(t, n);
  vec p = vset1(1.535336188319500e-4f);
  p = vfma(p, f, vset1(1.339887440266574e-3f));
  p = vfma(p, f, vset1(9.618437357674640e-3f));
  p = vfma(p, f, vset1(5.550332471162809e-2f));
  p = vfma(p, f, vset1(2.402264791363012e-1f));
  p = vfma(p, f, vset1(6.931472028550421e-1f));
  p = vfma(p, f, vset1(1.f));
  return times_pow2(p, n);
}

constexpr int MAXG = 8;
constexpr int MAXQ = 64;  // new tokens a sequence the op takes (query_graph.MAX_QUERIES and more)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
constexpr int VREGS = 32;
inline vec keep_seen(vec e, vec s) {  // e where s is a score (not -inf, a key the query does not see), else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, vset1(NEG_INF), _CMP_NEQ_OQ), e);
}
#else
constexpr int VREGS = 16;
inline vec keep_seen(vec e, vec s) { return _mm256_and_ps(e, _mm256_cmp_ps(s, vset1(NEG_INF), _CMP_NEQ_OQ)); }
#endif

// Query rows a KV head's loops hold in registers at once, each C vectors: as many as leave room for a key's C vectors
// and a few more (the bundled model's 3 heads a KV head, head_dim 64 on AVX-512: one pass for a decode).
template <int C>
constexpr int rows_at_once() { return std::max(1, std::min(MAXG, (VREGS - C - 4) / C)); }

// Software prefetch of one block of the pool into L2: the block table sends each block's read to an address the
// hardware prefetcher cannot guess, so the thread asks for its keys' and values' blocks PREFETCH_BLOCKS ahead of the
// one it computes (many misses in flight instead of one block's at a time).
constexpr int64_t PREFETCH_BLOCKS = 8;
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// A row of a pool's keys or values as fp32 vectors: a bf16 pool's widened, an fp32 pool's as they are.
inline vec load_row(const uint16_t* p) { return widen(p); }
inline vec load_row(const float* p) { return vload(p); }

// One sequence's T queries against its cached keys in the blocks [b0, b1) for every KV head. q: [T, H, D]; mask:
// [T, W], which cached keys each query sees. A KV head h has R = T * G query rows, r = t * G + g for query t's head
// h * G + g; for each, part[(h * R + r) * (D + 2) ...] = {max, sum, acc[D]}: the maximum score, the sum of
// exp(score - max) and the sum of exp(score - max) * value. Each block (BS positions of every KV head, one contiguous
// run) is read from memory once for all heads and queries.
template <int D, typename P>
void attend_range(const float* q, int64_t T, int64_t KVH, int64_t G, const P* kp, const P* vp,
                  int64_t BS, const int32_t* table, const bool* mask, int64_t W, int64_t b0, int64_t b1, float scale,
                  float* part, std::vector<float>& scores, std::vector<char>& seen) {
  constexpr int C = D / LANES, CH = rows_at_once<C>();
  const int64_t H = KVH * G, R = T * G, j0 = b0 * BS, j1 = std::min(W, b1 * BS), n = std::max<int64_t>(0, j1 - j0);
  const int64_t row = KVH * D, block_stride = BS * row, block_bytes = block_stride * sizeof(P);
  scores.resize(std::max<int64_t>(1, KVH * R * n));
  seen.assign(std::max<int64_t>(1, n), 0);  // whether any of the queries sees cached key j0 + i
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) seen[i] |= mask[t * W + j0 + i];
  std::vector<float> mx(KVH * R, NEG_INF);
  auto prefetch = [&](int64_t b) {
    if (b < b1) {
      prefetch_block(kp + table[b] * block_stride, block_bytes);
      prefetch_block(vp + table[b] * block_stride, block_bytes);
    }
  };
  for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS; ++b) prefetch(b);
  for (int64_t b = b0; b < b1; ++b) {  // 1. the scores, block by block
    const P* kb = kp + table[b] * block_stride;
    prefetch(b + PREFETCH_BLOCKS);
    const int64_t jb = b * BS, je = std::min(j1, jb + BS);
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t r0 = 0; r0 < R; r0 += CH) {
        const int64_t rows = std::min<int64_t>(CH, R - r0);
        // Whole loops over CH with the pass's rows as a condition, here and below: the queries and sums stay in
        // registers (loops to a bound known only at run time kept them in memory, each multiply-add waiting on the
        // last one's store: the values' pass took 2x as long)
        vec qv[CH][C];
        const bool* sees[CH];
        float top[CH];
#pragma GCC unroll 16
        for (int i = 0; i < CH; ++i) {
          const int64_t t = std::min<int64_t>(r0 + i, R - 1) / G, g = std::min<int64_t>(r0 + i, R - 1) % G;
          sees[i] = mask + t * W;
          top[i] = mx[h * R + std::min<int64_t>(r0 + i, R - 1)];
          for (int c = 0; c < C; ++c) qv[i][c] = vmul(vload(q + (t * H + h * G + g) * D + LANES * c), vset1(scale));
        }
        for (int64_t j = jb; j < je; ++j) {
          float* s = scores.data() + (h * R + r0) * n + (j - j0);
          if (!seen[j - j0]) {
            for (int64_t i = 0; i < rows; ++i) s[i * n] = NEG_INF;
            continue;
          }
          const P* k = kb + (j - jb) * row + h * D;
          vec kv[C];
          for (int c = 0; c < C; ++c) kv[c] = load_row(k + LANES * c);
#pragma GCC unroll 16
          for (int i = 0; i < CH; ++i) {
            if (i >= rows) continue;
            if (!sees[i][j]) {
              s[i * n] = NEG_INF;
              continue;
            }
            vec a = vmul(qv[i][0], kv[0]);
            for (int c = 1; c < C; ++c) a = vfma(qv[i][c], kv[c], a);
            s[i * n] = vsum(a);
            top[i] = std::max(top[i], s[i * n]);
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < CH; ++i)
          if (i < rows) mx[h * R + r0 + i] = top[i];
      }
    }
  }
  for (int64_t hr = 0; hr < KVH * R; ++hr) {  // 2. their exponentials and sums, a vector at a time
    float* s = scores.data() + hr * n;
    float* out = part + hr * (D + 2);
    out[0] = mx[hr];
    out[1] = 0.f;
    std::fill(out + 2, out + 2 + D, 0.f);
    if (mx[hr] == NEG_INF) {  // nothing this query sees in this range: no weight for any value
      std::fill(s, s + n, 0.f);
      continue;
    }
    const vec m = vset1(mx[hr]);
    vec sum = vzero();
    for (int64_t j = 0; j < n; j += LANES) {
      const int64_t count = std::min<int64_t>(LANES, n - j);
      const vec x = load_first(s + j, count);
      const vec e = keep_first(keep_seen(exp_neg(vsub(x, m)), x), count);
      store_first(s + j, e, count);
      sum = vadd(sum, e);
    }
    out[1] = vsum(sum);
  }
  for (int64_t b = b0; b < b1; ++b) {  // 3. the values weighted by them, block by block
    const P* vb = vp + table[b] * block_stride;
    const int64_t jb = b * BS, je = std::min(j1, jb + BS);
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t r0 = 0; r0 < R; r0 += CH) {
        const int64_t rows = std::min<int64_t>(CH, R - r0);
        float* acc_at = part + (h * R + r0) * (D + 2) + 2;
        const float* p_at = scores.data() + (h * R + r0) * n - j0;
        vec acc[CH][C];
#pragma GCC unroll 16
        for (int i = 0; i < CH; ++i)
          for (int c = 0; c < C; ++c) acc[i][c] = i < rows ? vload(acc_at + i * (D + 2) + LANES * c) : vzero();
        for (int64_t j = jb; j < je; ++j) {
          if (!seen[j - j0]) continue;
          const P* v = vb + (j - jb) * row + h * D;
          vec vv[C];
          for (int c = 0; c < C; ++c) vv[c] = load_row(v + LANES * c);
#pragma GCC unroll 16
          for (int i = 0; i < CH; ++i) {
            if (i < rows) {
              const vec p = vset1(p_at[i * n + j]);
              for (int c = 0; c < C; ++c) acc[i][c] = vfma(p, vv[c], acc[i][c]);
            }
          }
        }
#pragma GCC unroll 16
        for (int i = 0; i < CH; ++i)
          if (i < rows)
            for (int c = 0; c < C; ++c) vstoreu(acc_at + i * (D + 2) + LANES * c, acc[i][c]);
      }
    }
  }
}

// A bf16 or fp32 tensor's values, in order, as fp32: read through its strides where it is a view of at most 4
// dimensions (the query step's q, k and v are views of the projections' outputs), with no ATen op (a copy's dispatch
// cost about 10 us, three a layer).
template <typename T>
void strided_floats(const T* p, at::IntArrayRef sizes, at::IntArrayRef strides, float* out) {
  int64_t size[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
  const int64_t pad = 4 - static_cast<int64_t>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    size[pad + d] = sizes[d];
    stride[pad + d] = strides[d];
  }
  for (int64_t a = 0; a < size[0]; ++a)
    for (int64_t b = 0; b < size[1]; ++b)
      for (int64_t c = 0; c < size[2]; ++c) {
        const T* row = p + a * stride[0] + b * stride[1] + c * stride[2];
        for (int64_t d = 0; d < size[3]; ++d) *out++ = static_cast<float>(row[d * stride[3]]);
      }
}

inline void to_floats(const at::Tensor& t, float* out) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "attend_paged: q, k and v in bf16 or fp32");
  if (t.dim() > 4) {
    to_floats(t.contiguous(), out);
    return;
  }
  if (t.scalar_type() == at::kFloat)
    strided_floats(t.data_ptr<float>(), t.sizes(), t.strides(), out);
  else
    strided_floats(t.data_ptr<at::BFloat16>(), t.sizes(), t.strides(), out);
}

template <int D>
inline float dot(const float* a, const float* b) {
  vec s = vmul(vload(a), vload(b));
  for (int c = 1; c < D / LANES; ++c) s = vfma(vload(a + LANES * c), vload(b + LANES * c), s);
  return vsum(s);
}

template <int D>
inline void add_scaled(float* out, float w, const float* x) {  // out += w * x
  for (int c = 0; c < D / LANES; ++c) vstoreu(out + LANES * c, vfma(vset1(w), vload(x + LANES * c), vload(out + LANES * c)));
}

// One query head's output, oh [D]: the softmax over its scores against the new keys it sees (own[u] for u < count,
// -inf where it does not see one; new_value(u) the key's value row) and over the threads' partial softmaxes of its
// cached keys (part(th) for th < parts: {max, sum, acc[D]}, as `attend_range` leaves them), combined in fp32.
template <int D, typename NewValue, typename Part>
inline void combine(float* oh, const float* own, int64_t count, NewValue new_value, int64_t parts, Part part) {
  float m = NEG_INF;
  for (int64_t u = 0; u < count; ++u) m = std::max(m, own[u]);
  for (int64_t th = 0; th < parts; ++th) m = std::max(m, part(th)[0]);
  std::fill(oh, oh + D, 0.f);
  if (m == NEG_INF) return;  // a query that sees no key (none the graphs make)
  float total = 0.f;
  for (int64_t u = 0; u < count; ++u) {
    if (own[u] == NEG_INF) continue;
    const float w = std::exp(own[u] - m);
    total += w;
    add_scaled<D>(oh, w, new_value(u));
  }
  for (int64_t th = 0; th < parts; ++th) {
    const float* p = part(th);
    if (p[1] == 0.f) continue;
    const float w = std::exp(p[0] - m);
    total += w * p[1];
    add_scaled<D>(oh, w, p + 2);
  }
  const float inverse = 1.f / total;
  for (int d = 0; d < D; ++d) oh[d] *= inverse;
}

// B sequences of T new tokens each: q [B, T, H, D], k, v [B, T, KVH, D] (the new tokens' keys, not in the pool),
// k_pool, v_pool [blocks, BS, KVH, D] (one layer's; kp, vp their data, bf16 or fp32), table [B, blocks] int32,
// key_mask [B, T, keys] bool (the cached keys each query sees), new_mask [B, T, T] bool (the new keys each query
// sees; null: its own alone). Returns fp32 of `sizes`, laid out [B, T, H, D].
template <int D, typename P>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                  const P* kp, const P* vp, const at::Tensor& table, const at::Tensor& key_mask, const bool* new_mask,
                  int64_t B, int64_t T, double scale, at::IntArrayRef sizes) {
  const int64_t KVH = k_pool.size(2), H = q.numel() / (B * T * D), G = H / KVH, R = T * G, BS = k_pool.size(1);
  const int64_t W = key_mask.size(-1);
  // q, k and v in fp32, in one buffer (no ATen op in the kernel: each would cost a dispatch a layer).
  std::vector<float> buffer((B * T * H + 2 * B * T * KVH) * D);
  float* qf = buffer.data();
  float* kf = qf + B * T * H * D;
  float* vf = kf + B * T * KVH * D;
  to_floats(q, qf);
  to_floats(k, kf);
  to_floats(v, vf);
  const auto tc = table.contiguous();
  const auto mc = key_mask.contiguous();
  const int64_t blocks = (W + BS - 1) / BS, NT = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  const int64_t part_size = KVH * R * (D + 2);
  std::vector<float> parts(B * NT * part_size);
  at::parallel_for(0, B * NT, 1, [&](int64_t begin, int64_t end) {  // each (sequence, range of key blocks)
    std::vector<float> scores;
    std::vector<char> seen;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / NT, t = item % NT;
      attend_range<D>(qf + b * T * H * D, T, KVH, G, kp, vp, BS, tc.data_ptr<int32_t>() + b * tc.size(1),
                      mc.data_ptr<bool>() + b * T * W, W, blocks * t / NT, blocks * (t + 1) / NT, (float)scale,
                      parts.data() + item * part_size, scores, seen);
    }
  });
  auto out = at::empty(sizes, q.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  // Each query's ranges' partial softmaxes and the new keys it sees, in fp32.
  at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
    float own[MAXQ];
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const bool* sees = new_mask == nullptr ? nullptr : new_mask + bt * T;
      for (int64_t hg = 0; hg < H; ++hg) {
        const int64_t h = hg / G, r = t * G + hg % G;
        const float* qh = qf + (bt * H + hg) * D;
        for (int64_t u = 0; u < T; ++u)
          own[u] = (sees == nullptr ? u == t : sees[u]) ? dot<D>(qh, kf + ((b * T + u) * KVH + h) * D) * (float)scale
                                                          : NEG_INF;
        combine<D>(o + (bt * H + hg) * D, own, T, [&](int64_t u) { return vf + ((b * T + u) * KVH + h) * D; }, NT,
                   [&](int64_t th) { return parts.data() + (b * NT + th) * part_size + (h * R + r) * (D + 2); });
      }
    }
  });
  return out;
}

void check_pools(const char* op, const at::Tensor& k, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& table, const at::Tensor& key_mask) {
  TORCH_CHECK((k_pool.scalar_type() == at::kBFloat16 || k_pool.scalar_type() == at::kFloat) &&
              v_pool.scalar_type() == k_pool.scalar_type() && k_pool.dim() == 4 &&
              k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == k.size(-2) && k_pool.size(3) == k.size(-1) &&
              k_pool.is_contiguous() && v_pool.is_contiguous() && table.scalar_type() == at::kInt &&
              key_mask.scalar_type() == at::kBool, op, ": bf16 or fp32 pools [blocks, block, KVH, D], int32 table");
  TORCH_CHECK(k.size(-1) == 16 || k.size(-1) == 32 || k.size(-1) == 64 || k.size(-1) == 128, op,
              ": head_dim 16, 32, 64 or 128");
}

// `f(kp, vp)` on the two pools' data: an fp32 pool's as it is, a bf16 pool's as its raw 16 bits (`load_row` widens
// them).
template <typename F>
at::Tensor with_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, F f) {
  if (k_pool.scalar_type() == at::kFloat) return f(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  return f(reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>()));
}

template <int D>
at::Tensor of_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                   const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& key_mask, const bool* new_mask,
                   int64_t B, int64_t T, double scale, at::IntArrayRef sizes) {
  return with_pools(k_pool, v_pool, [&](const auto* kp, const auto* vp) {
    return attend<D>(q, k, v, k_pool, kp, vp, table, key_mask, new_mask, B, T, scale, sizes);
  });
}

template <typename... Args>
at::Tensor by_head_dim(int64_t D, Args&&... args) {
  switch (D) {
    case 16: return of_pool<16>(std::forward<Args>(args)...);
    case 32: return of_pool<32>(std::forward<Args>(args)...);
    case 64: return of_pool<64>(std::forward<Args>(args)...);
    default: return of_pool<128>(std::forward<Args>(args)...);
  }
}

// The decode step's: one query per sequence, q [B, H, D], k, v [B, KVH, D], key_mask [B, keys]. Returns fp32
// [B, KVH, H / KVH, D].
at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& key_mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= MAXG,
              "attend_paged: q [B, H, D] and k [B, KVH, D] with at most 8 query heads a KV head");
  check_pools("attend_paged", k, k_pool, v_pool, table, key_mask);
  const int64_t B = k.size(0), KVH = k.size(1), D = k.size(2);
  return by_head_dim(D, q, k, v, k_pool, v_pool, table, key_mask, nullptr, B, 1, scale,
                     at::IntArrayRef{B, KVH, q.size(1) / KVH, D});
}

// The query step's: T new tokens per sequence, q [B, T, H, D], k, v [B, T, KVH, D], key_mask [B, T, keys],
// new_mask [B, T, T]. Returns fp32 [B, T, H, D].
at::Tensor attend_paged_queries(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                                const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& key_mask,
                                const at::Tensor& new_mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
              q.size(2) % k.size(2) == 0 && q.size(2) / k.size(2) <= MAXG && q.size(1) <= MAXQ,
              "attend_paged_queries: q [B, T, H, D] and k [B, T, KVH, D] with at most 8 query heads a KV head and 64 "
              "queries a sequence");
  check_pools("attend_paged_queries", k, k_pool, v_pool, table, key_mask);
  const int64_t B = k.size(0), T = k.size(1), D = k.size(3);
  TORCH_CHECK(key_mask.dim() == 3 && key_mask.size(0) == B && key_mask.size(1) == T &&
              new_mask.scalar_type() == at::kBool && new_mask.dim() == 3 && new_mask.size(0) == B &&
              new_mask.size(1) == T && new_mask.size(2) == T,
              "attend_paged_queries: key_mask [B, T, keys] and new_mask [B, T, T], bool");
  const at::Tensor nc = new_mask.contiguous();
  return by_head_dim(D, q, k, v, k_pool, v_pool, table, key_mask, nc.data_ptr<bool>(), B, T, scale,
                     at::IntArrayRef{B, T, q.size(2), D});
}

// The flat step's: S sequences one after another in N new tokens (any number each, a decode's 1 or a prefill
// chunk's many), causal, each after its `cached` keys in the pool. A sequence of fewer than FLAT_LONG new tokens (a
// decode, a few drafted tokens) goes through `attend_range` (its cached keys split between the threads where there are
// fewer such sequences than threads) and the new keys each query sees, combined in fp32; longer ones through the tiled
// loops below (`attend_long`). On the AVX2 Zen 1 host the tiled loops took 0.34 ms for 8 new tokens after 500 cached
// (the bundled model's heads) against 0.65, and 0.19 ms against 0.11 for 2.
constexpr int64_t FLAT_LONG = 8;
static_assert(FLAT_LONG <= MAXQ, "a short sequence's queries and new keys fit `own` and `attend_range`");

// A sliding window (size 0: none) and the attention sinks beside it: the sequence's first `sinks` keys, which every
// query sees whatever the window.
struct Window {
  int64_t size, sinks;
};

// Query u of a sequence (at position cached + u) sees cached key j where no window cuts it.
inline bool in_window(int64_t position, int64_t key, Window window) {
  return window.size == 0 || key > position - window.size || key < window.sinks;
}

// A sequence of n >= FLAT_LONG new tokens (flat rows [start, start + n)) after its c cached keys: tiled attention with
// an online softmax (FlashAttention's). A work item is one KV head's block of queries, all G query heads of each: its
// rows r = t * G + g, padded to whole pairs of vectors. It walks the keys it sees in chunks of KC, each chunk's keys
// and values widened to fp32 beside it: the scores come out keys by rows ([KC, RP], the rows along the vectors), so
// the causal and window masks, the running maximum and sum and their corrections are vector ops over the rows; then
// the values weighted by the exponentials are added to the rows' outputs. Causal work is skipped a chunk at a time
// (half of a prompt's, where ATen's SDPA skips only whole 512-key blocks), and a sliding window's chunks before it.
constexpr int64_t KC = 64;  // keys a chunk
constexpr int KR = 4;  // keys a score tile holds (by two vectors of rows)
constexpr int VR = VREGS == 32 ? 8 : 4;  // rows a values tile holds (by two vectors of the head)

#if defined(__AVX512F__)
using vmask = __mmask16;
inline vmask vle(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline vmask vgt(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vmask vlt(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline vmask mask_or(vmask a, vmask b) { return a | b; }
inline vmask mask_and(vmask a, vmask b) { return a & b; }
inline vec scores_where(vmask m, vec s) { return _mm512_mask_blend_ps(m, vset1(NEG_INF), s); }
#else
using vmask = __m256;
inline vmask vle(vec a, vec b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline vmask vgt(vec a, vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline vmask vlt(vec a, vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline vmask mask_or(vmask a, vmask b) { return _mm256_or_ps(a, b); }
inline vmask mask_and(vmask a, vmask b) { return _mm256_and_ps(a, b); }
inline vec scores_where(vmask m, vec s) { return _mm256_blendv_ps(vset1(NEG_INF), s, m); }
#endif

// A flat step's new tokens: q [N, H, D], k and v [N, KVH, D] in fp32 (what `attend_block` and the short sequences
// read), and in bf16 where the long ones take `attend_block_pairs` (each null where not needed), read in place: a
// token's and a head's strides (`qs`, `ks`, `vs`), each head's D numbers side by side.
struct NewTokens {
  const float *qf, *kf, *vf;
  const uint16_t *qb, *kb, *vb;
  int64_t qs[2], ks[2], vs[2];
};

// A bf16 tensor whose heads lie in rows as it is, else in bf16 (a copy).
inline at::Tensor bf16_rows(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 && t.stride(-1) == 1 ? t : t.to(at::kBFloat16).contiguous();
}

// One work item's buffers, kept by its thread from item to item: fp32 (`attend_block`), and the bf16 pairs of the
// form with BF16 dot products (`attend_block_pairs`).
struct Tiles {
  std::vector<float> qt, scores, out, keys, values, max, sum, correction, position;
  std::vector<uint32_t> qpairs, vpairs, ppairs;
  std::vector<uint16_t> keys16, values16;
};

// A work item's rows (query u0 + t's heads h * G + g, r = t * G + g, padded to RP) before its first chunk: each row's
// position, no maximum yet, nothing summed.
inline void start_rows(Tiles& b, int64_t c, int64_t u0, int64_t R, int64_t RP, int64_t G, int64_t D) {
  b.scores.resize(KC * RP);  // [KC, RP]: a chunk's scores, then their exponentials
  b.out.assign(RP * D, 0.f);  // [RP, D]: the rows' weighted values, not yet divided by their sums
  b.max.assign(RP, NEG_INF);
  b.sum.assign(RP, 0.f);
  b.correction.resize(RP);
  b.position.resize(RP);
  for (int64_t r = 0; r < RP; ++r)  // a padding row sees what the last row sees
    b.position[r] = static_cast<float>(c + u0 + std::min(r, R - 1) / G);
}

// A chunk's scores (keys [j0, j0 + kc), b.scores [kc, RP]) -> their exponentials: the masks (where the chunk reaches
// past the first row's position, or a window cuts), the running maximum and sum and the corrections of the rows'
// earlier sums, a vector of rows at a time.
inline void softmax_chunk(Tiles& b, int64_t RP, int64_t j0, int64_t kc, int64_t c, int64_t u0, Window window) {
  const bool masked = j0 + kc - 1 > c + u0 || window.size > 0;
  for (int64_t rv = 0; rv < RP / LANES; ++rv) {
    const vec position = vload(b.position.data() + rv * LANES);
    const vec lowest = vsub(position, vset1(static_cast<float>(window.size)));
    vec m = vload(b.max.data() + rv * LANES);
    const vec before = m;
    for (int64_t j = 0; j < kc; ++j) {
      float* s = b.scores.data() + j * RP + rv * LANES;
      vec x = vload(s);
      if (masked) {
        const vec key = vset1(static_cast<float>(j0 + j));
        vmask sees = vle(key, position);
        if (window.size > 0)
          sees = mask_and(sees, mask_or(vgt(key, lowest), vlt(key, vset1(static_cast<float>(window.sinks)))));
        x = scores_where(sees, x);
        vstoreu(s, x);
      }
      m = vmax(m, x);
    }
    // A row that has seen no key yet has a maximum of -inf: its correction and exponentials come out 0 (exp_neg's
    // clamp, then keep_seen), and its sums stay 0.
    const vec correction = keep_seen(exp_neg(vsub(before, m)), before);
    vec total = vzero();
    for (int64_t j = 0; j < kc; ++j) {
      float* s = b.scores.data() + j * RP + rv * LANES;
      const vec x = vload(s);
      const vec e = keep_seen(exp_neg(vsub(x, m)), x);
      vstoreu(s, e);
      total = vadd(total, e);
    }
    vstoreu(b.max.data() + rv * LANES, m);
    vstoreu(b.sum.data() + rv * LANES, vfma(vload(b.sum.data() + rv * LANES), correction, total));
    vstoreu(b.correction.data() + rv * LANES, correction);
  }
}

// Each row's weighted values over its sum, into the output [N, H, D].
inline void finish_rows(const Tiles& b, int64_t start, int64_t u0, int64_t R, int64_t G, int64_t h, int64_t H,
                        int64_t D, float* o) {
  for (int64_t r = 0; r < R; ++r) {
    float* oh = o + ((start + u0 + r / G) * H + h * G + r % G) * D;
    const float inverse = 1.f / b.sum[r];
    for (int64_t d = 0; d < D; ++d) oh[d] = b.out[r * D + d] * inverse;
  }
}

// A values tile's sums (VR rows by CV vectors of the head from row r0, feature d0): the rows' earlier sums times their
// corrections, to add the chunk's weighted values to; then back.
template <int CV>
inline void corrected_sums(vec (&acc)[VR][CV], const Tiles& b, int64_t r0, int64_t d0, int64_t D) {
  for (int i = 0; i < VR; ++i)
    for (int v = 0; v < CV; ++v)
      acc[i][v] = vmul(vload(b.out.data() + (r0 + i) * D + d0 + v * LANES), vset1(b.correction[r0 + i]));
}
template <int CV>
inline void store_sums(const vec (&acc)[VR][CV], Tiles& b, int64_t r0, int64_t d0, int64_t D) {
  for (int i = 0; i < VR; ++i)
    for (int v = 0; v < CV; ++v) vstoreu(b.out.data() + (r0 + i) * D + d0 + v * LANES, acc[i][v]);
}

// Whether the chunk of keys [j0, j1) lies before every row's sliding window (and past its sinks): nothing to do.
inline bool before_window(int64_t j0, int64_t j1, int64_t c, int64_t u0, Window window) {
  return window.size > 0 && j0 >= window.sinks && j1 - 1 <= c + u0 - window.size;
}

template <int D, typename P>
void attend_block(const float* qf, const float* kf, const float* vf, const P* kp, const P* vp, const int32_t* table,
                  int64_t BS, int64_t start, int64_t c, int64_t u0, int64_t u1, int64_t h, int64_t H, int64_t KVH,
                  Window window, float scale, Tiles& b, float* o) {
  constexpr int CV = D / LANES >= 2 ? 2 : 1;  // vectors of the head a values tile holds
  const int64_t G = H / KVH, R = (u1 - u0) * G, RP = (R + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
  const int64_t row = KVH * D;
  start_rows(b, c, u0, R, RP, G, D);
  b.qt.assign(D * RP, 0.f);  // the queries scaled, [D, RP]
  b.keys.resize((KC + KR) * D);  // a chunk's keys in fp32, [KC, D], and room for the last score tile's zeros
  b.values.resize(KC * D);
  for (int64_t r = 0; r < R; ++r) {
    const float* qh = qf + ((start + u0 + r / G) * H + h * G + r % G) * D;
    for (int d = 0; d < D; ++d) b.qt[d * RP + r] = qh[d] * scale;
  }
  const int64_t last = c + u1 - 1;  // the last key any row sees
  for (int64_t j0 = 0; j0 <= last; j0 += KC) {
    const int64_t j1 = std::min(last + 1, j0 + KC), kc = j1 - j0;
    if (before_window(j0, j1, c, u0, window)) continue;
    for (int64_t j = j0; j < j1; ++j) {  // the chunk's keys and values, widened
      float* kd = b.keys.data() + (j - j0) * D;
      float* vd = b.values.data() + (j - j0) * D;
      if (j < c) {
        const int64_t at = table[j / BS] * BS * row + (j % BS) * row + h * D;
        for (int i = 0; i < D / LANES; ++i) {
          vstoreu(kd + LANES * i, load_row(kp + at + LANES * i));
          vstoreu(vd + LANES * i, load_row(vp + at + LANES * i));
        }
      } else {
        std::copy(kf + (start + j - c) * row + h * D, kf + (start + j - c) * row + (h + 1) * D, kd);
        std::copy(vf + (start + j - c) * row + h * D, vf + (start + j - c) * row + (h + 1) * D, vd);
      }
    }
    std::fill(b.keys.data() + kc * D, b.keys.data() + (kc + KR - 1) / KR * KR * D, 0.f);  // the last tile's rest
    // 1. The scores, KR keys by two vectors of rows a tile.
    for (int64_t jt = 0; jt < kc; jt += KR)
      for (int64_t r0 = 0; r0 < RP; r0 += 2 * LANES) {
        vec acc[KR][2];
        for (int i = 0; i < KR; ++i) acc[i][0] = acc[i][1] = vzero();
        const float* kt = b.keys.data() + jt * D;
        const float* qt = b.qt.data() + r0;
        for (int d = 0; d < D; ++d) {
          const vec q0 = vload(qt + d * RP), q1 = vload(qt + d * RP + LANES);
          for (int i = 0; i < KR; ++i) {
            const vec kb = vset1(kt[i * D + d]);
            acc[i][0] = vfma(kb, q0, acc[i][0]);
            acc[i][1] = vfma(kb, q1, acc[i][1]);
          }
        }
        for (int i = 0; i < KR && jt + i < kc; ++i) {
          vstoreu(b.scores.data() + (jt + i) * RP + r0, acc[i][0]);
          vstoreu(b.scores.data() + (jt + i) * RP + r0 + LANES, acc[i][1]);
        }
      }
    // 2. Their exponentials.
    softmax_chunk(b, RP, j0, kc, c, u0, window);
    // 3. The values weighted by them, VR rows by CV vectors of the head a tile, the rows' earlier sums corrected.
    for (int64_t r0 = 0; r0 < RP; r0 += VR)
      for (int d0 = 0; d0 < D; d0 += CV * LANES) {
        vec acc[VR][CV];
        corrected_sums<CV>(acc, b, r0, d0, D);
        for (int64_t j = 0; j < kc; ++j) {
          vec vv[CV];
          for (int v = 0; v < CV; ++v) vv[v] = vload(b.values.data() + j * D + d0 + v * LANES);
          const float* p = b.scores.data() + j * RP + r0;
          for (int i = 0; i < VR; ++i) {
            const vec pb = vset1(p[i]);
            for (int v = 0; v < CV; ++v) acc[i][v] = vfma(pb, vv[v], acc[i][v]);
          }
        }
        store_sums<CV>(acc, b, r0, d0, D);
      }
  }
  finish_rows(b, start, u0, R, G, h, H, D, o);
}

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
// fp32 x -> its bf16 bits (round to nearest even), 16 at a time, each in the low half of a 32-bit lane.
inline __m512i bf16_lanes(vec x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }
// Two fp32 rows of 16 -> 16 pairs (a's bf16 low, b's high): what one vdpbf16ps multiplies in pairs.
inline __m512i bf16_pairs(vec a, vec b) {
  return _mm512_or_si512(bf16_lanes(a), _mm512_slli_epi32(bf16_lanes(b), 16));
}
inline __m512i bf16_pairs(const uint16_t* a, const uint16_t* b) {  // two bf16 rows of 16
  return _mm512_or_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)a)),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)b)), 16));
}
inline vec dot_pairs(vec acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// `attend_block` over a bf16 pool where the CPU has BF16 dot products: the same tiles, with both matrix products in
// bf16 pairs, one vdpbf16ps doing two fused multiply-adds' work. The scores multiply the queries by the keys as they
// are (bf16 in the pool and in a bf16 model's new tokens: exact products, fp32 sums); the exponentials are rounded to
// bf16 for the weighted values (as FlashAttention's GPU kernels round them), their sums kept in fp32.
constexpr int KR2 = 8;  // keys a score tile holds (by two vectors of rows): 16 sums in flight
template <int D>
void attend_block_pairs(const NewTokens& x, const uint16_t* kp, const uint16_t* vp, const int32_t* table, int64_t BS,
                        int64_t start, int64_t c, int64_t u0, int64_t u1, int64_t h, int64_t H, int64_t KVH,
                        Window window, float scale, Tiles& b, float* o) {
  constexpr int D2 = D / 2, CV = D / LANES >= 2 ? 2 : 1;
  const int64_t G = H / KVH, R = (u1 - u0) * G, RP = (R + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
  const int64_t row = KVH * D;
  start_rows(b, c, u0, R, RP, G, D);
  b.qpairs.assign(D2 * RP, 0u);  // the queries' pairs [D / 2, RP]
  b.keys16.resize((KC + KR2) * D);  // a chunk's keys [KC, D] (pairs along the head), and the last tile's zeros
  b.values16.resize((KC + 1) * D);  // a chunk's values [KC, D], and an odd chunk's last pair's zeros
  b.vpairs.resize(KC / 2 * D);  // [KC / 2, D]: values of keys 2i and 2i + 1 side by side
  b.ppairs.resize(KC / 2 * RP);  // [KC / 2, RP]: the rows' exponentials of keys 2i and 2i + 1 side by side
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* qh = x.qb + (start + u0 + r / G) * x.qs[0] + (h * G + r % G) * x.qs[1];
    for (int i = 0; i < D2; ++i) b.qpairs[i * RP + r] = qh[2 * i] | static_cast<uint32_t>(qh[2 * i + 1]) << 16;
  }
  const vec vscale = vset1(scale);
  const int64_t last = c + u1 - 1;
  for (int64_t j0 = 0; j0 <= last; j0 += KC) {
    const int64_t j1 = std::min(last + 1, j0 + KC), kc = j1 - j0, kp2 = (kc + 1) / 2;
    if (before_window(j0, j1, c, u0, window)) continue;
    for (int64_t j = j0; j < j1; ++j) {  // the chunk's keys and values in bf16
      uint16_t* kd = b.keys16.data() + (j - j0) * D;
      uint16_t* vd = b.values16.data() + (j - j0) * D;
      if (j < c) {
        const int64_t at = table[j / BS] * BS * row + (j % BS) * row + h * D;
        std::copy(kp + at, kp + at + D, kd);
        std::copy(vp + at, vp + at + D, vd);
      } else {
        const uint16_t* kn = x.kb + (start + j - c) * x.ks[0] + h * x.ks[1];
        const uint16_t* vn = x.vb + (start + j - c) * x.vs[0] + h * x.vs[1];
        std::copy(kn, kn + D, kd);
        std::copy(vn, vn + D, vd);
      }
    }
    std::fill(b.keys16.data() + kc * D, b.keys16.data() + (kc + KR2 - 1) / KR2 * KR2 * D, uint16_t{0});
    std::fill(b.values16.data() + kc * D, b.values16.data() + 2 * kp2 * D, uint16_t{0});
    for (int64_t i = 0; i < kp2; ++i)
      for (int d = 0; d < D; d += LANES)
        _mm512_storeu_si512(b.vpairs.data() + i * D + d, bf16_pairs(b.values16.data() + 2 * i * D + d,
                                                                     b.values16.data() + (2 * i + 1) * D + d));
    // 1. The scores, KR2 keys by two vectors of rows a tile.
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(b.keys16.data());
    for (int64_t jt = 0; jt < kc; jt += KR2)
      for (int64_t r0 = 0; r0 < RP; r0 += 2 * LANES) {
        vec acc[KR2][2];
        for (int i = 0; i < KR2; ++i) acc[i][0] = acc[i][1] = vzero();
        const uint32_t* kt = keys + jt * D2;
        const uint32_t* qt = b.qpairs.data() + r0;
        for (int d = 0; d < D2; ++d) {
          const __m512i q0 = _mm512_loadu_si512(qt + d * RP), q1 = _mm512_loadu_si512(qt + d * RP + LANES);
          for (int i = 0; i < KR2; ++i) {
            const __m512i kb = _mm512_set1_epi32(static_cast<int32_t>(kt[i * D2 + d]));
            acc[i][0] = dot_pairs(acc[i][0], q0, kb);
            acc[i][1] = dot_pairs(acc[i][1], q1, kb);
          }
        }
        for (int i = 0; i < KR2 && jt + i < kc; ++i) {
          vstoreu(b.scores.data() + (jt + i) * RP + r0, vmul(acc[i][0], vscale));
          vstoreu(b.scores.data() + (jt + i) * RP + r0 + LANES, vmul(acc[i][1], vscale));
        }
      }
    // 2. Their exponentials, then in bf16 pairs of keys (an odd chunk's last with a 0).
    softmax_chunk(b, RP, j0, kc, c, u0, window);
    for (int64_t i = 0; i < kp2; ++i)
      for (int64_t r = 0; r < RP; r += LANES) {
        const vec odd = 2 * i + 1 < kc ? vload(b.scores.data() + (2 * i + 1) * RP + r) : vzero();
        _mm512_storeu_si512(b.ppairs.data() + i * RP + r, bf16_pairs(vload(b.scores.data() + 2 * i * RP + r), odd));
      }
    // 3. The values weighted by them, VR rows by CV vectors of the head a tile, a pair of keys a vdpbf16ps.
    for (int64_t r0 = 0; r0 < RP; r0 += VR)
      for (int d0 = 0; d0 < D; d0 += CV * LANES) {
        vec acc[VR][CV];
        corrected_sums<CV>(acc, b, r0, d0, D);
        for (int64_t j = 0; j < kp2; ++j) {
          __m512i vv[CV];
          for (int v = 0; v < CV; ++v) vv[v] = _mm512_loadu_si512(b.vpairs.data() + j * D + d0 + v * LANES);
          const uint32_t* p = b.ppairs.data() + j * RP + r0;
          for (int i = 0; i < VR; ++i) {
            const __m512i pb = _mm512_set1_epi32(static_cast<int32_t>(p[i]));
            for (int v = 0; v < CV; ++v) acc[i][v] = dot_pairs(acc[i][v], vv[v], pb);
          }
        }
        store_sums<CV>(acc, b, r0, d0, D);
      }
  }
  finish_rows(b, start, u0, R, G, h, H, D, o);
}
#pragma GCC pop_options
#endif

// Query rows a work item takes (its queries times G, up to a whole pair of vectors): 32 queries of the bundled
// model's 3 heads a KV head. On the AVX2 Zen 1 host 512 new tokens took 6.1 ms a layer so, 6.6 with 16 queries.
constexpr int64_t BLOCK_ROWS = 96;

// Whether this CPU runs `attend_block_pairs` (AVX-512 with BF16), and whether bf16 pools take it
// (`set_attention_pairs`: on where it runs; off, the fp32 loops, the reference it is tested against).
inline bool pairs_supported() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
std::atomic<bool> use_pairs{pairs_supported()};

bool set_attention_pairs(bool on) {  // returns the setting before
  return use_pairs.exchange(on && pairs_supported());
}

template <int D, typename P>
void attend_long(const NewTokens& x, const P* kp, const P* vp, const int32_t* table, int64_t BS, int64_t start,
                 int64_t n, int64_t c, int64_t H, int64_t KVH, Window window, double scale, float* o) {
  const int64_t TQ = std::max<int64_t>(1, BLOCK_ROWS / (H / KVH)), blocks = (n + TQ - 1) / TQ;
  // Items in the order first, last, second, second to last...: a causal block's work grows with its index, and
  // at::parallel_for gives each thread a contiguous range.
  at::parallel_for(0, blocks * KVH, 1, [&](int64_t begin, int64_t end) {
    Tiles tiles;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / KVH, h = item % KVH, q = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      const int64_t u0 = q * TQ, u1 = std::min(n, (q + 1) * TQ);
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<P, uint16_t>) {
        if (x.qb) {
          attend_block_pairs<D>(x, kp, vp, table, BS, start, c, u0, u1, h, H, KVH, window, static_cast<float>(scale),
                                tiles, o);
          continue;
        }
      }
#endif
      attend_block<D>(x.qf, x.kf, x.vf, kp, vp, table, BS, start, c, u0, u1, h, H, KVH, window,
                      static_cast<float>(scale), tiles, o);
    }
  });
}

template <int D, typename P>
at::Tensor attend_flat(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const P* kp, const P* vp,
                       int64_t BS, const at::Tensor& table, const int32_t* st, const int32_t* ca, Window window,
                       double scale) {
  const int64_t N = q.size(0), H = q.size(1), KVH = k.size(1), G = H / KVH, S = table.size(0), TB = table.size(1);
  const int32_t* tp = table.data_ptr<int32_t>();  // contiguous (`attend_paged_flat`)
  auto out = at::empty({N, H, D}, q.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  std::vector<int64_t> shorts, longs;
  int64_t most_blocks = 1;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = st[s + 1] - st[s];
    if (n >= FLAT_LONG) {
      longs.push_back(s);
    } else if (n > 0) {
      shorts.push_back(s);
      most_blocks = std::max<int64_t>(most_blocks, (ca[s] + BS - 1) / BS);
    }
  }
  NewTokens x{};
  const bool pairs = std::is_same_v<P, uint16_t> && use_pairs && !longs.empty();
  at::Tensor qb, kb, vb;
  if (pairs) {
    qb = bf16_rows(q);
    kb = bf16_rows(k);
    vb = bf16_rows(v);
    x.qb = reinterpret_cast<const uint16_t*>(qb.data_ptr<at::BFloat16>());
    x.kb = reinterpret_cast<const uint16_t*>(kb.data_ptr<at::BFloat16>());
    x.vb = reinterpret_cast<const uint16_t*>(vb.data_ptr<at::BFloat16>());
    for (int i = 0; i < 2; ++i) {
      x.qs[i] = qb.stride(i);
      x.ks[i] = kb.stride(i);
      x.vs[i] = vb.stride(i);
    }
  }
  std::vector<float> buffer;
  if (!pairs || !shorts.empty()) {
    buffer.resize((N * H + 2 * N * KVH) * D);
    x.qf = buffer.data();
    x.kf = x.qf + N * H * D;
    x.vf = x.kf + N * KVH * D;
    to_floats(q, buffer.data());
    to_floats(k, buffer.data() + N * H * D);
    to_floats(v, buffer.data() + N * (H + KVH) * D);
  }
  for (int64_t s : longs)
    attend_long<D>(x, kp, vp, tp + s * TB, BS, st[s], st[s + 1] - st[s], ca[s], H, KVH, window, scale, o);
  if (shorts.empty()) return out;
  const int64_t R = static_cast<int64_t>(shorts.size()), threads = at::get_num_threads();
  const int64_t NT = std::max<int64_t>(1, std::min<int64_t>(most_blocks, (threads + R - 1) / R));
  const int64_t part_size = KVH * FLAT_LONG * G * (D + 2);
  std::vector<float> parts(R * NT * part_size);
  at::parallel_for(0, R * NT, 1, [&](int64_t begin, int64_t end) {  // each (sequence, range of its cached key blocks)
    std::vector<float> scores;
    std::vector<char> seen;
    std::unique_ptr<bool[]> mask;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = shorts[item / NT], th = item % NT, T = st[s + 1] - st[s], c = ca[s], blocks = (c + BS - 1) / BS;
      mask.reset(new bool[std::max<int64_t>(1, T * c)]);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < c; ++j) mask[t * c + j] = in_window(c + t, j, window);
      attend_range<D>(x.qf + st[s] * H * D, T, KVH, G, kp, vp, BS, tp + s * TB, mask.get(), c, blocks * th / NT,
                      blocks * (th + 1) / NT, (float)scale, parts.data() + item * part_size, scores, seen);
    }
  });
  // Each query's ranges' partial softmaxes and the new keys it sees (its sequence's up to itself), in fp32.
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    float own[FLAT_LONG];
    for (int64_t ri = begin; ri < end; ++ri) {
      const int64_t s = shorts[ri], T = st[s + 1] - st[s], RR = T * G, first = st[s], c = ca[s];
      for (int64_t t = 0; t < T; ++t)
        for (int64_t hg = 0; hg < H; ++hg) {
          const int64_t h = hg / G, row = t * G + hg % G;
          const float* qh = x.qf + ((first + t) * H + hg) * D;
          for (int64_t u = 0; u <= t; ++u)
            own[u] = in_window(c + t, c + u, window) ? dot<D>(qh, x.kf + ((first + u) * KVH + h) * D) * (float)scale
                                                     : NEG_INF;
          combine<D>(o + ((first + t) * H + hg) * D, own, t + 1,
                     [&](int64_t u) { return x.vf + ((first + u) * KVH + h) * D; }, NT,
                     [&](int64_t th) { return parts.data() + (ri * NT + th) * part_size + (h * RR + row) * (D + 2); });
        }
    }
  });
  return out;
}

template <int D>
at::Tensor flat_of_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& table, const int32_t* st, const int32_t* ca,
                        Window window, double scale) {
  return with_pools(k_pool, v_pool, [&](const auto* kp, const auto* vp) {
    return attend_flat<D>(q, k, v, kp, vp, k_pool.size(1), table, st, ca, window, scale);
  });
}

// q [N, H, D], k, v [N, KVH, D]: the N new tokens of S sequences, sequence s's at [starts[s], starts[s + 1]) after
// its cached[s] keys in the pool (k_pool, v_pool one layer's [blocks, BS, KVH, D], bf16 or fp32), read through
// table [S, blocks] int32. window [1] or [2] int32: a sliding window's size (0: none), then the attention sinks beside
// it (0 where left out). Returns fp32 [N, H, D].
at::Tensor attend_paged_flat(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& starts,
                             const at::Tensor& cached, const at::Tensor& window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
              q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= MAXG,
              "attend_paged_flat: q [N, H, D] and k, v [N, KVH, D] with at most 8 query heads a KV head");
  const int64_t D = k.size(2), N = k.size(0);
  TORCH_CHECK((k_pool.scalar_type() == at::kBFloat16 || k_pool.scalar_type() == at::kFloat) &&
              v_pool.scalar_type() == k_pool.scalar_type() && k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() &&
              k_pool.size(2) == k.size(1) && k_pool.size(3) == D && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "attend_paged_flat: bf16 or fp32 pools [blocks, block, KVH, D]");
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "attend_paged_flat: head_dim 16, 32, 64 or 128");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && starts.scalar_type() == at::kInt &&
              starts.dim() == 1 && starts.size(0) == table.size(0) + 1 && cached.scalar_type() == at::kInt &&
              cached.dim() == 1 && cached.size(0) == table.size(0) && window.scalar_type() == at::kInt &&
              (window.numel() == 1 || window.numel() == 2),
              "attend_paged_flat: int32 table [S, blocks], starts [S + 1], cached [S] and window [1] or [2]");
  const auto sc = starts.contiguous(), cc = cached.contiguous(), tc = table.contiguous();
  const int32_t* st = sc.data_ptr<int32_t>();
  const int32_t* ca = cc.data_ptr<int32_t>();
  const int32_t* tp = tc.data_ptr<int32_t>();
  const int64_t S = table.size(0), TB = table.size(1), BS = k_pool.size(1), blocks = k_pool.size(0);
  const auto wc = window.contiguous();
  const Window w{wc.data_ptr<int32_t>()[0], wc.numel() == 2 ? wc.data_ptr<int32_t>()[1] : 0};
  TORCH_CHECK(st[0] == 0 && st[S] == N && w.size >= 0 && w.sinks >= 0,
              "attend_paged_flat: starts from 0 to the N tokens, a window and sinks >= 0");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(st[s] <= st[s + 1] && ca[s] >= 0 && ca[s] <= TB * BS,
                "attend_paged_flat: starts in order, each sequence's cached keys within its table's blocks");
    for (int64_t b = 0; b < (ca[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[s * TB + b] >= 0 && tp[s * TB + b] < blocks,
                  "attend_paged_flat: a block table entry outside the pool");
  }
  switch (D) {
    case 16: return flat_of_pool<16>(q, k, v, k_pool, v_pool, tc, st, ca, w, scale);
    case 32: return flat_of_pool<32>(q, k, v, k_pool, v_pool, tc, st, ca, w, scale);
    case 64: return flat_of_pool<64>(q, k, v, k_pool, v_pool, tc, st, ca, w, scale);
    default: return flat_of_pool<128>(q, k, v, k_pool, v_pool, tc, st, ca, w, scale);
  }
}

}  // namespace attention

TORCH_LIBRARY_FRAGMENT(inference_core, m) {
  m.def("set_attention_pairs(bool on) -> bool", attention::set_attention_pairs);  // no tensors: one kernel
  m.def("attention_pairs_supported() -> bool", attention::pairs_supported);
  m.def("attend_paged(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor table, Tensor key_mask, "
        "float scale) -> Tensor");
  m.def("attend_paged_queries(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor table, "
        "Tensor key_mask, Tensor new_mask, float scale) -> Tensor");
  m.def("attend_paged_flat(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor table, Tensor starts, "
        "Tensor cached, Tensor window, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) {
  m.impl("attend_paged", attention::attend_paged);
  m.impl("attend_paged_queries", attention::attend_paged_queries);
  m.impl("attend_paged_flat", attention::attend_paged_flat);
}
"""


def register_fake() -> None:
    """The ops' output shapes for export, as torch.library's fake kernels (called once the extension is built)."""
    torch.library.register_fake("inference_core::attend_paged")(_decode_output_shape)
    torch.library.register_fake("inference_core::attend_paged_queries")(_queries_output_shape)
    torch.library.register_fake("inference_core::attend_paged_flat")(_queries_output_shape)


def _decode_output_shape(q, k, v, k_pool, v_pool, table, key_mask, scale):
    """`attend_paged`'s output without computing it: fp32 [B, KVH, group, D]."""
    batch, kv_heads, head_dim = k.shape
    return q.new_empty(batch, kv_heads, q.shape[1] // kv_heads, head_dim, dtype=torch.float32)


def _queries_output_shape(q, *pools_tables_and_scale):
    """`attend_paged_queries`' and `attend_paged_flat`'s output without computing it: fp32, q's shape ([B, T, H, D],
    or [N, H, D])."""
    return q.new_empty(q.shape, dtype=torch.float32)


def takes(q: torch.Tensor, k: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the op takes this layer's attention: a layer's bf16 or fp32 paged pool on the CPU ([blocks, block, KVH,
    D]), head_dim in HEAD_DIMS, at most MAX_GROUP query heads a KV head (q [B, H * D] or [B, H, D], k [B, KVH, D])."""
    kv_heads, head_dim = k.shape[-2:]
    heads = q.shape[-1] // head_dim if q.dim() == 2 else q.shape[1]
    return (k_pool.device.type == "cpu" and k_pool.dtype in (torch.bfloat16, torch.float32) and k_pool.dim() == 4
            and tuple(k_pool.shape[-2:]) == (kv_heads, head_dim) and head_dim in HEAD_DIMS
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP)


def attend(q, k, v, k_pool, v_pool, table, key_mask, scale: float) -> torch.Tensor:
    """`engine.compiled._attend_one_fused` over the paged context, through the op: q [B, H * D] or [B, H, D]; k, v
    [B, KVH, D]; k_pool, v_pool one layer's [blocks, block, KVH, D]; table [B, blocks]; key_mask [B, keys]. Returns
    fp32 [B, KVH, group, D]."""
    return torch.ops.inference_core.attend_paged(q.reshape(q.shape[0], -1, k.shape[-1]), k, v, k_pool, v_pool, table,
                                                 key_mask, scale)


def attend_queries(q, k, v, k_pool, v_pool, table, key_mask, new_mask, scale: float) -> torch.Tensor:
    """`engine.query_graph.attend_queries` over the paged context, through the op: T new tokens per sequence, q
    [B, T, heads, D]; k, v [B, T, KVH, D]; k_pool, v_pool one layer's [blocks, block, KVH, D]; table [B, blocks];
    key_mask [B, T, keys]; new_mask [B, T, T]. Returns fp32 [B, T, heads, D]."""
    return torch.ops.inference_core.attend_paged_queries(q, k, v, k_pool, v_pool, table, key_mask, new_mask, scale)


def pairs_available() -> bool:
    """Whether this CPU runs the tiled loops' bf16 pairs form (AVX-512 with BF16 dot products; the extension built)."""
    return torch.ops.inference_core.attention_pairs_supported()


@contextlib.contextmanager
def pairs_form(on: bool):
    """Long sequences over a bf16 pool through the bf16 pairs form (`on`, where the CPU has it) or the fp32 loops, the
    reference, while inside (for tests and A/B timings; process-wide)."""
    previous = torch.ops.inference_core.set_attention_pairs(on)
    try:
        yield
    finally:
        torch.ops.inference_core.set_attention_pairs(previous)


def takes_flat(q: torch.Tensor, k: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the flat op takes this layer's attention: a layer's bf16 or fp32 paged pool on the CPU ([blocks, block,
    KVH, D]), head_dim in HEAD_DIMS, at most MAX_GROUP query heads a KV head (q [N, H, D], k [N, KVH, D])."""
    kv_heads, head_dim = k.shape[-2:]
    return (k_pool.device.type == "cpu" and k_pool.dtype in (torch.bfloat16, torch.float32) and k_pool.dim() == 4
            and tuple(k_pool.shape[-2:]) == (kv_heads, head_dim) and head_dim in HEAD_DIMS
            and q.shape[1] % kv_heads == 0 and q.shape[1] // kv_heads <= MAX_GROUP)


def attend_flat(q, k, v, k_pool, v_pool, table, starts, cached, window, scale: float) -> torch.Tensor:
    """The flat step's attention (`engine.query_graph.FlatGraph`) through the op: N new tokens of S sequences one after
    another, q [N, heads, D]; k, v [N, KVH, D]; k_pool, v_pool one layer's [blocks, block, KVH, D]; table [S, blocks],
    starts [S + 1] (sequence s's tokens are rows [starts[s], starts[s + 1])), cached [S] (its keys in the pool before
    them), all int32; window a sliding window's size and the attention sinks beside it (an int32 [2] tensor, or [1]
    for a window alone; an int; None: no window). Each token sees its sequence's cached keys and its new keys up to
    itself, within the window, and its sequence's first sinks keys. Returns fp32 [N, heads, D]."""
    if not isinstance(window, torch.Tensor):
        window = torch.tensor([window or 0], dtype=torch.int32)
    return torch.ops.inference_core.attend_paged_flat(q, k, v, k_pool, v_pool, table, starts, cached, window, scale)
