// The fast tier's weight-only quantized matmul for the CPU: y = x @ W^T with W kept as the file's
// blocks (GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: 32 weights per block, fp16 scales; Q4_K, Q5_K, Q6_K:
// super-blocks of 256 with 6- or 8-bit sub-block scales), 4-bit codes two per byte, a fifth or
// sixth bit in planes beside them (the 5/6-bit and K-quant tiles: packed_tile_qx.h).
//
// One call reads each block of codes once for all its rows (up to kMaxRows per register tile),
// so a verify step of several rows costs little more than one row while the weights stream from
// memory. Activations are quantized per block of 32 (packed_activations.h): int8 with an int8
// residual in outlier blocks for 4-bit codes, int16 for 8-bit ones. Each block's dot product is an
// exact int32 sum of code x activation on the CPU's integer multiply-adds (4-bit: AVX512-VNNI /
// AVX-VNNI `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd`; 8-bit: `vpdpwssd`, else `vpmaddwd`). The
// sums become fp32 once per block, in the same order on every variant: a row's result does not
// depend on how many rows share the call, nor on the instruction set.
//
// The layout of the codes and scales: packed_layout.h (built by `packed_codes`).
#include "packed_activations.h"
#include "packed_layout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
#include <cpuid.h>
#include <immintrin.h>
#define VS_X86 1
#endif
// The VNNI variants are compiled under GCC's target pragmas (not clang's), and only where the CPU
// runs them (cpu_kernels.py passes VS_BUILD_*VNNI): each is a third of the build's time.
#if defined(VS_X86) && defined(__GNUC__) && !defined(__clang__) && defined(VS_BUILD_AVXVNNI)
#define VS_AVX2_VNNI 1
#endif
#if defined(VS_X86) && defined(__GNUC__) && !defined(__clang__) && defined(VS_BUILD_AVX512VNNI)
#define VS_AVX512_VNNI 1
#endif

