"""The host's work between two compiled greedy decode steps on the CPU, as one op of ours.

With several greedy decode steps a host round trip (`EngineConfig.decode_steps`), each step's token is fed to the next
without leaving the device. On the CPU, what the host then does between two calls of the compiled step (write each
sequence's new keys and values into the KV pool, take the argmax of its logits, set the next step's input id,
position and key mask) took about 35 torch calls from Python, each on caches that the step's 270 MB of weights had
just swept. `greedy_advance` does all of it in one call, in place, with the same results bit for bit: the same
slots written with the same values, torch.argmax's choice (the first index of the maximum; a NaN counts as the
maximum, as it does there), the same masks. `engine.compiled.CompiledDecoder.run_greedy` calls it where the
extension is loaded, and goes back to the sequences only where the step's key width grows (every `block_size`
tokens when paged). Measured on the 2-core AVX2 host, bundled model, bf16, 8 steps a round trip, one process, 30
alternating pairs of 48-token runs: 1.045x the decode rate, faster in 21 (docs/benchmarks.md), the same greedy ids.

It is built into the same extension as the projection and attention kernels (`model.row_kernel` owns the build).
"""

from __future__ import annotations

SOURCE = r"""
#include <cmath>
#include <cstring>
#include <limits>

namespace step {

// torch.argmax of one row: the first index of the maximum, a NaN above everything (the first NaN). One pass for the
// maximum and whether a NaN is there, one to find the first lane equal to it, a vector at a time.
#if defined(__AVX512F__)
inline bool has_nan(__m512 x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
inline unsigned equal_lanes(__m512 x, __m512 y) { return _mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ); }
#else
inline bool has_nan(__m256 x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
inline unsigned equal_lanes(__m256 x, __m256 y) { return _mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_EQ_OQ)); }
#endif
int64_t first_max(const float* x, int64_t n) {
  const int64_t whole = n / LANES * LANES;
  vec top = vset1(-std::numeric_limits<float>::infinity());  // -inf in every lane where no whole vector is read
  bool nan = false;
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < whole; i += LANES) {
    const auto v = attention::vload(x + i);
    nan = nan || has_nan(v);
    top = attention::vmax(top, v);
  }
  alignas(64) float lanes[LANES];
  attention::vstoreu(lanes, top);
  for (int64_t j = 0; j < LANES; ++j) best = std::max(best, lanes[j]);
  for (int64_t i = whole; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  const auto target = vset1(best);
  for (int64_t i = 0; i < whole; i += LANES)
    if (const unsigned lanes = equal_lanes(attention::vload(x + i), target)) return i + __builtin_ctz(lanes);
  for (int64_t i = whole; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

// logits [bucket, V] fp32; new_k, new_v [layers, bucket, KVH, D], the pools' dtype; paged pools [layers, blocks,
// block_size, KVH, D] with read_index [bucket, >= width] the block table, contiguous pools [layers, slots, KVH,
// max_len, D] with read_index [bucket] the slots; input_ids, positions [bucket] int64; key_mask [bucket, keys] bool;
// tokens [steps, >= count] int64. Rows from `count` on are padding, left as they are.
void greedy_advance(const at::Tensor& logits, const at::Tensor& new_k, const at::Tensor& new_v, at::Tensor k_pool,
                    at::Tensor v_pool, const at::Tensor& read_index, at::Tensor input_ids, at::Tensor positions,
                    at::Tensor key_mask, at::Tensor tokens, int64_t step, int64_t count, int64_t block_size,
                    int64_t window, int64_t sinks, bool paged) {
  TORCH_CHECK(new_k.dim() == 4 && new_k.sizes() == new_v.sizes() && new_k.is_contiguous() && new_v.is_contiguous() &&
              new_k.scalar_type() == k_pool.scalar_type() && new_v.scalar_type() == v_pool.scalar_type() &&
              k_pool.sizes() == v_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
              k_pool.dim() == 5 && k_pool.size(0) == new_k.size(0) &&
              k_pool.size(-1) == new_k.size(3) && k_pool.size(paged ? 3 : 2) == new_k.size(2),
              "greedy_advance: new keys and values [layers, bucket, KVH, D] in the pools' dtype and layout");
  const int64_t L = new_k.size(0), bucket = new_k.size(1), KVH = new_k.size(2), D = new_k.size(3);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == bucket && logits.scalar_type() == at::kFloat &&
              logits.is_contiguous(), "greedy_advance: fp32 logits [bucket, vocab]");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
              input_ids.is_contiguous() && positions.is_contiguous() && input_ids.numel() >= count &&
              positions.numel() >= count && key_mask.scalar_type() == at::kBool && key_mask.dim() == 2 &&
              key_mask.stride(1) == 1 && key_mask.size(0) >= count && tokens.scalar_type() == at::kLong &&
              tokens.dim() == 2 && tokens.stride(1) == 1 && 0 <= step && step < tokens.size(0) &&
              tokens.size(1) >= count && 0 < count && count <= bucket && block_size > 0,
              "greedy_advance: int64 ids and positions, a bool key mask, int64 tokens [steps, rows]");
  TORCH_CHECK(read_index.size(0) >= count && read_index.stride(-1) == 1 &&
              (paged ? read_index.dim() == 2 && read_index.scalar_type() == at::kInt
                     : read_index.dim() == 1 && read_index.scalar_type() == at::kLong),
              "greedy_advance: an int32 block table [bucket, blocks] (paged) or int64 slots [bucket] (contiguous)");
  const int64_t V = logits.size(1), keys = key_mask.size(1), bytes = k_pool.element_size();
  const float* scores = logits.data_ptr<float>();
  const char* nk = static_cast<const char*>(new_k.data_ptr());
  const char* nv = static_cast<const char*>(new_v.data_ptr());
  char* kp = static_cast<char*>(k_pool.data_ptr());
  char* vp = static_cast<char*>(v_pool.data_ptr());
  int64_t* ids = input_ids.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>() + step * tokens.stride(0);
  const int64_t head = D * bytes, row = KVH * head;  // one position's keys of one KV head, of all of them
  for (int64_t r = 0; r < count; ++r) {
    const int64_t p = pos[r];
    if (paged) {  // the pool as [layers, blocks * block_size, KVH, D]
      const int64_t column = p / block_size;
      TORCH_CHECK(0 <= p && column < read_index.size(1), "greedy_advance: a position past the block table");
      const int64_t block = read_index.data_ptr<int32_t>()[r * read_index.stride(0) + column];
      TORCH_CHECK(0 <= block && block < k_pool.size(1), "greedy_advance: a block outside the pool");
      const int64_t slot = block * block_size + p % block_size, layer = k_pool.stride(0) * bytes;
      for (int64_t l = 0; l < L; ++l) {
        std::memcpy(kp + l * layer + slot * row, nk + (l * bucket + r) * row, row);
        std::memcpy(vp + l * layer + slot * row, nv + (l * bucket + r) * row, row);
      }
    } else {  // [layers, slots, KVH, max_len, D]
      const int64_t slot = read_index.data_ptr<int64_t>()[r * read_index.stride(0)];
      TORCH_CHECK(0 <= slot && slot < k_pool.size(1) && 0 <= p && p < k_pool.size(3),
                  "greedy_advance: a slot or position outside the cache");
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t at = ((l * k_pool.size(1) + slot) * KVH + h) * k_pool.size(3) + p;
          std::memcpy(kp + at * head, nk + ((l * bucket + r) * KVH + h) * head, head);
          std::memcpy(vp + at * head, nv + ((l * bucket + r) * KVH + h) * head, head);
        }
    }
    const int64_t best = first_max(scores + r * V, V);
    out[r] = ids[r] = best;
    pos[r] = p + 1;
    // The next position's mask: the key just written joins; with a window, the key that leaves it goes (unless it
    // is one of the attention sinks, the first `sinks`, which stay).
    bool* mask = key_mask.data_ptr<bool>() + r * key_mask.stride(0);
    if (p < keys) mask[p] = true;
    const int64_t leaving = p + 1 - window;
    if (window > 0 && std::max<int64_t>(sinks, 0) <= leaving && leaving < keys) mask[leaving] = false;
  }
}

// torch.argmax(logits, -1) of fp32 rows [R, V], the rows shared among the threads.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: fp32 rows [R, V], each row contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = first_max(x + r * stride, V);
  });
  return out;
}

}  // namespace step

TORCH_LIBRARY_FRAGMENT(inference_core, m) {
  m.def("greedy_advance(Tensor logits, Tensor new_k, Tensor new_v, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor read_index, Tensor(c!) input_ids, Tensor(d!) positions, Tensor(e!) key_mask, Tensor(f!) tokens, "
        "int step, int count, int block_size, int window, int sinks, bool paged) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) {
  m.impl("greedy_advance", step::greedy_advance);
  m.impl("argmax_rows", step::argmax_rows);
}
"""
