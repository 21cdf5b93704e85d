// The packed matmul's activations, quantized per row and group of 32 (packed_linear.cpp).
//
// - Q8_0 weights (the 8-bit head) take int16 activations: s = max|x| / 32767, q = round(x / s).
// - 4-bit weights take int8 activations, with an int8 residual where one is needed:
//   s1 = max|x| / 127, q1 = round(x / s1): the group is s1 q1. In a group whose max exceeds 4x
//   its root mean square (an outlier group, where int8 alone loses the small values; judged on
//   q1) also q2 = round((x - s1 q1) / s), s = s1 / 254, and the group is s (254 q1 + q2):
//   |254 q1 + q2| <= 32385, about int16's resolution where it matters, while most groups cost one
//   int8 multiply-add pass instead of two int16 ones. Whether a group has a residual depends only
//   on its own values, so a row's bits never depend on the rows beside it.
// A group holding an inf or a NaN gets a NaN scale, so its rows' outputs are NaN (as a dense
// matmul's would be).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "packed_layout.h"

namespace vs {  // named: the tiles of each instruction set take it from their own sources
struct GroupMeta {  // what a row's group adds to the combine besides its integer sums
  float scale;       // the group's step (int8: s1, or s in an outlier group)
  float sum;         // int8: the sum of the group's values on that step (exact)
  float ssum;        // int8: scale * sum, for the offsets (Q4_1, Q5_1, Q4_K, Q5_K)
  int32_t half[2];   // int8: the sums over inputs 0..15 and 16..31 (Q6_K's sub-blocks)
  int32_t outlier;   // int8: whether r8 holds a residual
};
// A call's activations, group-major: group g of row r at [g][r], so a tile's rows of one group
// sit at constant offsets from one pointer (a register per array, not one per row).
struct Act {
  const int16_t* q16;  // [groups, M, 32]: Q8_0's int16 values
  const int8_t* q8;    // [groups, M, 32]: int8 values
  const int8_t* r8;    // [groups, M, 32]: int8 residuals; zero outside outlier groups
  const GroupMeta* meta;  // [groups, M]
  int64_t m, groups;
  int64_t at(int64_t g, int64_t r0) const { return g * m + r0; }  // rows r0.. of group g
};
}  // namespace vs

namespace {

constexpr int32_t kAct16Max = 32767, kAct8Max = 127, kResidualSteps = 254;
// A group whose max |x| exceeds 4x its root mean square keeps a residual: in int8 units,
// sum(q1^2) < 2 * 127^2.
constexpr int32_t kOutlierSquares = 2 * kAct8Max * kAct8Max;

using vs::Act;

struct ActBuffers {  // owns what an Act points at
  std::vector<int16_t> q16;
  std::vector<int8_t> q8, r8;
  std::vector<vs::GroupMeta> meta;
  Act act(int64_t m, int64_t groups) const {
    return {q16.data(), q8.data(), r8.data(), meta.data(), m, groups};
  }
};

// The group's values as fp32, its max |x|, and whether every value is finite. The max is taken
// on the bits (for non-negative floats integer order is float order): the vectorizer takes an
// integer max, and the result is exact either way.
template <typename T>
bool load_group(const T* xs, float* v, float& amax) {
  uint32_t top = 0;
  for (int64_t j = 0; j < kGroup; ++j) {
    v[j] = static_cast<float>(xs[j]);
    uint32_t bits;
    std::memcpy(&bits, &v[j], sizeof bits);
    top = std::max(top, bits & 0x7FFFFFFFu);
  }
  std::memcpy(&amax, &top, sizeof amax);
  return top < 0x7F800000u;  // below the bits of +inf: no inf, no NaN
}

template <typename T>
void quantize_int16(const T* x, int64_t m, int64_t k, ActBuffers& b) {
  const int64_t groups = k / kGroup;
  b.q16.assign(m * k, 0);
  b.meta.assign(m * groups, vs::GroupMeta{});
  for (int64_t row = 0; row < m; ++row)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t i = g * m + row;  // group-major (Act)
      float v[kGroup], amax;
      const bool finite = load_group(x + row * k + g * kGroup, v, amax);
      const float d = amax / static_cast<float>(kAct16Max);
      if (finite && d > 0.f)
        for (int64_t j = 0; j < kGroup; ++j)
          b.q16[i * kGroup + j] = static_cast<int16_t>(std::clamp(std::nearbyint(v[j] / d), -float(kAct16Max), float(kAct16Max)));
      b.meta[i].scale = finite ? d : std::numeric_limits<float>::quiet_NaN();
    }
}