namespace {

constexpr int kMaxRows = 8;     // rows per register tile
constexpr int64_t kPrefetchGroups = 16;  // how far ahead the weights are prefetched
// Rows per panel of a long call: every column block passes over one panel's activations (128 rows
// of K int8 values, under 200 KB) while they are in L2, rather than over all M rows from L3.
constexpr int64_t kPanelRows = 128;

struct Packed {
  const uint8_t* codes;  // [blocks, groups, bytes]
  const uint16_t* d;     // [blocks, groups, 16] fp16 bits
  const uint16_t* m;     // Q4_1's offsets, same shape; else null
};

using TileFn = void (*)(const Packed&, int64_t, const Act&, int64_t, float*);
struct TileTable {
  std::array<std::array<TileFn, kMaxRows>, kFormats> fn;  // [format][rows - 1]
  int rows;
};

template <typename T>
inline int32_t lane(const T* x) {  // two int16 or four int8 activations, as one 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// ------------------------------------------------------------------------- portable (any CPU)
namespace portable {
struct V {
  static constexpr int kCols = 16, kRows = kMaxRows, kChains = 1;
  static constexpr bool kDot8Int32 = true;  // dot8 sums in int32: no int16 lanes to widen
  struct W { int16_t v[32]; };
  struct B { uint8_t v[64]; };
  struct I { int32_t v[16]; };
  struct F { float v[16]; };
  static I zero_i() { return I{}; }
  static F zero_f() { return F{}; }
  static B nibbles(const uint8_t* p) {  // column c's 4 codes as bytes 4c..4c+3, in input order
    B b;
    for (int c = 0; c < 16; ++c) {
      b.v[4 * c] = p[2 * c] & 0x0F, b.v[4 * c + 1] = p[2 * c + 1] & 0x0F;
      b.v[4 * c + 2] = p[2 * c] >> 4, b.v[4 * c + 3] = p[2 * c + 1] >> 4;
    }
    return b;
  }
  static I widen(const I& a) { return a; }  // dot8's sums are int32 already
  static I dot8(I acc, const B& w, const int8_t* x) {
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < 4; ++i) acc.v[j] += int32_t(w.v[4 * j + i]) * x[i];
    return acc;
  }
  static W load8(const uint8_t* p) {
    W w;
    for (int i = 0; i < 32; ++i) w.v[i] = static_cast<int8_t>(p[i]);
    return w;
  }
  static I dot(I acc, const W& w, const int16_t* x) {
    for (int j = 0; j < 16; ++j) acc.v[j] += int32_t(w.v[2 * j]) * x[0] + int32_t(w.v[2 * j + 1]) * x[1];
    return acc;
  }
  static I add(I a, const I& b) {
    for (int j = 0; j < 16; ++j) a.v[j] += b.v[j];
    return a;
  }
  static F cvt(const I& a) {
    F f;
    for (int j = 0; j < 16; ++j) f.v[j] = static_cast<float>(a.v[j]);
    return f;
  }
  static F halves(const uint16_t* p) {
    F f;
    for (int j = 0; j < 16; ++j) f.v[j] = c10::detail::fp16_ieee_to_fp32_value(p[j]);
    return f;
  }
  static F set1(float s) {
    F f;
    for (auto& v : f.v) v = s;
    return f;
  }
  static F mul(const F& a, const F& b) {
    F f;
    for (int j = 0; j < 16; ++j) f.v[j] = a.v[j] * b.v[j];
    return f;
  }
  static F sub_f(const F& a, const F& b) {
    F f;
    for (int j = 0; j < 16; ++j) f.v[j] = a.v[j] - b.v[j];
    return f;
  }
  static F fma(const F& a, const F& b, const F& c) {  // fused, as the vector variants' FMA
    F f;
    for (int j = 0; j < 16; ++j) f.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
    return f;
  }
  static void store(float* p, const F& f) { std::memcpy(p, f.v, sizeof f.v); }
  // Integer lanes for the 5- and 6-bit codes and the K-quants' sub-block scales.
  static I lanes_u8(const uint8_t* p) {
    I a;
    for (int j = 0; j < 16; ++j) a.v[j] = p[j];
    return a;
  }
  static I lanes_i8(const uint8_t* p) {
    I a;
    for (int j = 0; j < 16; ++j) a.v[j] = static_cast<int8_t>(p[j]);
    return a;
  }
  template <int N>
  static I slli(I a) {
    for (auto& v : a.v) v = static_cast<int32_t>(static_cast<uint32_t>(v) << N);
    return a;
  }
  template <int N>
  static I srli(I a) {
    for (auto& v : a.v) v = static_cast<int32_t>(static_cast<uint32_t>(v) >> N);
    return a;
  }
  static I or_i(I a, const I& b) {
    for (int j = 0; j < 16; ++j) a.v[j] |= b.v[j];
    return a;
  }
  static I and_i(I a, int32_t mask) {
    for (auto& v : a.v) v &= mask;
    return a;
  }
  static I sub_i(I a, const I& b) {
    for (int j = 0; j < 16; ++j) a.v[j] -= b.v[j];
    return a;
  }
  static I set1_i(int32_t s) {
    I a;
    for (auto& v : a.v) v = s;
    return a;
  }
  static B with_high(B lo, const I& hi) {  // lane c's four bytes of `hi` or-ed into column c's codes
    for (int c = 0; c < 16; ++c)
      for (int i = 0; i < 4; ++i) lo.v[4 * c + i] |= static_cast<uint8_t>(static_cast<uint32_t>(hi.v[c]) >> (8 * i));
    return lo;
  }
};
#include "packed_linear_body.h"
}  // namespace portable

#if defined(VS_X86)
// ------------------------------------------------------------------ x86: 16 or 8 lanes per vector
// A 4-bit run's byte pairs (one column's, inputs 4p..4p+3 as low, low, high, high nibbles)
// zero-extended to 32-bit lanes v: (v | v << 12) & 0x0F0F0F0F puts the four codes in input order.
#define VS_AVX2_TRAITS(DOT, DOT8, WIDEN, INT32)                                                       \
  struct V {                                                                                          \
    static constexpr int kCols = 8, kRows = 4, kChains = 4; /* 16 ymm registers */                    \
    static constexpr bool kDot8Int32 = INT32;                                                         \
    using W = __m256i;                                                                                \
    using B = __m256i;                                                                                \
    using I = __m256i;                                                                                \
    using F = __m256;                                                                                 \
    static I zero_i() { return _mm256_setzero_si256(); }                                              \
    static F zero_f() { return _mm256_setzero_ps(); }                                                 \
    static B nibbles(const uint8_t* p) {                                                              \
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  \
      return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F)); \
    }                                                                                                 \
    static W load8(const uint8_t* p) {                                                                \
      return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));              \
    }                                                                                                 \
    static I dot(I acc, W w, const int16_t* x) { return DOT(acc, w, _mm256_set1_epi32(lane(x))); }     \
    static I dot8(I acc, B w, const int8_t* x) { return DOT8(acc, w, _mm256_set1_epi32(lane(x))); }    \
    static I widen(I a) { return WIDEN(a); }                                                          \
    static I add(I a, I b) { return _mm256_add_epi32(a, b); }                                         \
    static F cvt(I a) { return _mm256_cvtepi32_ps(a); }                                               \
    static F halves(const uint16_t* p) {                                                              \
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                   \
    }                                                                                                 \
    static F set1(float s) { return _mm256_set1_ps(s); }                                              \
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }                                            \
    static F sub_f(F a, F b) { return _mm256_sub_ps(a, b); }                                          \
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }                                  \
    static void store(float* p, F f) { _mm256_storeu_ps(p, f); }                                      \
    static I lanes_u8(const uint8_t* p) {                                                             \
      return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));              \
    }                                                                                                 \
    static I lanes_i8(const uint8_t* p) {                                                             \
      return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));              \
    }                                                                                                 \
    template <int N> static I slli(I a) { return _mm256_slli_epi32(a, N); }                           \
    template <int N> static I srli(I a) { return _mm256_srli_epi32(a, N); }                           \
    static I or_i(I a, I b) { return _mm256_or_si256(a, b); }                                         \
    static I and_i(I a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }              \
    static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }                                       \
    static I set1_i(int32_t s) { return _mm256_set1_epi32(s); }                                       \
    static B with_high(B lo, I hi) { return _mm256_or_si256(lo, hi); }                                \
  };

