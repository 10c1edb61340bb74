"""Our kernel for the compiled decode step's paged attention on an AVX-512 or AVX2 CPU: one query per sequence against
its cached keys, read through the block table from the bf16 pool in place, and its own new key.

What inductor generates for `_attend_one_fused` (in `engine.compiled`) reads each cached key once per query head,
reduces every dot product on its own, and runs the mask and the softmax on one thread between its parallel loops: on
the 2-core Zen 5 host the compiled step took 2.4 us more a cached key (for all 30 layers of the bundled model), about
10 GB/s of the cache read. Here each thread takes a contiguous range of the key blocks; per KV head it reads each
cached key once for the group's query heads (fp32 sums of bf16 values widened by a shift), stores the scores, takes
their exponentials a vector at a time (`exp_neg`, a polynomial), and sums the values weighted by them. The threads'
partial softmaxes (the maximum, the sum, the weighted values) and the own key are then combined in fp32. Its outputs
equal `_attend_one_fused`'s to fp32 rounding (`tests/model/test_attention_kernel.py`), with AVX-512's vectors or
AVX2's (the build's flags choose: `model.row_kernel.FLAGS`).

It is built into the same extension as the projection kernel (`model.row_kernel`, which owns the build) and called
from the compiled step where `takes` says so while exporting: paged, bf16 pool, head_dim 64 or 128, at most 8 query
heads a KV head.
"""

from __future__ import annotations

import torch

MAX_GROUP = 8  # query heads a KV head the op takes
HEAD_DIMS = (64, 128)

