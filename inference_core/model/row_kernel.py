"""Our kernel for the compiled decode step's bf16 projections on an AVX-512 CPU: y = x W^T for a few rows of x.

A decode step multiplies one row (a few, batched) by every weight matrix, so its time is the time to stream the
weights from memory. Inductor's C++ GEMM template and oneDNN, which the compiled step otherwise uses for these
projections, read them well below the rate a plain pass over the same bytes reaches on the 2-core AVX-512 host
(measured in one process, 30 weights of [3072, 576]: 25-28 GB/s for the template against 29-32 for a sum of them at
quiet moments, 36-38 against 52-64 at the moments the host's memory gives more), while the loop here keeps up with
the sum at both (docs/benchmarks.md, "Our kernel for the decode projections").

The loop: the weight packed once into blocks of 48 output features, [blocks, in, 48] (`pack`), so that each block is
one contiguous run of memory; each thread takes a contiguous range of blocks and walks its two halves side by side, a
block of each at a time (two streams from memory in flight per thread: over the step's 121 weight shapes, 67.9
against 58.1 GB/s for one stream at moments the Zen 5 host's memory gives about 80, +3% at moments it gives about 50);
per input feature, three 16-lane loads of bf16 widened to fp32 (a shift) and one fused multiply-add per input row
into fp32 accumulators, rounded to bf16 at the end (the sums of F.linear in bf16, in another order). Up to
`MAX_ROWS` input rows share each pass over a block.

It is a torch custom op, `torch.ops.inference_core.linear_rows(x, packed, out_features)`, built from the C++ below
the first time it is needed (about 35 s on the 2-core host, once per machine: the build is kept in the local cache)
with the compiler inductor uses anyway (and ninja, a pinned requirement). `tracing(True)` around an export makes
`model.llama.Linear` call it for inputs it takes (`takes`); the pack is then part of the graph, on a weight that
freezing made a constant, so the compiler folds it into the package once. Where it cannot run (no AVX-512, not bf16,
more rows, a failed build: `unavailable`), the projection stays `F.linear`, whose kernels inductor picks itself.

The same build holds our paged attention op (`model.attention_kernel`): one extension, one build, one `unavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from inference_core.model import attention_kernel
from inference_core.model.paths import cache_root

BLOCK = 48  # output features per packed block (three 16-lane fp32 vectors)
MAX_ROWS = 8  # input rows the op takes; a batch above it uses inductor's matmul (compute, not memory, then matters)

SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t BLOCK = 48;
constexpr int64_t ROWS = 4;  // input rows a pass over one block computes (12 accumulators)

inline __m512 widen(const uint16_t* p) {  // 16 bf16 -> 16 fp32: a bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// R input rows against S blocks at once (S streams of the weight in flight per thread: at moments the host's memory
// gives more, two streams read 91-96 GB/s where one read 66-79, measured on one 270 MB weight).
template <int R, int S>
void block_rows(const float* x, int64_t K, const uint16_t* const* w, at::BFloat16* out, int64_t N, const int64_t* n0) {
  __m512 acc[S][R][3];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 3; ++j) acc[s][r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int s = 0; s < S; ++s) {
      const uint16_t* row = w[s] + k * BLOCK;
      const __m512 w0 = widen(row), w1 = widen(row + 16), w2 = widen(row + 32);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * K + k]);
        acc[s][r][0] = _mm512_fmadd_ps(a, w0, acc[s][r][0]);
        acc[s][r][1] = _mm512_fmadd_ps(a, w1, acc[s][r][1]);
        acc[s][r][2] = _mm512_fmadd_ps(a, w2, acc[s][r][2]);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t cols = std::min<int64_t>(BLOCK, N - n0[s]);
    for (int r = 0; r < R; ++r) {
      alignas(64) float sums[BLOCK];
      for (int j = 0; j < 3; ++j) _mm512_store_ps(sums + 16 * j, acc[s][r][j]);
      for (int64_t c = 0; c < cols; ++c) out[r * N + n0[s] + c] = at::BFloat16(sums[c]);
    }
  }
}

template <int S>
void blocks_rows(const float* x, int64_t M, int64_t K, const uint16_t* const* w, at::BFloat16* out, int64_t N,
                 const int64_t* n0) {
  for (int64_t m = 0; m < M; m += ROWS) {
    const float* xm = x + m * K;
    at::BFloat16* om = out + m * N;
    switch (std::min<int64_t>(ROWS, M - m)) {
      case 4: block_rows<4, S>(xm, K, w, om, N, n0); break;
      case 3: block_rows<3, S>(xm, K, w, om, N, n0); break;
      case 2: block_rows<2, S>(xm, K, w, om, N, n0); break;
      default: block_rows<1, S>(xm, K, w, om, N, n0); break;
    }
  }
}

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_rows: x must be a 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == BLOCK &&
              packed.size(1) == x.size(1) && packed.size(0) * BLOCK >= N && packed.is_contiguous(),
              "linear_rows: packed must be the bf16 [blocks, in, 48] weight of row_kernel.pack");
  const int64_t M = x.size(0), K = x.size(1);
  const auto xc = x.contiguous();
  std::vector<float> xf(M * K);
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  auto out = at::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // The thread's blocks in two halves, a block of each at a time (two streams), and the odd one alone.
    const int64_t half = (end - begin) / 2;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t n0[2] = {(begin + i) * BLOCK, (begin + half + i) * BLOCK};
      const uint16_t* w[2] = {wp + (begin + i) * K * BLOCK, wp + (begin + half + i) * K * BLOCK};
      blocks_rows<2>(xf.data(), M, K, w, op, N, n0);
    }
    if ((end - begin) % 2) {
      const int64_t n0[1] = {(end - 1) * BLOCK};
      const uint16_t* w[1] = {wp + (end - 1) * K * BLOCK};
      blocks_rows<1>(xf.data(), M, K, w, op, N, n0);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(inference_core, m) { m.def("linear_rows(Tensor x, Tensor packed, int out_features) -> Tensor"); }
TORCH_LIBRARY_IMPL(inference_core, CPU, m) { m.impl("linear_rows", linear_rows); }
"""