// One group of 32 values into its int8 codes `q`, residuals `r` and `meta`.
// Written for the compiler's vectorizer: integer max (load_group) and sums, and the exact float
// operations (division, rint, fma, min, max) give the same bits in vectors as in scalars, so every
// build level quantizes alike.
template <typename T>
void quantize_group_int8(const T* xs, int8_t* q, int8_t* r, vs::GroupMeta& meta) {
  float v[kGroup], q1[kGroup], amax;
  const bool finite = load_group(xs, v, amax);
  const float s1 = amax / static_cast<float>(kAct8Max), s = s1 / static_cast<float>(kResidualSteps);
  meta.scale = finite ? s1 : std::numeric_limits<float>::quiet_NaN();
  meta.ssum = meta.scale * 0.f;  // NaN with the scale
  if (!finite || !(s > 0.f)) return;
  int32_t squares = 0, sum1 = 0, sum2 = 0, half1 = 0, half2 = 0;  // half: inputs 0..15
  for (int64_t j = 0; j < kGroup; ++j) {
    q1[j] = std::min(std::max(std::rint(v[j] / s1), -float(kAct8Max)), float(kAct8Max));
    q[j] = static_cast<int8_t>(q1[j]);
  }
  for (int64_t j = 0; j < kGroup; ++j) squares += q[j] * q[j], sum1 += q[j];
  for (int64_t j = 0; j < kGroup / 2; ++j) half1 += q[j];
  // max|x| > 4 rms, on the int8 values (exact): 127^2 > 16 sum(q1^2) / 32.
  const bool outlier = squares < kOutlierSquares;
  if (outlier) {
    for (int64_t j = 0; j < kGroup; ++j)  // fma: the residual x - s1 q1, rounded once
      r[j] = static_cast<int8_t>(std::min(std::max(std::rint(std::fma(-q1[j], s1, v[j]) / s), -float(kAct8Max)), float(kAct8Max)));
    for (int64_t j = 0; j < kGroup; ++j) sum2 += r[j];
    for (int64_t j = 0; j < kGroup / 2; ++j) half2 += r[j];
  }
  meta.outlier = outlier;
  meta.scale = outlier ? s : s1;
  meta.sum = static_cast<float>(outlier ? kResidualSteps * sum1 + sum2 : sum1);  // < 2^24: exact
  meta.half[0] = outlier ? kResidualSteps * half1 + half2 : half1;
  meta.half[1] = outlier ? kResidualSteps * (sum1 - half1) + (sum2 - half2) : sum1 - half1;
  meta.ssum = meta.scale * meta.sum;
}

template <typename T>
void quantize_int8(const T* x, int64_t m, int64_t k, ActBuffers& b) {
  const int64_t groups = k / kGroup;
  b.q8.assign(m * k, 0);
  b.r8.assign(m * k, 0);
  b.meta.assign(m * groups, vs::GroupMeta{});
  for (int64_t row = 0; row < m; ++row)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t i = g * m + row;  // group-major (Act)
      quantize_group_int8(x + row * k + g * kGroup, b.q8.data() + i * kGroup, b.r8.data() + i * kGroup, b.meta[i]);
    }
}

}  // namespace