// Without VNNI, dot8 keeps int16 lanes: u8 x s8 pairs (|.| <= 2 x 15 x 127 = 3810) summed over at
// most a group's 8 runs of 4 inputs stay within 30480 < 2^15, exact; `widen` then adds the pairs
// of int16 lanes into the int32 lanes once per group (one vpmaddwd per group, not per run).
inline __m256i avx2_dot(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
inline __m256i avx2_dot8(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline __m256i avx2_widen(__m256i a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
inline __m256i same(__m256i a) { return a; }  // VNNI's sums are int32 already
namespace avx2 {
VS_AVX2_TRAITS(avx2_dot, avx2_dot8, avx2_widen, false)
#include "packed_linear_body.h"
}  // namespace avx2

#if defined(VS_AVX2_VNNI)
#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace avx2_vnni {
inline __m256i vnni_dot(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
inline __m256i vnni_dot8(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
VS_AVX2_TRAITS(vnni_dot, vnni_dot8, same, true)
#include "packed_linear_body.h"
}  // namespace avx2_vnni
#pragma GCC pop_options
#endif

#if defined(CPU_CAPABILITY_AVX512)
#define VS_AVX512_TRAITS(DOT, DOT8, WIDEN, INT32)                                                     \
  struct V {                                                                                          \
    static constexpr int kCols = 16, kRows = kMaxRows, kChains = 8; /* 32 zmm registers */            \
    static constexpr bool kDot8Int32 = INT32;                                                         \
    using W = __m512i;                                                                                \
    using B = __m512i;                                                                                \
    using I = __m512i;                                                                                \
    using F = __m512;                                                                                 \
    static I zero_i() { return _mm512_setzero_si512(); }                                              \
    static F zero_f() { return _mm512_setzero_ps(); }                                                 \
    static B nibbles(const uint8_t* p) {                                                              \
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); \
      return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x0F0F0F0F)); \
    }                                                                                                 \
    static W load8(const uint8_t* p) {                                                                \
      return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));           \
    }                                                                                                 \
    static I dot(I acc, W w, const int16_t* x) { return DOT(acc, w, _mm512_set1_epi32(lane(x))); }     \
    static I dot8(I acc, B w, const int8_t* x) { return DOT8(acc, w, _mm512_set1_epi32(lane(x))); }    \
    static I widen(I a) { return WIDEN(a); }                                                          \
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }                                         \
    static F cvt(I a) { return _mm512_cvtepi32_ps(a); }                                               \
    static F halves(const uint16_t* p) {                                                              \
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));                \
    }                                                                                                 \
    static F set1(float s) { return _mm512_set1_ps(s); }                                              \
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }                                            \
    static F sub_f(F a, F b) { return _mm512_sub_ps(a, b); }                                          \
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }                                  \
    static void store(float* p, F f) { _mm512_storeu_ps(p, f); }                                      \
    static I lanes_u8(const uint8_t* p) {                                                             \
      return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));              \
    }                                                                                                 \
    static I lanes_i8(const uint8_t* p) {                                                             \
      return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));              \
    }                                                                                                 \
    template <int N> static I slli(I a) { return _mm512_slli_epi32(a, N); }                           \
    template <int N> static I srli(I a) { return _mm512_srli_epi32(a, N); }                           \
    static I or_i(I a, I b) { return _mm512_or_si512(a, b); }                                         \
    static I and_i(I a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }              \
    static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }                                       \
    static I set1_i(int32_t s) { return _mm512_set1_epi32(s); }                                       \
    static B with_high(B lo, I hi) { return _mm512_or_si512(lo, hi); }                                \
  };