# -fopenmp: at::parallel_for is an OpenMP loop in torch's headers, ignored (one thread) without it.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp"]

_state = threading.local()
_BUILD_LOCK = threading.Lock()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / BLOCK), in, BLOCK], the output features padded with zeros to whole blocks."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % BLOCK))
    return padded.view(-1, BLOCK, in_features).transpose(1, 2).contiguous()


def unavailable() -> str | None:
    """Why the op cannot run here (None: it is built and registered). Builds it the first time on a machine (about
    35 s) into the local cache, in a directory named after the source, the flags and torch's version; loads that
    build later. Engines started at once (two race lanes) wait for one build."""
    with _BUILD_LOCK:
        return _build()


@functools.cache
def _build() -> str | None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"it needs AVX-512 (this CPU: {torch.backends.cpu.get_cpu_capability()})"
    source = SOURCE + attention_kernel.SOURCE  # one extension: our projection and attention ops
    name = "inference_core_rows_" + hashlib.blake2b((source + repr(FLAGS) + torch.__version__).encode(),
                                                     digest_size=6).hexdigest()
    directory = cache_root() / "row-kernel" / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        torch.utils.cpp_extension.load_inline(name, cpp_sources=source, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                              build_directory=str(directory), is_python_module=False)
    except (RuntimeError, OSError) as error:  # no compiler, no ninja, a failed build: inductor's matmuls instead
        return f"its build failed ({str(error).splitlines()[0][:200]})"
    torch.library.register_fake("inference_core::linear_rows")(_fake)
    attention_kernel.register_fake()
    return None


def _fake(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@contextlib.contextmanager
def tracing(enabled: bool):
    """While tracing a decode step: `model.llama.Linear` calls the op for the inputs it takes (`takes`)."""
    previous = getattr(_state, "enabled", False)
    _state.enabled = enabled
    try:
        yield
    finally:
        _state.enabled = previous


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of `x` by `weight` runs through the op: inside `tracing(True)`, bf16 on the CPU, 2-D x
    of at most MAX_ROWS rows."""
    return (getattr(_state, "enabled", False) and x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[0] <= MAX_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) through the op (call where `takes` says so, after `unavailable()` returned None)."""
    out = torch.ops.inference_core.linear_rows(x, pack(weight), weight.shape[0])
    return out if bias is None else out + bias
