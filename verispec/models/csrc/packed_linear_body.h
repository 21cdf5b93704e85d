// The packed matmul's tiles, written once over a vector traits struct `V` (see packed_linear.cpp).
// Each packed_tiles_<variant>.cpp includes this file once per instruction-set variant, inside that variant's
// namespace and after its `struct V`, under that variant's target options, so every intrinsic is
// inlined into code compiled for its own instruction set.
//
// No include guard: it is meant to be included more than once.

// Independent integer chains per row: a VNNI multiply-add accumulates in place and waits ~5 cycles
// for its predecessor, so a row or two alone would stall on one chain; from 3 rows the rows' own
// chains keep the unit busy (one chain there measured faster than two). Without VNNI the multiply
// does not wait on the sum and the add takes a cycle: one chain, fewer widenings (V::kChains = 1).
// Integer sums are exact: the split never changes a result.
template <int R>
constexpr int chains() { return R >= 3 || V::kChains < 2 * R ? 1 : V::kChains / R; }

inline void prefetch_group(const uint8_t* next, int64_t bytes) {  // the weights stream once per call
#pragma GCC unroll 8
  for (int64_t e = 0; e < bytes; e += 64) __builtin_prefetch(next + e);
}

// Halves of a column block per pass over its groups, where a vector holds half a block's columns
// (8 lanes: AVX2). One or two rows leave registers for both halves, so a group's scalars, its
// activations and the prefetches are paid once per 16 columns; more rows take a pass per half.
template <int R>
constexpr int tile_halves() { return R <= 2 ? kCols / V::kCols : 1; }

// How far ahead of group g the weights are prefetched, in the pass over halves h0..h0+H-1. Where
// a block takes two passes (columns 0..7, then 8..15), the first pass brings the block's bytes in
// and the second reads them from L2: it prefetches the next block instead, so memory streams
// during both passes rather than idling through the second (1B decode at one thread: ~8.6 -> ~10 GB/s).
inline int64_t prefetch_distance(int64_t h0, int H, int64_t groups, int64_t bytes) {
  const bool second_pass = H < kCols / V::kCols && h0 + H == kCols / V::kCols;
  return (second_pass ? groups : kPrefetchGroups) * bytes;
}

constexpr int kRuns = kGroup / 4;  // runs of 4 inputs per group

// Column lanes' codes for run p of a group's bytes `raw`, columns h * V::kCols onwards: the nibbles
// of lane chunk p / 2, with the fifth (or fifth and sixth) bits from their own chunk, each one load,
// one shift and one mask (packed_layout.h).
template <int Fmt>
inline typename V::B qx_codes(const uint8_t* raw, int p, int64_t h) {
  const uint8_t* lanes = raw + h * 4 * V::kCols;
  const typename V::B lo = V::bits(lanes + (p / 2) * kLaneBytes, p % 2 ? -4 : 0, 0x0F);
  if constexpr (code_bits(Fmt) == 4) {
    return lo;
  } else if constexpr (code_bits(Fmt) == 5) {  // bit p -> bit 4
    return V::or_b(lo, V::bits(lanes + kBytes4, 4 - p, 0x10));
  } else {  // bits 2 (p % 4), 2 (p % 4) + 1 of chunk p / 4 -> bits 4, 5
    return V::or_b(lo, V::bits(lanes + kBytes4 + (p / 4) * kLaneBytes, 4 - 2 * (p % 4), 0x30));
  }
}

// One group g of R rows of 4-bit codes (Q4_0, Q4_1) into `acc`, for the columns of half h, on
// int8 activations (packed_activations.h). A group's integer value is T1 (over q1), or 254 T1 + T2
// in an outlier group (T2 over the residual), exact in fp32.
template <int Fmt, int R>
[[gnu::always_inline]] inline void q4_group(const Packed& w, int64_t block, int64_t g, int64_t h, const Act& a,
                                            int64_t r0, typename V::F (&acc)[R]) {
  constexpr int C = chains<R>();
  const int64_t at = block * a.groups + g, ag = a.at(g, r0);
  const uint8_t* raw = w.codes + at * kBytes4;
  const int8_t* x = a.q8 + ag * kGroup;  // row r at x + r * kGroup
  const vs::GroupMeta* meta = a.meta + ag;
  typename V::I dot[R][C];  // exact sums of code x q1 over the group, in V::dot8's partial form
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) dot[r][c] = V::zero_i();
  typename V::B wv[kRuns];  // kept for the residuals (in registers with AVX-512's 32)
#pragma GCC unroll 8
  for (int p = 0; p < kRuns; ++p) {
    wv[p] = qx_codes<Fmt>(raw, p, h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r][p % C] = V::dot8(dot[r][p % C], wv[p], x + r * kGroup + 4 * p);
  }
  const typename V::F d = V::halves(w.d + at * kCols + h * V::kCols);
  typename V::F m;
  if constexpr (Fmt == kQ4_1) m = V::halves(w.m + at * kCols + h * V::kCols);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    typename V::I total = V::widen(dot[r][0]);
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) total = V::add(total, V::widen(dot[r][c]));
    typename V::F value = V::cvt(total);
    if (meta[r].outlier) {  // this row's own flag: its bits never depend on the others
      const int8_t* res = a.r8 + (ag + r) * kGroup;
      typename V::I t2 = V::zero_i();
#pragma GCC unroll 8
      for (int p = 0; p < kRuns; ++p) t2 = V::dot8(t2, wv[p], res + 4 * p);
      value = V::fma(value, V::set1(float(kResidualSteps)), V::cvt(V::widen(t2)));  // exact: below 2^24
    }
    const typename V::F ds = V::mul(d, V::set1(meta[r].scale));
    if constexpr (Fmt == kQ4_0) {  // w = d (q - 8): the -8 taken off the exact integer value
      acc[r] = V::fma(ds, V::sub_f(value, V::set1(8.f * meta[r].sum)), acc[r]);
    } else {  // w = d q + m
      acc[r] = V::fma(m, V::set1(meta[r].ssum), V::fma(ds, value, acc[r]));
    }
  }
}

