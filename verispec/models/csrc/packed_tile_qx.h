// The packed matmul's tiles for 5- and 6-bit codes and the K-quants (Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K), over a vector traits struct `V`; included by packed_linear_body.h once per variant.
//
// They follow q4_group (packed_linear_body.h): int8 activations (with their residual in outlier
// groups), exact integer sums of code x activation per group, one fp32 combine per group. What
// differs:
// - a code is its nibble plus its high bits (layout: packed_layout.h), put together once per run
//   for all rows;
// - without VNNI, dot8's int16 lanes hold fewer runs before they must be widened to int32:
//   |pair| <= 2 x 31 x 127 = 7874 (5 bits: 4 runs fit int16) or 2 x 63 x 127 = 16002 (6 bits: 2);
// - the integer value of an outlier group (254 T1 + T2) and the centre's correction (q - 16 or
//   q - 32 times the activations' sum) are taken in int32, exact, then rounded to fp32 once: with
//   wider codes they can pass 2^24;
// - a K-quant's group scale is the super-block's fp16 d times the group's 6-bit scale (8-bit for
//   Q6_K, one per 16 inputs), its offset dmin times the 6-bit min: exact products in fp32.
// Every variant does the same integer sums and the same float operations in the same order, so
// a row's result depends neither on the rows beside it nor on the instruction set.
//
// No include guard: it is meant to be included more than once.

// Exact int32 sums of code x activation for R rows, over each of the group's S sets of runs
// (S = 2 for Q6_K's sub-blocks of 16 inputs, else 1), in C chains per row. A chain's int16 lanes
// are widened after every `Widen` runs (never, with int32 sums): the sums are the same integers.
template <int R, int C, int S, int Widen>
inline void qx_sums(const typename V::B* wv, const int8_t* x, typename V::I (&tot)[R][S]) {
  constexpr int kSetRuns = kRuns / S;
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s) {
    typename V::I dot[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      tot[r][s] = V::zero_i();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) dot[r][c] = V::zero_i();
    }
#pragma GCC unroll 8
    for (int q = 0; q < kSetRuns; ++q) {
      const int p = s * kSetRuns + q, c = q % C;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) dot[r][c] = V::dot8(dot[r][c], wv[p], x + r * kGroup + 4 * p);
      const bool last = q + C >= kSetRuns;  // chain c's last run of the set
      if (last || (q / C + 1) % Widen == 0) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          tot[r][s] = V::add(tot[r][s], V::widen(dot[r][c]));
          dot[r][c] = V::zero_i();
        }
      }
    }
  }
}

// One group g of R rows into `acc`, for the columns of half h (h * V::kCols onwards) of a column
// block in format Fmt: integer sums, then one fp32 combine per group.
// long: the hot loop reads top to bottom (codes, integer sums, the group's scales, the combine), as q4_group.
template <int Fmt, int R>
[[gnu::always_inline]] inline void qx_group(const Packed& w, int64_t block, int64_t g, int64_t h, const Act& a,
                                            int64_t r0, typename V::F (&acc)[R]) {
  constexpr int S = Fmt == kQ6_K ? 2 : 1;
  constexpr int C = std::min(chains<R>(), kRuns / S);
  constexpr int Widen = V::kDot8Int32 ? kGroup : code_bits(Fmt) == 4 ? 8 : code_bits(Fmt) == 5 ? 4 : 2;
  constexpr int64_t bytes = group_bytes(Fmt);
  constexpr int64_t subs = kBytes4 + high_bytes(Fmt);  // a K-quant's sub-block scales, in the group's bytes
  const int64_t groups = a.groups, at = block * groups + g, ag = a.at(g, r0);
  const uint8_t* raw = w.codes + at * bytes;
  const vs::GroupMeta* meta = a.meta + ag;  // row r's at meta[r], its activations at (ag + r) * kGroup
  typename V::B wv[kRuns];
#pragma GCC unroll 8
  for (int p = 0; p < kRuns; ++p) wv[p] = qx_codes<Fmt>(raw, p, h);
  typename V::I tot[R][S];
  qx_sums<R, C, S, Widen>(wv, a.q8 + ag * kGroup, tot);
  // This group's scale (and offset) per column, before the activations' step.
  const int64_t scale_at = (is_kquant(Fmt) ? block * (groups / kSuperGroups) + g / kSuperGroups : at) * kCols;
  const typename V::F d = V::halves(w.d + scale_at + h * V::kCols);
  typename V::F dg[S], mg;
  if constexpr (Fmt == kQ6_K) {
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) dg[s] = V::mul(d, V::cvt(V::lanes_i8(raw + subs + s * kCols + h * V::kCols)));
  } else if constexpr (is_kquant(Fmt)) {  // w = (d sc) q - (dmin mn)
    dg[0] = V::mul(d, V::cvt(V::lanes_u8(raw + subs + h * V::kCols)));
    mg = V::sub_f(V::zero_f(), V::mul(V::halves(w.m + scale_at + h * V::kCols),
                                      V::cvt(V::lanes_u8(raw + subs + kCols + h * V::kCols))));
  } else {
    dg[0] = d;
    if constexpr (has_offsets(Fmt)) mg = V::halves(w.m + scale_at + h * V::kCols);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    typename V::I value[S];
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) value[s] = tot[r][s];
    if (meta[r].outlier) {  // this row's own flag: its bits never depend on the others
      typename V::I t2[1][S];
      qx_sums<1, std::min(chains<1>(), kRuns / S), S, Widen>(wv, a.r8 + (ag + r) * kGroup, t2);
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s)  // 254 T1 + T2, exact in int32
        value[s] = V::add(V::sub_i(V::template slli<8>(value[s]), V::template slli<1>(value[s])), t2[0][s]);
    }
    const typename V::F xs = V::set1(meta[r].scale);
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) {
      if constexpr (center(Fmt) != 0) {  // w = d (q - centre): centre x the activations' sum, in int32
        const int32_t sum = S == 2 ? meta[r].half[s] : static_cast<int32_t>(meta[r].sum);
        value[s] = V::sub_i(value[s], V::set1_i(center(Fmt) * sum));
      }
      acc[r] = V::fma(V::mul(dg[s], xs), V::cvt(value[s]), acc[r]);
    }
    if constexpr (has_offsets(Fmt)) acc[r] = V::fma(mg, V::set1(meta[r].ssum), acc[r]);
  }
}
