// Weight-only quantized matmul for the CPU: y = x @ W^T in fp32, with W decoded from its codes per
// group of G input columns:
// - 8 bits (GGUF's Q8_0, or int8 round-to-nearest): w = scale * code, codes int8;
// - 4 bits (GGUF's Q4_0 / Q4_1, or int4 round-to-nearest): w = scale * code + offset, codes 0..15
//   held one per byte.
//
// Layout: codes [N/16, K, 16] and scales (offsets) [N/16, K/G, 16] fp32, in blocks of 16 output
// columns, so one vector of lanes holds 16 consecutive outputs and each weight is decoded once per
// call, whatever the number of rows. A weight decodes exactly (an fp16 scale times a code of at
// most 8 bits fits fp32's significand, and so does adding an fp16 offset in one FMA), and every
// output sums its K products in order, one lane each: a row's result does not depend on how many
// rows share the call, and differs from a dense fp32 matmul on the decoded weights only in the
// order of its sums.
//
// `dense_linear` runs the same tile on dense weights [N/16, K, 16]: fp32 (the exact tier's
// matrices), or bf16 / fp16 (a dense half-precision model) widened exactly to fp32 as they are
// loaded, with fp32 activations and sums. A BLAS matmul picks its kernel by the row count, so a
// row's rounding would depend on the rows beside it; here it never does (batch invariance).
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
template <typename C>
inline Vec load_codes(const C* c) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return Vec(_mm512_cvtepi32_ps(std::is_signed_v<C> ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return Vec(_mm256_cvtepi32_ps(std::is_signed_v<C> ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw)));
#else
  float w[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) w[i] = static_cast<float>(c[i]);
  return Vec::loadu(w);
#endif
}

struct Weights {
  const void* codes;     // this block's [K][16]
  const float* scales;   // [K/G][16]
  const float* offsets;  // [K/G][16], or null (8 bits)
  int64_t k, group;
};

// y[r, block] for R rows of fp32 x, `ldx` apart.
template <int R, typename C>
void tile(const float* x, int64_t ldx, const Weights& wt, float* y, int64_t ldy) {
  const C* codes = static_cast<const C*>(wt.codes);
  // One lane group at a time, so that the R accumulators stay in registers.
  for (int l = 0; l < kLanes; ++l) {
    Vec acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
    for (int64_t g0 = 0; g0 < wt.k; g0 += wt.group) {
      const int64_t at = (g0 / wt.group) * kCols + l * Vec::size();
      const Vec s = Vec::loadu(wt.scales + at);
      const Vec off = wt.offsets ? Vec::loadu(wt.offsets + at) : Vec(0.f);
      for (int64_t k = g0; k < g0 + wt.group; ++k) {
        const Vec code = load_codes(codes + k * kCols + l * Vec::size());
        const Vec w = std::is_signed_v<C> ? code * s : at::vec::fmadd(code, s, off);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec(x[r * ldx + k]), w, acc[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r].store(y + r * ldy + l * Vec::size());
  }
}

// Dense tiles keep two accumulators per row in registers: 8 rows on AVX-512's 32 vector
// registers, 4 elsewhere (AVX2 has 16).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kDenseRows = 8;
#else
constexpr int64_t kDenseRows = 4;
#endif
// Products are summed in runs of kChunk, each run's sum added to the total in order: the rounding
// error grows with kChunk + K / kChunk terms instead of K (a 1536-long dot product: 88, not 1536),
// and the order is still the same for every row whatever the rows beside it.
constexpr int64_t kChunk = 64;

// Rows per panel of a long call: every block passes over one panel's fp32 activations (64 rows of
// K = 1536 is 384 KB) while they are in L2, rather than over all M rows from L3.
constexpr int64_t kDensePanelRows = 64;

// Vec::size() dense weights as fp32: as stored, or a half-precision value widened exactly.
inline Vec load_dense(const float* p) { return Vec::loadu(p); }
inline Vec load_dense(const at::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
#else
  float w[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) w[i] = static_cast<float>(p[i]);
  return Vec::loadu(w);
#endif
}
inline Vec load_dense(const at::Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float w[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) w[i] = static_cast<float>(p[i]);
  return Vec::loadu(w);
#endif
}

// y[r, block] for R rows of fp32 x and a block of dense weights [K][16].
template <int R, typename W>
void dense_tile(const float* x, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy) {
  for (int l = 0; l < kLanes; ++l) {
    Vec acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
    for (int64_t c = 0; c < k; c += kChunk) {
      Vec run[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) run[r] = Vec(0.f);
      for (int64_t i = c; i < std::min(k, c + kChunk); ++i) {
        const Vec wv = load_dense(w + i * kCols + l * Vec::size());
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) run[r] = at::vec::fmadd(Vec(x[r * ldx + i]), wv, run[r]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r] = acc[r] + run[r];
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r].store(y + r * ldy + l * Vec::size());
  }
}

template <typename W>
using DenseTileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t);
template <typename W, int... R>
constexpr std::array<DenseTileFn<W>, sizeof...(R)> dense_tiles(std::integer_sequence<int, R...>) {
  return {&dense_tile<R + 1, W>...};
}

template <typename C>
using TileFn = void (*)(const float*, int64_t, const Weights&, float*, int64_t);
template <typename C, int... R>
constexpr std::array<TileFn<C>, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, C>...};
}