inline __m512i avx512_dot(__m512i acc, __m512i w, __m512i x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
inline __m512i avx512_dot8(__m512i acc, __m512i w, __m512i x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
inline __m512i avx512_widen(__m512i a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }  // as avx2_widen
inline __m512i same512(__m512i a) { return a; }
namespace avx512 {
VS_AVX512_TRAITS(avx512_dot, avx512_dot8, avx512_widen, false)
#include "packed_linear_body.h"
}  // namespace avx512

#if defined(VS_AVX512_VNNI)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace avx512_vnni {
inline __m512i vnni_dot(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }
inline __m512i vnni_dot8(__m512i acc, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(acc, w, x); }
VS_AVX512_TRAITS(vnni_dot, vnni_dot8, same512, true)
#include "packed_linear_body.h"
}  // namespace avx512_vnni
#pragma GCC pop_options
#endif
#endif  // CPU_CAPABILITY_AVX512

// CPUID leaf 7: AVX512_VNNI is sub-leaf 0's ECX bit 11, AVX-VNNI sub-leaf 1's EAX bit 4. (The OS
// saves the registers they use: torch already runs this build's level here.)
bool cpuid7(unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1;
}
#endif  // VS_X86

bool always() { return true; }

struct Variant {
  const char* name;
  bool (*supported)();
  const TileTable& (*table)();
};

// Best first: the first one this CPU runs is the default.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
#if defined(CPU_CAPABILITY_AVX512) && defined(VS_X86)
#if defined(VS_AVX512_VNNI)
      {"avx512_vnni", [] { return cpuid7(0, 2, 11); }, avx512_vnni::table},
#endif
      {"avx512", always, avx512::table},
#endif
#if defined(VS_X86)
#if defined(VS_AVX2_VNNI)
      {"avx2_vnni", [] { return cpuid7(1, 0, 4); }, avx2_vnni::table},
#endif
      {"avx2", always, avx2::table},
#endif
      {"portable", always, portable::table},
  };
  return v;
}

// CPUID traps to the hypervisor on a virtual machine (tens of microseconds): asked once.
const std::vector<const Variant*>& supported_variants() {
  static const std::vector<const Variant*> v = [] {
    std::vector<const Variant*> out;
    for (const Variant& var : variants())
      if (var.supported()) out.push_back(&var);
    return out;
  }();
  return v;
}

const TileTable& pick(c10::string_view name) {
  if (name.empty()) return supported_variants().front()->table();
  for (const Variant* v : supported_variants())
    if (name == v->name) return v->table();
  throw std::invalid_argument("packed_linear: no variant '" + std::string(name) + "' in this build for this CPU");
}

std::vector<std::string> packed_variants() {
  std::vector<std::string> names;
  for (const Variant* v : supported_variants()) names.emplace_back(v->name);
  return names;
}

template <typename T>
void store_tile(const float* tile, int64_t rows, int64_t cols, T* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = static_cast<T>(tile[r * kCols + c]);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& offsets, int64_t format, int64_t n,
                         c10::string_view variant) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0, "packed_linear: x must be [M, K] with K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  check_weights(codes, scales, offsets, format, k);
  const int64_t blocks = codes.size(0);
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "packed_linear: n does not match the codes");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "packed_linear: x must be float32, bfloat16 or float16");
  const TileTable& table = pick(variant);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.contiguous();
  ActBuffers buffers;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "packed_linear", [&] {
    if (format == kQ8_0)
      quantize_int16(xc.data_ptr<scalar_t>(), m, k, buffers);
    else
      quantize_int8(xc.data_ptr<scalar_t>(), m, k, buffers);
  });
  const Act act = buffers.act(k, groups);
  const Packed w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                 offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr};
  const auto& fns = table.fn[format];
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "packed_linear_out", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      alignas(64) float tile[kMaxRows * kCols];
      for (int64_t p0 = 0; p0 < m; p0 += kPanelRows) {
        const int64_t p1 = std::min(m, p0 + kPanelRows);
        for (int64_t b = begin; b < end; ++b) {
          const int64_t cols = std::min(kCols, n - b * kCols);
          for (int64_t r0 = p0; r0 < p1; r0 += table.rows) {
            const int64_t rows = std::min<int64_t>(table.rows, p1 - r0);
            fns[rows - 1](w, b, act, r0, tile);
            store_tile(tile, rows, cols, yp + r0 * n + b * kCols, n);
          }
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int format, int n, str variant=\"\") -> Tensor");
  m.def("packed_variants() -> str[]");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.impl("packed_variants", c10::DispatchKey::CompositeExplicitAutograd, &packed_variants);
}
