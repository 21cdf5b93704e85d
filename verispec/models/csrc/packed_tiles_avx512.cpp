// The AVX-512 variants (and AVX512-VNNI where built): the packed matmul's tiles over 512-bit vectors
// (packed_linear_body.h, packed_tiles.h), from a source of its own so a build compiles the
// variants in parallel.
#define VS_PACKED_NO_ATEN 1
#include "packed_tiles.h"

#if defined(VS_X86) && defined(CPU_CAPABILITY_AVX512)
namespace {
#define VS_AVX512_TRAITS(DOT, DOT8, WIDEN, INT32)                                                     \
  struct V {                                                                                          \
    static constexpr int kCols = 16, kRows = kMaxRows, kChains = INT32 ? 8 : 1; /* see chains() */   \
    static constexpr bool kDot8Int32 = INT32;                                                         \
    using W = __m512i;                                                                                \
    using B = __m512i;                                                                                \
    using I = __m512i;                                                                                \
    using F = __m512;                                                                                 \
    static I zero_i() { return _mm512_setzero_si512(); }                                              \
    static F zero_f() { return _mm512_setzero_ps(); }                                                 \
    static B bits(const uint8_t* p, int shift, uint8_t mask) { /* shift: within 16-bit lanes */    \
      __m512i v = _mm512_loadu_si512(p);                                                              \
      if (shift > 0) v = _mm512_slli_epi16(v, shift);                                                 \
      if (shift < 0) v = _mm512_srli_epi16(v, -shift);                                                \
      return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(mask)));                          \
    }                                                                                                 \
    static B or_b(B a, B b) { return _mm512_or_si512(a, b); }                                         \
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
    static I sub_i(I a, I b) { return _mm512_sub_epi32(a, b); }                                       \
    static I set1_i(int32_t s) { return _mm512_set1_epi32(s); }                                       \
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

}  // namespace

namespace vs {
const TileTable& avx512_table() { return avx512::table(); }
#if defined(VS_AVX512_VNNI)
const TileTable& avx512_vnni_table() { return avx512_vnni::table(); }
#endif
}  // namespace vs
#endif
