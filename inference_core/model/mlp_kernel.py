"""Our op for the MLP's activation in the compiled steps on an AVX-512 or AVX2 CPU: silu(gate) * up of each row of the
gate-and-up projection's output, bf16 in and out, in fp32 between.

What inductor generates for `F.silu(gate) * up` on the CPU calls Sleef's exp (its 1-ulp form) and a division per
vector of 16: a 512-token prompt's activations took 0.26 ms a layer of the bundled model (its 1536 features) on the
2-vCPU Zen 4 host, 9 ms of the prompt's 320 ms. `silu_mul` takes e^-|x| from the attention kernel's polynomial
(`exp_neg`, relative error about 2e-7), then x / (1 + e^-x) as x * 1 / (1 + e) or x * e / (1 + e) by the sign, and
rounds to bf16 to nearest even, a vector at a time; its outputs equal inductor's but for the last bit of a few
(`tests/model/test_mlp_kernel.py`). The flat step (`engine.query_graph.FlatGraph`), and the decode and query steps
where our attention op runs, call it for a bf16 model where `takes` says so (in the compiled decode step of one row:
2.7 against 5.6 us a layer for inductor's); the eager forward keeps `F.silu(gate) * up`, the reference. It is built
into the same extension as the projection kernel (`model.row_kernel`, which owns the build).
"""

from __future__ import annotations

import torch

SOURCE = r"""
namespace mlp {

using attention::vload;
using attention::vmul;
using attention::vadd;

#if defined(__AVX512F__)
inline vec neg_abs(vec x) {  // -|x|: the sign bit set
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
inline vec where_nonneg(vec x, vec a, vec b) {  // a where x >= 0, else b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vzero(), _CMP_GE_OQ), b, a);
}
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
// 16 fp32 -> bf16 (round to nearest even; a NaN stays a quiet NaN, as at::BFloat16 rounds).
inline void store_bf16(uint16_t* p, vec x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
#else
inline vec neg_abs(vec x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.f)); }
inline vec where_nonneg(vec x, vec a, vec b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, vzero(), _CMP_GE_OQ)); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline void store_bf16(uint16_t* p, vec x) {  // 8 fp32 -> bf16, as above
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                               _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// silu(g) * u in fp32: g / (1 + e^-g), e^-g from e = e^-|g| (never overflows): 1 / (1 + e) where g >= 0, e / (1 + e)
// where not.
inline vec silu_times(vec g, vec u) {
  const vec e = attention::exp_neg(neg_abs(g));
  const vec sigmoid = vdiv(where_nonneg(g, vset1(1.f), e), vadd(vset1(1.f), e));
  return vmul(vmul(g, sigmoid), u);
}

// x [M, 2I] bf16 (each row the gate's I features, then the up projection's; features side by side) -> [M, I] bf16.
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "silu_mul: x must be a 2-D bf16 tensor [rows, 2 * features], its features side by side");
  const int64_t M = x.size(0), I = x.size(1) / 2, stride = x.stride(0), whole = I / LANES * LANES;
  auto out = at::empty({M, I}, x.options());
  const uint16_t* in = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t tail[2][LANES];
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* gate = in + m * stride;
      const uint16_t* up = gate + I;
      uint16_t* row = o + m * I;
      for (int64_t i = 0; i < whole; i += LANES) store_bf16(row + i, silu_times(widen(gate + i), widen(up + i)));
      if (whole < I) {  // the last features, through a vector padded with zeros
        std::fill(&tail[0][0], &tail[0][0] + 2 * LANES, uint16_t{0});
        std::copy(gate + whole, gate + I, tail[0]);
        std::copy(up + whole, up + I, tail[1]);
        store_bf16(tail[0], silu_times(widen(tail[0]), widen(tail[1])));
        std::copy(tail[0], tail[0] + (I - whole), row + whole);
      }
    }
  });
  return out;
}

}  // namespace mlp

TORCH_LIBRARY_FRAGMENT(inference_core, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(inference_core, CPU, m) {
  m.impl("silu_mul", mlp::silu_mul);
}
"""

SHIM = r"""
extern "C" AOTITorchError aoti_torch_cpu_silu_mul(AtenTensorHandle x, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("inference_core::silu_mul", std::vector<c10::IValue>());
    *out = torch::aot_inductor::new_tensor_handle(mlp::silu_mul(tensor(x)));
  });
}
"""
SHIM_ARGUMENTS = "AtenTensorHandle, AtenTensorHandle*"


def register_fake() -> None:
    """The op's output shape for export, as torch.library's fake kernel (called once the extension is built)."""
    torch.library.register_fake("inference_core::silu_mul")(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))


def takes(x: torch.Tensor) -> bool:
    """Whether the op takes the gate-and-up output `x` (the extension built: `model.row_kernel.unavailable`)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] % 2 == 0


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [rows, 2I] bf16 -> [rows, I] bf16, through our op."""
    return torch.ops.inference_core.silu_mul(x)
