// The paged attention kernel's vector tiles (paged_attention.cpp): query rows scored against
// blocks of transposed keys, the softmax of a row's scores, and the values weighed by them. Each
// lane sums in key order or over the head in order, so no result depends on how many rows or
// blocks share a tile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 4;  // query vectors scored together (independent FMA chains)
constexpr int64_t kTile = 8;  // query rows per work item

template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline void store_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Scores of R query rows (float, `q_stride` apart) against B blocks' transposed keys [head][bs]
// at once: R * B independent FMA chains. Each lane still sums over the head in order, so a score
// does not depend on R or B.
template <int R, int B, typename T>
inline void score_blocks(const float* q, int64_t q_stride, const T* const* keys_t, int64_t head,
                         int64_t block_size, float scale, float* out, int64_t out_stride) {
  for (int64_t l = 0; l < block_size; l += Vec::size()) {
    Vec acc[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) acc[r][b] = Vec(0.f);
    for (int64_t d = 0; d < head; ++d) {
      Vec k[B];
      for (int b = 0; b < B; ++b) k[b] = load_float(keys_t[b] + d * block_size + l);
      for (int r = 0; r < R; ++r) {
        const Vec qd(q[r * q_stride + d]);
        for (int b = 0; b < B; ++b) acc[r][b] = at::vec::fmadd(qd, k[b], acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) (acc[r][b] * Vec(scale)).store(out + r * out_stride + b * block_size + l);
  }
}

template <int B, typename T>
inline void score_rows(int64_t count, const float* q, int64_t q_stride, const T* const* keys_t, int64_t head,
                       int64_t block_size, float scale, float* out, int64_t out_stride) {
  switch (count) {
    case 4: score_blocks<4, B>(q, q_stride, keys_t, head, block_size, scale, out, out_stride); break;
    case 3: score_blocks<3, B>(q, q_stride, keys_t, head, block_size, scale, out, out_stride); break;
    case 2: score_blocks<2, B>(q, q_stride, keys_t, head, block_size, scale, out, out_stride); break;
    default: score_blocks<1, B>(q, q_stride, keys_t, head, block_size, scale, out, out_stride); break;
  }
}

// For R rows at once, acc_r[0, M lanes) = sum over row r's first n_r keys of w_r[j] * v_j[d0, ...),
// in key order (n_0 <= n_1 <= ...; rows share the loads of the values).
template <int R, int M, typename T>
inline void weigh_values(const float* const* weight, const int64_t* n, const T* v_cache, const int64_t* blocks,
                         int64_t block_size, int64_t row_stride, int64_t d0, float* const* acc) {
  Vec a[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) a[r][m] = Vec(0.f);
  const int64_t last = n[R - 1];
  for (int64_t j0 = 0; j0 < last; j0 += block_size) {
    const T* block = v_cache + blocks[j0 / block_size] * block_size * row_stride + d0;
    for (int64_t j = j0; j < std::min(last, j0 + block_size); ++j) {
      const T* row = block + (j - j0) * row_stride;
      Vec v[M];
      for (int m = 0; m < M; ++m) v[m] = load_float(row + m * Vec::size());
      for (int r = 0; r < R; ++r) {
        if (j >= n[r]) continue;
        const Vec w(weight[r][j]);
        for (int m = 0; m < M; ++m) a[r][m] = at::vec::fmadd(w, v[m], a[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) a[r][m].store(acc[r] + m * Vec::size());
}

template <int R, typename T>
inline void weigh_all(const float* const* weight, const int64_t* n, const T* v_cache, const int64_t* blocks,
                      int64_t block_size, int64_t row_stride, int64_t padded, float* const* acc) {
  for (int64_t d0 = 0; d0 < padded; d0 += 4 * Vec::size()) {
    float* a[R];
    for (int r = 0; r < R; ++r) a[r] = acc[r] + d0;
    switch (std::min<int64_t>(4, (padded - d0) / Vec::size())) {
      case 4: weigh_values<R, 4>(weight, n, v_cache, blocks, block_size, row_stride, d0, a); break;
      case 3: weigh_values<R, 3>(weight, n, v_cache, blocks, block_size, row_stride, d0, a); break;
      case 2: weigh_values<R, 2>(weight, n, v_cache, blocks, block_size, row_stride, d0, a); break;
      default: weigh_values<R, 1>(weight, n, v_cache, blocks, block_size, row_stride, d0, a); break;
    }
  }
}

// exp(s - max) over the first n >= 1 scores, in place; returns their sum, and the max in `mx`.
inline float softmax_weights(float* s, int64_t n, float& max_out) {
  // The max in vectors (a max is exact in any order); a local, since `max_out` may alias `s`.
  Vec vmx(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) vmx = at::vec::maximum(vmx, Vec::loadu(s + i));
  float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmx);
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  max_out = mx;
  const Vec vmax(mx);
  Vec vsum(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(s + j) - vmax).exp();
    e.store(s + j);
    vsum = vsum + e;
  }
  if (j < n) {
    const Vec e = (Vec::loadu(s + j, n - j) - vmax).exp();
    e.store(s + j, n - j);
    vsum = vsum + Vec::set(Vec(0.f), e, n - j);
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
}

}  // namespace