template <typename C>
at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& offsets, int64_t n) {
  static constexpr auto kTiles = tiles<C>(std::make_integer_sequence<int, kRows>{});
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.size(2) == kCols, "quant_linear: x [M, K], codes [N/16, K, 16]");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == kCols &&
                  scales.scalar_type() == at::kFloat,
              "quant_linear: scales [N/16, K/G, 16] float32");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "quant_linear: packed weights must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), blocks = codes.size(0), groups = scales.size(1);
  TORCH_CHECK(codes.size(1) == k && groups > 0 && k % groups == 0, "quant_linear: x has ", k, " columns");
  TORCH_CHECK(n > blocks * kCols - kCols && n <= blocks * kCols, "quant_linear: n does not match the codes");
  const float* op = nullptr;
  if (offsets) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kFloat &&
                    offsets->is_contiguous(),
                "quant_linear: offsets must match scales");
    op = offsets->data_ptr<float>();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, blocks * kCols}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const C* cp = static_cast<const C*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = blocks * kCols, group = k / groups;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const Weights wt{cp + b * k * kCols, sp + b * groups * kCols, op ? op + b * groups * kCols : nullptr, k, group};
      for (int64_t r0 = 0; r0 < m; r0 += kRows)
        kTiles[std::min(kRows, m - r0) - 1](xp + r0 * k, k, wt, yp + r0 * ldy + b * kCols, ldy);
    }
  });
  return n == ldy ? y : y.narrow(1, 0, n).contiguous();
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "int8_linear: codes must be int8");
  return matmul<int8_t>(x, codes, scales, c10::nullopt, n);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t n) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "int4_linear: codes must be uint8 (one 0..15 code per byte)");
  return matmul<uint8_t>(x, codes, scales, offsets, n);
}

template <typename W>
void dense_matmul(const float* xp, const W* wp, float* yp, int64_t m, int64_t k, int64_t blocks) {
  static constexpr auto kTiles = dense_tiles<W>(std::make_integer_sequence<int, kDenseRows>{});
  const int64_t ldy = blocks * kCols;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = 0; p0 < m; p0 += kDensePanelRows) {
      const int64_t p1 = std::min(m, p0 + kDensePanelRows);
      for (int64_t b = begin; b < end; ++b)
        for (int64_t r0 = p0; r0 < p1; r0 += kDenseRows)
          kTiles[std::min(kDenseRows, p1 - r0) - 1](xp + r0 * k, k, wp + b * k * kCols, k, yp + r0 * ldy + b * kCols,
                                                    ldy);
    }
  });
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weights, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "dense_linear: x [M, K] float32");
  const auto wtype = weights.scalar_type();
  TORCH_CHECK(weights.dim() == 3 && weights.size(2) == kCols && weights.is_contiguous() &&
                  (wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kHalf),
              "dense_linear: weights [N/16, K, 16] float32, bfloat16 or float16, contiguous");
  const int64_t m = x.size(0), k = x.size(1), blocks = weights.size(0);
  TORCH_CHECK(weights.size(1) == k, "dense_linear: x has ", k, " columns, the weights ", weights.size(1));
  TORCH_CHECK(n > blocks * kCols - kCols && n <= blocks * kCols, "dense_linear: n does not match the weights");
  const at::Tensor xf = x.contiguous();
  at::Tensor y = at::empty({m, blocks * kCols}, x.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (wtype == at::kFloat)
    dense_matmul(xp, weights.data_ptr<float>(), yp, m, k, blocks);
  else if (wtype == at::kBFloat16)
    dense_matmul(xp, weights.data_ptr<at::BFloat16>(), yp, m, k, blocks);
  else
    dense_matmul(xp, weights.data_ptr<at::Half>(), yp, m, k, blocks);
  return n == blocks * kCols ? y : y.narrow(1, 0, n).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weights, int n) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
}