SOURCE = r"""
#include <cmath>
#include <limits>

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
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Software prefetch of one block of the pool into L2: the block table sends each block's read to an address the
// hardware prefetcher cannot guess, so the thread asks for its keys' and values' blocks PREFETCH_BLOCKS ahead of the
// one it computes (many misses in flight instead of one block's at a time).
constexpr int64_t PREFETCH_BLOCKS = 8;
inline void prefetch_block(const uint16_t* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// One sequence's cached keys in the blocks [b0, b1) for every KV head: for each query head h*G+g, part = {max, sum,
// acc[D]}, the maximum score, the sum of exp(score - max) and the sum of exp(score - max) * value. Each block (BS
// positions of every KV head, one contiguous run) is read once for all heads.
template <int D>
void attend_range(const float* q, int64_t KVH, int64_t G, const uint16_t* kp, const uint16_t* vp, int64_t BS,
                  const int32_t* table, const bool* mask, int64_t W, int64_t b0, int64_t b1, float scale, float* part,
                  std::vector<float>& scores) {
  constexpr int C = D / LANES;
  const int64_t H = KVH * G, j0 = b0 * BS, j1 = std::min(W, b1 * BS), n = std::max<int64_t>(0, j1 - j0);
  const int64_t row = KVH * D, block_stride = BS * row, block_bytes = block_stride * 2;
  scores.resize(std::max<int64_t>(1, H * n));
  std::vector<float> mx(H, NEG_INF);
  auto prefetch = [&](int64_t b) {
    if (b < b1) {
      prefetch_block(kp + table[b] * block_stride, block_bytes);
      prefetch_block(vp + table[b] * block_stride, block_bytes);
    }
  };
  for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS; ++b) prefetch(b);
  for (int64_t b = b0; b < b1; ++b) {  // 1. the scores, block by block
    const uint16_t* kb = kp + table[b] * block_stride;
    prefetch(b + PREFETCH_BLOCKS);
    const int64_t jb = b * BS, je = std::min(j1, jb + BS);
    for (int64_t h = 0; h < KVH; ++h) {
      vec qv[MAXG][C];
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) qv[g][c] = vmul(vload(q + (h * G + g) * D + LANES * c), vset1(scale));
      for (int64_t j = jb; j < je; ++j) {
        float* s = scores.data() + h * G * n + (j - j0);
        if (!mask[j]) {
          for (int64_t g = 0; g < G; ++g) s[g * n] = NEG_INF;
          continue;
        }
        const uint16_t* k = kb + (j - jb) * row + h * D;
        vec kv[C];
        for (int c = 0; c < C; ++c) kv[c] = widen(k + LANES * c);
        for (int64_t g = 0; g < G; ++g) {
          vec a = vmul(qv[g][0], kv[0]);
          for (int c = 1; c < C; ++c) a = vfma(qv[g][c], kv[c], a);
          s[g * n] = vsum(a);
          mx[h * G + g] = std::max(mx[h * G + g], s[g * n]);
        }
      }
    }
  }
  for (int64_t hg = 0; hg < H; ++hg) {  // 2. their exponentials and sums, a vector at a time
    float* s = scores.data() + hg * n;
    float* out = part + hg * (D + 2);
    out[0] = mx[hg];
    out[1] = 0.f;
    std::fill(out + 2, out + 2 + D, 0.f);
    if (mx[hg] == NEG_INF) continue;  // nothing cached in this range
    const vec m = vset1(mx[hg]);
    vec sum = vzero();
    for (int64_t j = 0; j < n; j += LANES) {
      const int64_t count = std::min<int64_t>(LANES, n - j);
      const vec e = keep_first(exp_neg(vsub(load_first(s + j, count), m)), count);
      store_first(s + j, e, count);
      sum = vadd(sum, e);
    }
    out[1] = vsum(sum);
  }
  for (int64_t b = b0; b < b1; ++b) {  // 3. the values weighted by them, block by block
    const uint16_t* vb = vp + table[b] * block_stride;
    const int64_t jb = b * BS, je = std::min(j1, jb + BS);
    for (int64_t h = 0; h < KVH; ++h) {
      vec acc[MAXG][C];
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = vload(part + (h * G + g) * (D + 2) + 2 + LANES * c);
      for (int64_t j = jb; j < je; ++j) {
        if (!mask[j]) continue;
        const uint16_t* v = vb + (j - jb) * row + h * D;
        vec vv[C];
        for (int c = 0; c < C; ++c) vv[c] = widen(v + LANES * c);
        for (int64_t g = 0; g < G; ++g) {
          const vec p = vset1(scores[(h * G + g) * n + (j - j0)]);
          for (int c = 0; c < C; ++c) acc[g][c] = vfma(p, vv[c], acc[g][c]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) vstoreu(part + (h * G + g) * (D + 2) + 2 + LANES * c, acc[g][c]);
    }
  }
}

// A bf16 or fp32 tensor's values, in order, as fp32.
inline void to_floats(const at::Tensor& t, float* out) {
  const at::Tensor c = t.is_contiguous() ? t : t.contiguous();
  const int64_t count = c.numel();
  if (c.scalar_type() == at::kFloat) {
    std::copy(c.data_ptr<float>(), c.data_ptr<float>() + count, out);
  } else {
    TORCH_CHECK(c.scalar_type() == at::kBFloat16, "attend_paged: q, k and v in bf16 or fp32");
    const at::BFloat16* p = c.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(p[i]);
  }
}

// q [B, H, D], k, v [B, KVH, D] (the step's own keys), k_pool, v_pool [blocks, BS, KVH, D] bf16 (one layer's),
// table [B, blocks] int32, key_mask [B, keys] bool. Returns fp32 [B, KVH, H / KVH, D].
template <int D>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                  const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& key_mask, double scale) {
  const int64_t B = k.size(0), KVH = k.size(1), H = q.size(1), G = H / KVH, BS = k_pool.size(1), W = key_mask.size(1);
  // q, k and v in fp32, in one buffer (no ATen op in the kernel: each would cost a dispatch a layer).
  std::vector<float> buffer((B * H + 2 * B * KVH) * D);
  float* qf = buffer.data();
  float* kf = qf + B * H * D;
  float* vf = kf + B * KVH * D;
  to_floats(q, qf);
  to_floats(k, kf);
  to_floats(v, vf);
  const auto tc = table.contiguous();
  const auto mc = key_mask.contiguous();
  const int64_t blocks = (W + BS - 1) / BS, T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<float> parts(B * T * H * (D + 2));
  const auto* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {  // each (sequence, range of key blocks)
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / T, t = item % T;
      attend_range<D>(qf + b * H * D, KVH, G, kp, vp, BS, tc.data_ptr<int32_t>() + b * tc.size(1),
                      mc.data_ptr<bool>() + b * W, W, blocks * t / T, blocks * (t + 1) / T, (float)scale,
                      parts.data() + item * H * (D + 2), scores);
    }
  });
  auto out = at::empty({B, KVH, G, D}, q.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {  // the ranges' partial softmaxes and the own key, in fp32
    for (int64_t hg = 0; hg < H; ++hg) {
      const float* qh = qf + (b * H + hg) * D;
      const float* kh = kf + (b * KVH + hg / G) * D;
      const float* vh = vf + (b * KVH + hg / G) * D;
      float own = 0.f;
      for (int d = 0; d < D; ++d) own += qh[d] * kh[d];
      own *= (float)scale;
      float m = own;
      for (int64_t t = 0; t < T; ++t) m = std::max(m, parts[((b * T + t) * H + hg) * (D + 2)]);
      float total = std::exp(own - m);
      float* oh = o + (b * H + hg) * D;
      for (int d = 0; d < D; ++d) oh[d] = total * vh[d];
      for (int64_t t = 0; t < T; ++t) {
        const float* p = parts.data() + ((b * T + t) * H + hg) * (D + 2);
        if (p[1] == 0.f) continue;
        const float w = std::exp(p[0] - m);
        total += w * p[1];
        for (int d = 0; d < D; ++d) oh[d] += w * p[2 + d];
      }
      for (int d = 0; d < D; ++d) oh[d] /= total;
    }
  }
  return out;
}

at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& key_mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= MAXG,
              "attend_paged: q [B, H, D] and k [B, KVH, D] with at most 8 query heads a KV head");
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16 && k_pool.dim() == 4 &&
              k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == k.size(1) && k_pool.size(3) == k.size(2) &&
              k_pool.is_contiguous() && v_pool.is_contiguous() && table.scalar_type() == at::kInt &&
              key_mask.scalar_type() == at::kBool, "attend_paged: bf16 pools [blocks, block, KVH, D], int32 table");
  switch (k.size(2)) {
    case 64: return attend<64>(q, k, v, k_pool, v_pool, table, key_mask, scale);
    case 128: return attend<128>(q, k, v, k_pool, v_pool, table, key_mask, scale);
    default: TORCH_CHECK(false, "attend_paged: head_dim 64 or 128");
  }
}

}  // namespace attention

TORCH_LIBRARY_FRAGMENT(inference_core, m) {
  m.def("attend_paged(Tensor q, Tensor k, Tensor v, Tensor k_pool, Tensor v_pool, Tensor table, Tensor key_mask, "
        "float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) { m.impl("attend_paged", attention::attend_paged); }
"""