#include "packed_tile_qx.h"

// A pass's accumulators: H halves x R rows of V::kCols columns.
template <int H, int R>
[[gnu::always_inline]] inline void zero_acc(typename V::F (&acc)[H][R]) {
#pragma GCC unroll 2
  for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[hh][r] = V::zero_f();
}
template <int H, int R>
[[gnu::always_inline]] inline void store_acc(typename V::F (&acc)[H][R], int64_t h0, float* out) {
#pragma GCC unroll 2
  for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) V::store(out + r * kCols + (h0 + hh) * V::kCols, acc[hh][r]);
}

// R rows x 16 output columns of one column block in format Fmt, over every group of K; `out` is
// [R][16] fp32. An 8-lane machine takes H halves of the block per pass over its groups (tile_halves).
template <int Fmt, int R>
void tile(const Packed& w, int64_t block, const Act& a, int64_t r0, float* out) {
  constexpr int H = tile_halves<R>();
  constexpr int64_t bytes = group_bytes(Fmt);
  const int64_t groups = a.groups;
  for (int64_t h0 = 0; h0 < kCols / V::kCols; h0 += H) {
    typename V::F acc[H][R];
    zero_acc(acc);
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_group(w.codes + (block * groups + g) * bytes + prefetch_distance(h0, H, groups, bytes), bytes);
#pragma GCC unroll 2
      for (int hh = 0; hh < H; ++hh) {
        if constexpr (Fmt == kQ4_0 || Fmt == kQ4_1) q4_group<Fmt, R>(w, block, g, h0 + hh, a, r0, acc[hh]);
        else qx_group<Fmt, R>(w, block, g, h0 + hh, a, r0, acc[hh]);
      }
    }
    store_acc(acc, h0, out);
  }
}

// The same for 8-bit codes (Q8_0, w = d q) on int16 activations: one int16 pair per 32-bit lane.
// Its own loop, the group's body written out: through a helper inlined into `tile`, as the other
// formats', the compiler spilled the weights at 4 and 8 rows (5-10 % slower).
// long: the hot loop reads top to bottom, as q4_group's.
template <int R>
void tile_q8(const Packed& w, int64_t block, const Act& a, int64_t r0, float* out) {
  constexpr int C = chains<R>(), H = tile_halves<R>();
  const int64_t groups = a.groups;
  for (int64_t h0 = 0; h0 < kCols / V::kCols; h0 += H) {
    typename V::F acc[H][R];
    zero_acc(acc);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = block * groups + g, ag = a.at(g, r0);
      prefetch_group(w.codes + at * kBytes8 + prefetch_distance(h0, H, groups, kBytes8), kBytes8);
      const int16_t* x = a.q16 + ag * kGroup;  // row r at x + r * kGroup
#pragma GCC unroll 2
      for (int hh = 0; hh < H; ++hh) {
        const uint8_t* raw = w.codes + at * kBytes8 + (h0 + hh) * 2 * V::kCols;
        typename V::I dot[R][C];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) dot[r][c] = V::zero_i();
        for (int64_t p = 0; p < kGroup / 2; ++p) {  // one pair of K per 32 bytes (not unrolled: many rows would spill)
          const typename V::W wv = V::load8(raw + p * 2 * kCols);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) dot[r][p % C] = V::dot(dot[r][p % C], wv, x + r * kGroup + 2 * p);
        }
        const typename V::F d = V::halves(w.d + at * kCols + (h0 + hh) * V::kCols);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          typename V::I total = dot[r][0];
#pragma GCC unroll 8
          for (int c = 1; c < C; ++c) total = V::add(total, dot[r][c]);
          acc[hh][r] = V::fma(V::set1(a.meta[ag + r].scale), V::mul(d, V::cvt(total)), acc[hh][r]);
        }
      }
    }
    store_acc(acc, h0, out);
  }
}

template <int Fmt, int R>
constexpr TileFn tile_of() {
  if constexpr (Fmt == kQ8_0) return &tile_q8<R>;
  else return &tile<Fmt, R>;
}

template <int Fmt, int... R>
constexpr std::array<TileFn, kMaxRows> tiles(std::integer_sequence<int, R...>) {
  return {tile_of<Fmt, R + 1>()...};
}

// This variant's tiles: [format][rows - 1], up to V::kRows rows.
inline const TileTable& table() {
  constexpr auto rows = std::make_integer_sequence<int, V::kRows>{};
  static const TileTable t{{tiles<kQ4_0>(rows), tiles<kQ4_1>(rows), tiles<kQ8_0>(rows), tiles<kQ5_0>(rows),
                            tiles<kQ5_1>(rows), tiles<kQ4_K>(rows), tiles<kQ5_K>(rows), tiles<kQ6_K>(rows)},
                           V::kRows};
  return t;
}
