"""Our op for reading the int4 KV cache (`kv.int4`) on a CPU: a layer's blocks gathered, unpacked and scaled in one
pass, each block still written in full precision taken from the tail instead.

In torch ops a read is about 20 small ops a layer (gather the codes and the ranges, split the nibbles, cast, two
multiply-adds, overlay the tail), about 126 us for 20 blocks of the bundled model against 11 us for an fp32 gather;
on a 2-core CPU that held decoding at 0.87x the fp32 cache's (docs/benchmarks.md, "int4 KV cache and attention
sinks"). Here each thread takes a range of the blocks and writes their keys and values once. The numbers equal the
torch path's (`Int4Blocks.read` without the op) to fp32 rounding: each value is minimum + scale x code in fp32, cast
to the model dtype (fp32 or bf16). Built into the extension of our other CPU ops (`model.row_kernel` owns the build);
the engine hands `read` to an int4 cache of an fp32 or bf16 model on a CPU where the extension builds, and the cache
reads through torch ops elsewhere.
"""

from __future__ import annotations

import torch

SOURCE = r"""
namespace int4kv {

// One block's keys and values: codes [2, BS, H, D / 2] (keys then values; channel j in a byte's low nibble, j + D / 2
// in its high one), ranges: the keys' [2, H, D] (minimum, scale) then the values' [BS, H, D / group, 2], fp16.
// codes: a byte's low nibble holds channel j, its high one j + D / 2.
inline uint8_t low_code(const uint8_t* bytes, int64_t c) { return bytes[c] & 15; }
inline uint8_t high_code(const uint8_t* bytes, int64_t c) { return bytes[c] >> 4; }

template <typename T>
void dequantize_block(const uint8_t* codes, const at::Half* ranges, T* k, T* v, int64_t BS, int64_t H, int64_t D,
                      int64_t group, float* numbers) {
  // The block's ranges in fp32 once (numbers: 2 H D + BS H (D / group) 2 floats), so the loops below convert none.
  const int64_t half = D / 2, groups = D / group, count = 2 * H * D + BS * H * groups * 2;
  for (int64_t i = 0; i < count; ++i) numbers[i] = float(ranges[i]);
  const float* k_low = numbers;
  const float* k_scale = numbers + H * D;
  const float* v_ranges = numbers + 2 * H * D;
  for (int64_t t = 0; t < BS; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const uint8_t* kc = codes + (t * H + h) * half;
      const uint8_t* vc = codes + BS * H * half + (t * H + h) * half;
      T* kr = k + (t * H + h) * D;
      T* vr = v + (t * H + h) * D;
      const float* lo = k_low + h * D;
      const float* sc = k_scale + h * D;
      for (int64_t j = 0; j < half; ++j) kr[j] = T(lo[j] + sc[j] * float(kc[j] & 15));
      for (int64_t j = 0; j < half; ++j) kr[j + half] = T(lo[j + half] + sc[j + half] * float(kc[j] >> 4));
      const float* vg = v_ranges + (t * H + h) * groups * 2;
      for (int64_t g = 0; g < groups; ++g) {
        const float vlo = vg[2 * g], vsc = vg[2 * g + 1];
        for (int64_t c = g * group; c < (g + 1) * group; ++c)  // a group lies in one half where group divides it
          vr[c] = T(vlo + vsc * float(c < half ? low_code(vc, c) : high_code(vc, c - half)));
      }
    }
  }
}

template <typename T>
void read_blocks(const at::Tensor& codes, const at::Tensor& ranges, const int64_t* blocks, const int64_t* tails,
                 const at::Tensor& tail_k, const at::Tensor& tail_v, at::Tensor& k, at::Tensor& v, int64_t group) {
  const int64_t n = k.size(0), BS = k.size(1), H = k.size(2), D = k.size(3), elems = BS * H * D;
  const int64_t block_codes = codes[0].numel(), block_ranges = ranges.size(1);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* rp = ranges.data_ptr<at::Half>();
  const T* tk = tail_k.data_ptr<T>();
  const T* tv = tail_v.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const int64_t groups = D / group;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> numbers(2 * H * D + BS * H * groups * 2);
    for (int64_t i = begin; i < end; ++i) {
      if (tails[i] >= 0) {  // still written in full precision
        std::memcpy(kp + i * elems, tk + tails[i] * elems, elems * sizeof(T));
        std::memcpy(vp + i * elems, tv + tails[i] * elems, elems * sizeof(T));
      } else {
        dequantize_block<T>(cp + blocks[i] * block_codes, rp + blocks[i] * block_ranges, kp + i * elems,
                            vp + i * elems, BS, H, D, group, numbers.data());
      }
    }
  });
}

// codes [N, 2, BS, H, D / 2] uint8 and ranges [N, R] fp16: one layer of the int4 pool; blocks [n] int64: the blocks to
// read; tails [n] int64: each one's tail block, or -1; tail_k, tail_v [T, BS, H, D] in the model dtype (fp32 or
// bf16). Returns k, v [n, BS, H, D] in the model dtype.
std::tuple<at::Tensor, at::Tensor> int4_kv_read(const at::Tensor& codes, const at::Tensor& ranges,
                                                const at::Tensor& blocks, const at::Tensor& tails,
                                                const at::Tensor& tail_k, const at::Tensor& tail_v, int64_t group) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 5 && codes.size(1) == 2 && codes.is_contiguous(),
              "int4_kv_read: codes [blocks, 2, block, KVH, D / 2] uint8");
  TORCH_CHECK(tail_k.dim() == 4 && tail_k.sizes() == tail_v.sizes() && tail_k.scalar_type() == tail_v.scalar_type() &&
              (tail_k.scalar_type() == at::kFloat || tail_k.scalar_type() == at::kBFloat16) &&
              tail_k.is_contiguous() && tail_v.is_contiguous() && tail_k.size(1) == codes.size(2) &&
              tail_k.size(2) == codes.size(3) && tail_k.size(3) == 2 * codes.size(4),
              "int4_kv_read: fp32 or bf16 tails [tail blocks, block, KVH, D]");
  const int64_t BS = codes.size(2), H = codes.size(3), D = tail_k.size(3);
  TORCH_CHECK(group > 0 && D % group == 0 && ranges.scalar_type() == at::kHalf && ranges.dim() == 2 &&
              ranges.size(0) == codes.size(0) && ranges.size(1) == 2 * H * D + BS * H * (D / group) * 2 &&
              ranges.is_contiguous(), "int4_kv_read: fp16 ranges [blocks, 2 H D + BS H (D / group) 2]");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && tails.scalar_type() == at::kLong && blocks.dim() == 1 &&
              tails.sizes() == blocks.sizes(), "int4_kv_read: int64 blocks [n] and tails [n]");
  const auto bc = blocks.contiguous(), tc = tails.contiguous();
  const int64_t* bp = bc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  const int64_t n = blocks.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < codes.size(0) && tp[i] < tail_k.size(0),
                "int4_kv_read: a block outside the pool or a tail block outside the tail");
  auto k = at::empty({n, BS, H, D}, tail_k.options()), v = at::empty({n, BS, H, D}, tail_k.options());
  if (tail_k.scalar_type() == at::kFloat)
    read_blocks<float>(codes, ranges, bp, tp, tail_k, tail_v, k, v, group);
  else
    read_blocks<c10::BFloat16>(codes, ranges, bp, tp, tail_k, tail_v, k, v, group);
  return {k, v};
}

}  // namespace int4kv

TORCH_LIBRARY_FRAGMENT(inference_core, m) {
  m.def("int4_kv_read(Tensor codes, Tensor ranges, Tensor blocks, Tensor tails, Tensor tail_k, Tensor tail_v, "
        "int group) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) {
  m.impl("int4_kv_read", int4kv::int4_kv_read);
}
"""


def register_fake() -> None:
    """The op's output shapes for export, as a torch.library fake kernel (called once the extension is built): the
    compiled steps read an int4 pool through it (`engine.query_graph.layer_pool`)."""
    torch.library.register_fake("inference_core::int4_kv_read")(_read_output_shape)


def _read_output_shape(codes, ranges, blocks, tails, tail_k, tail_v, group):
    """`int4_kv_read`'s outputs without computing them: k, v [n, block, KVH, D] in the tail's dtype."""
    shape = (blocks.shape[0],) + tuple(tail_k.shape[1:])
    return tail_k.new_empty(shape), tail_k.new_empty(shape)


def read(codes: torch.Tensor, ranges: torch.Tensor, blocks: torch.Tensor, tails: torch.Tensor, tail_k: torch.Tensor,
         tail_v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int4Blocks.read` in one op (see the module docstring); tails [n]: each block's tail block or -1."""
    return torch.ops.inference_core.int4_kv_read(codes, ranges, blocks, tails, tail_k, tail_v, group)
