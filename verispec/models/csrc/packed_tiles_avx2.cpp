// The AVX2 variants (and AVX-VNNI where built): the packed matmul's tiles over 256-bit vectors
// (packed_linear_body.h, packed_tiles.h), from a source of its own so a build compiles the
// variants in parallel.
#define VS_PACKED_NO_ATEN 1
#include "packed_tiles.h"

#if defined(VS_X86)
namespace {
// ------------------------------------------------------------------ x86: 16 or 8 lanes per vector
// A run's codes: 32 bytes of a lane chunk (8 columns' 4 codes), shifted and masked (packed_layout.h).
#define VS_AVX2_TRAITS(DOT, DOT8, WIDEN, INT32)                                                       \
  struct V {                                                                                          \
    static constexpr int kCols = 8, kRows = 4, kChains = INT32 ? 4 : 1; /* see chains() */           \
    static constexpr bool kDot8Int32 = INT32;                                                         \
    using W = __m256i;                                                                                \
    using B = __m256i;                                                                                \
    using I = __m256i;                                                                                \
    using F = __m256;                                                                                 \
    static I zero_i() { return _mm256_setzero_si256(); }                                              \
    static F zero_f() { return _mm256_setzero_ps(); }                                                 \
    static B bits(const uint8_t* p, int shift, uint8_t mask) { /* shift: within 16-bit lanes */    \
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));                            \
      if (shift > 0) v = _mm256_slli_epi16(v, shift);                                                 \
      if (shift < 0) v = _mm256_srli_epi16(v, -shift);                                                \
      return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(mask)));                          \
    }                                                                                                 \
    static B or_b(B a, B b) { return _mm256_or_si256(a, b); }                                         \
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
    static I sub_i(I a, I b) { return _mm256_sub_epi32(a, b); }                                       \
    static I set1_i(int32_t s) { return _mm256_set1_epi32(s); }                                       \
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
}  // namespace

namespace vs {
const TileTable& avx2_table() { return avx2::table(); }
#if defined(VS_AVX2_VNNI)
const TileTable& avx2_vnni_table() { return avx2_vnni::table(); }
#endif
}  // namespace vs
#endif  // VS_X86
