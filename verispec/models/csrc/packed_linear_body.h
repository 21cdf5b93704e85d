// The packed matmul's tiles, written once over a vector traits struct `V` (see packed_linear.cpp).
// packed_linear.cpp includes this file once per instruction-set variant, inside that variant's
// namespace and after its `struct V`, under that variant's target options, so every intrinsic is
// inlined into code compiled for its own instruction set.
//
// No include guard: it is meant to be included more than once.

// R rows x 16 output columns of one column block, over every group of K. `out` is [R][16] fp32.
// Each row's group sum is split over C independent integer chains (a multiply-add waits ~5 cycles
// for its predecessor, so one row alone would stall on one chain); integer sums are exact, so
// the split never changes a result.
// long: the hot loop reads top to bottom (prefetch, integer sums, one fp32 combine per group);
// split into helpers, its accumulators would no longer provably stay in registers.
template <int Fmt, int R>
void tile(const Packed& w, int64_t block, const Act& a, int64_t r0, float* out) {
  constexpr int64_t bytes = Fmt == kQ8_0 ? kBytes8 : kBytes4;
  constexpr int C = R >= V::kChains ? 1 : V::kChains / R;
  const int64_t k = a.k, groups = a.groups;
  for (int64_t h = 0; h < kCols / V::kCols; ++h) {  // 8-lane machines take the block in two halves
    typename V::F acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = V::zero_f();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = block * groups + g;
      const uint8_t* raw = w.codes + at * bytes + h * 2 * V::kCols;
      // The weights stream once per call: ask for a group a few ahead (the next block's follow).
      __builtin_prefetch(raw + kPrefetchGroups * bytes);
      __builtin_prefetch(raw + kPrefetchGroups * bytes + 64);
      __builtin_prefetch(raw + kPrefetchGroups * bytes + 128);
      __builtin_prefetch(raw + kPrefetchGroups * bytes + 192);
      if constexpr (Fmt == kQ8_0) {
#pragma GCC unroll 4
        for (int64_t e = 256; e < bytes; e += 64) __builtin_prefetch(raw + kPrefetchGroups * bytes + e);
      }
      const int16_t* x = a.q + r0 * k + g * kGroup;
      typename V::I dot[R][C];  // exact int32 sums of code x activation over the group
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) dot[r][c] = V::zero_i();
      if constexpr (Fmt == kQ8_0) {
        for (int64_t p = 0; p < kGroup / 2; ++p) {  // one pair of K per 32 bytes
          const typename V::W wv = V::load8(raw + p * 2 * kCols);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) dot[r][p % C] = V::dot(dot[r][p % C], wv, x + r * k + 2 * p);
        }
      } else {
        for (int64_t p = 0; p < kGroup / 4; ++p) {  // two pairs of K per 32 bytes: low and high nibbles
          typename V::W w0, w1;
          V::load4(raw + p * 2 * kCols, w0, w1);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            dot[r][(2 * p) % C] = V::dot(dot[r][(2 * p) % C], w0, x + r * k + 4 * p);
            dot[r][(2 * p + 1) % C] = V::dot(dot[r][(2 * p + 1) % C], w1, x + r * k + 4 * p + 2);
          }
        }
      }
      const typename V::F d = V::halves(w.d + at * kCols + h * V::kCols);
      typename V::F m;
      if constexpr (Fmt == kQ4_1) m = V::halves(w.m + at * kCols + h * V::kCols);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        typename V::I total = dot[r][0];
#pragma GCC unroll 8
        for (int c = 1; c < C; ++c) total = V::add(total, dot[r][c]);
        const int64_t row_group = (r0 + r) * groups + g;
        typename V::F u;
        if constexpr (Fmt == kQ4_0) {  // w = d (q - 8): the -8 is folded into the integer sum
          u = V::mul(d, V::cvt(V::sub(total, 8 * a.sum[row_group])));
        } else if constexpr (Fmt == kQ4_1) {  // w = d q + m
          u = V::fma(m, V::set1(static_cast<float>(a.sum[row_group])), V::mul(d, V::cvt(total)));
        } else {  // w = d q
          u = V::mul(d, V::cvt(total));
        }
        acc[r] = V::fma(V::set1(a.scale[row_group]), u, acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) V::store(out + r * kCols + h * V::kCols, acc[r]);
  }
}

template <int Fmt, int... R>
constexpr std::array<TileFn, kMaxRows> tiles_of(std::integer_sequence<int, R...>) {
  std::array<TileFn, kMaxRows> t{};
  ((t[R] = &tile<Fmt, R + 1>), ...);
  return t;
}

// This variant's tiles: [format][rows - 1], up to V::kRows rows.
inline const TileTable& table() {
  static const TileTable t{{tiles_of<kQ4_0>(std::make_integer_sequence<int, V::kRows>{}),
                            tiles_of<kQ4_1>(std::make_integer_sequence<int, V::kRows>{}),
                            tiles_of<kQ8_0>(std::make_integer_sequence<int, V::kRows>{})},
                           V::kRows};
  return t;
}