def register_fake() -> None:
    """The op's output shape for export (called once the extension is built)."""
    torch.library.register_fake("inference_core::attend_paged")(_fake)


def _fake(q, k, v, k_pool, v_pool, table, key_mask, scale):
    batch, kv_heads, head_dim = k.shape
    return q.new_empty(batch, kv_heads, q.shape[1] // kv_heads, head_dim, dtype=torch.float32)


def takes(q: torch.Tensor, k: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Whether the op takes this layer's attention: a bf16 paged pool on the CPU ([layers, blocks, block, KVH, D]),
    head_dim 64 or 128, at most MAX_GROUP query heads a KV head (q [B, H * D] or [B, H, D], k [B, KVH, D])."""
    kv_heads, head_dim = k.shape[-2:]
    heads = q.shape[-1] // head_dim if q.dim() == 2 else q.shape[1]
    return (k_pool.device.type == "cpu" and k_pool.dtype == torch.bfloat16 and k_pool.dim() == 5
            and tuple(k_pool.shape[-2:]) == (kv_heads, head_dim) and head_dim in HEAD_DIMS
            and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP)


def attend(q, k, v, k_pool, v_pool, table, key_mask, scale: float) -> torch.Tensor:
    """`engine.compiled._attend_one_fused` over the paged context, through the op: q [B, H * D] or [B, H, D]; k, v
    [B, KVH, D]; k_pool, v_pool one layer's [blocks, block, KVH, D]; table [B, blocks]; key_mask [B, keys]. Returns
    fp32 [B, KVH, group, D]."""
    return torch.ops.inference_core.attend_paged(q.reshape(q.shape[0], -1, k.shape[-1]), k, v, k_pool, v_pool, table,
                                                 key_mask, scale)
