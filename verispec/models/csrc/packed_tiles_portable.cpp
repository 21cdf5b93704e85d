// The portable variant (any CPU): the packed matmul's tiles over plain arrays of 16 lanes
// (packed_linear_body.h, packed_tiles.h), from a source of its own so a build compiles the
// variants in parallel.
#define VS_PACKED_NO_ATEN 1
#include "packed_tiles.h"

#include <c10/util/Half.h>

#include <cmath>

namespace {
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
  static B bits(const uint8_t* p, int shift, uint8_t mask) {  // as the vectors: shifts within 16-bit lanes
    B b;
    for (int j = 0; j < 32; ++j) {
      uint32_t v = p[2 * j] | (uint32_t(p[2 * j + 1]) << 8);
      v = shift >= 0 ? v << shift : v >> -shift;
      b.v[2 * j] = static_cast<uint8_t>(v) & mask, b.v[2 * j + 1] = static_cast<uint8_t>(v >> 8) & mask;
    }
    return b;
  }
  static B or_b(B a, const B& b) {
    for (int j = 0; j < 64; ++j) a.v[j] |= b.v[j];
    return a;
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
  static I sub_i(I a, const I& b) {
    for (int j = 0; j < 16; ++j) a.v[j] -= b.v[j];
    return a;
  }
  static I set1_i(int32_t s) {
    I a;
    for (auto& v : a.v) v = s;
    return a;
  }
};
#include "packed_linear_body.h"
}  // namespace portable
}  // namespace

namespace vs {
const TileTable& portable_table() { return portable::table(); }
}  // namespace vs
