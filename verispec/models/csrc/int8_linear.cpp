// 8-bit weight-only matmul for the CPU: y = x @ W^T in fp32, with W = scale * code per group of
// input columns (GGUF's Q8_0, or a round-to-nearest int8 checkpoint).
//
// Layout: codes [N/16, K, 16] int8 and scales [N/16, K/G, 16] fp32, blocks of 16 output columns,
// so one vector of lanes holds 16 consecutive outputs and each weight is decoded once per step,
// whatever the number of rows. A weight decodes exactly (an fp16 scale times an 8-bit code fits
// fp32's significand), and every output sums its K products in order, one lane each: a row's
// logits do not depend on how many rows share the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <array>
#include <utility>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kCols = 16;  // output columns per block
constexpr int64_t kLanes = kCols / Vec::size();
constexpr int64_t kRows = 8;  // rows per register tile (their accumulators stay in registers)

// Vec::size() codes as floats.
inline Vec load_codes(const int8_t* c) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)))));
#else
  float w[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) w[i] = static_cast<float>(c[i]);
  return Vec::loadu(w);
#endif
}

// y[r, block] for R rows: x rows `ldx` apart (fp32), one block's codes [K][16] and scales [K/G][16].
template <int R>
inline void tile(const float* x, int64_t ldx, const int8_t* codes, const float* scales, int64_t k_total,
                 int64_t group, float* y, int64_t ldy) {
  // One lane group at a time, so that the R accumulators stay in registers.
  for (int l = 0; l < kLanes; ++l) {
    Vec acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
    for (int64_t g0 = 0; g0 < k_total; g0 += group) {
      const Vec s = Vec::loadu(scales + (g0 / group) * kCols + l * Vec::size());
      for (int64_t k = g0; k < g0 + group; ++k) {
        const Vec w = load_codes(codes + k * kCols + l * Vec::size()) * s;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec(x[r * ldx + k]), w, acc[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r].store(y + r * ldy + l * Vec::size());
  }
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, const float*, int64_t, int64_t, float*, int64_t);
template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}
constexpr auto kTiles = tiles(std::make_integer_sequence<int, kRows>{});

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.size(2) == kCols && codes.scalar_type() == at::kChar,
              "int8_linear: x [M, K] and codes [N/16, K, 16] int8");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.scalar_type() == at::kFloat,
              "int8_linear: scales [N/16, K/G, 16] float32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "int8_linear: packed weights must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), blocks = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % scales.size(1) == 0, "int8_linear: x has ", k, " columns");
  const int64_t group = k / scales.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, blocks * kCols}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = blocks * kCols;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* c = cp + b * k * kCols;
      const float* s = sp + b * scales.size(1) * kCols;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const float* xr = xp + r0 * k;
        float* yr = yp + r0 * ldy + b * kCols;
        kTiles[std::min(kRows, m - r0) - 1](xr, k, c, s, k, group, yr, ldy);
      }
    }
  });
  return n == ldy ? y : y.narrow(1, 0, n).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
