// The packed matmul's weights: the file's codes put into the layout of packed_layout.h
// (`packed_codes`), and the dense matrix they stand for (`packed_dequantize`: the reference the
// tests check the layout against, exactly or rounded once to half precision).
#include "packed_layout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// [N, K] codes (uint8 0..15 for 4 bits, int8 for 8) -> [N/16, K/32, bytes] in the layout above;
// columns past N are zero codes (with zero scales they compute 0, and are never stored).
at::Tensor packed_codes(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % kGroup == 0 && (bits == 4 || bits == 8) && codes.element_size() == 1,
              "packed_codes: codes must be [N, K] bytes, K a multiple of 32, bits 4 or 8");
  const at::Tensor c = codes.contiguous().view(at::kByte);
  const int64_t n = c.size(0), k = c.size(1), groups = k / kGroup, blocks = (n + kCols - 1) / kCols;
  const int64_t bytes = bits == 8 ? kBytes8 : kBytes4;
  at::Tensor out = at::zeros({blocks, groups, bytes}, c.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int fmt = bits == 8 ? kQ8_0 : kQ4_0;  // the layout depends only on the code width
  for (int64_t row = 0; row < n; ++row) {
    const int64_t b = row / kCols, col = row % kCols;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* s = src + row * k + g * kGroup;
      for (int64_t j = 0; j < kGroup; ++j) {
        TORCH_CHECK(bits == 8 || s[j] < 16, "packed_codes: 4-bit codes must be 0..15");
        put_code(fmt, dst + (b * groups + g) * bytes, j, col, s[j]);
      }
    }
  }
  return out;
}

// One format's column blocks [begin, end) of the dense matrix. Each group of a block is decoded
// into a 16 x 32 tile of codes, then every weight is computed exactly in fp32 (d q and d (q - 8)
// are exact products of an fp16 scale and a small integer; d q + m rounds once) and rounded once
// to T as it is stored: no fp32 matrix in between. The dense prefill path decodes every matrix for
// every long chunk, so this pass is part of the time to first token.
template <int Fmt, typename T>
void dequantize_blocks(const uint8_t* cp, const at::Half* dp, const at::Half* mp, T* wp, int64_t n, int64_t groups,
                       int64_t begin, int64_t end) {
  constexpr int64_t bytes = Fmt == kQ8_0 ? kBytes8 : kBytes4;
  const int64_t k = groups * kGroup;
  float q[kCols][kGroup];
  for (int64_t b = begin; b < end; ++b) {
    const int64_t cols = std::min(kCols, n - b * kCols);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = cp + (b * groups + g) * bytes;
      constexpr int bias = Fmt == kQ4_0 ? 8 : 0;
      for (int64_t c = 0; c < kCols; ++c)
        for (int64_t j = 0; j < kGroup; ++j) {
          const int code = code_at(Fmt, blk, j, c);
          q[c][j] = static_cast<float>(Fmt == kQ8_0 ? static_cast<int8_t>(code) : code - bias);
        }
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t at = (b * groups + g) * kCols + c;
        const float d = dp[at];
        const float off = Fmt == kQ4_1 ? static_cast<float>(mp[at]) : 0.f;
        T* out = wp + (b * kCols + c) * k + g * kGroup;
        for (int64_t j = 0; j < kGroup; ++j) out[j] = static_cast<T>(Fmt == kQ4_1 ? d * q[c][j] + off : d * q[c][j]);
      }
    }
  }
}

// One group of column c, decoded exactly to fp32 as gguf's own dequantize computes it:
// d (q - centre) + m, d q (Q8_0), (d sc) q - (dmin mn), (d sc) (q - 32); the scale products are
// exact, so each weight rounds once, as there. `d` and `m` point at the column's scale (offset).
void decode_group(int fmt, const uint8_t* raw, const uint16_t* d, const uint16_t* m, int64_t col, float* out) {
  const int64_t subs = kBytes4 + high_bytes(fmt);
  const float dd = c10::detail::fp16_ieee_to_fp32_value(*d);
  for (int64_t j = 0; j < kGroup; ++j) {
    const int q = code_at(fmt, raw, j, col);
    if (fmt == kQ8_0) {
      out[j] = dd * static_cast<float>(static_cast<int8_t>(q));
      continue;
    }
    if (fmt == kQ6_K) {
      const float dg = dd * static_cast<float>(static_cast<int8_t>(raw[subs + (j / 16) * kCols + col]));
      out[j] = dg * static_cast<float>(q - 32);
    } else if (is_kquant(fmt)) {
      const float dg = dd * static_cast<float>(raw[subs + col]);
      const float mg = c10::detail::fp16_ieee_to_fp32_value(*m) * static_cast<float>(raw[subs + kCols + col]);
      out[j] = dg * static_cast<float>(q) - mg;
    } else if (has_offsets(fmt)) {
      out[j] = dd * static_cast<float>(q) + c10::detail::fp16_ieee_to_fp32_value(*m);
    } else {
      out[j] = dd * static_cast<float>(q - center(fmt));
    }
  }
}

// Where column `col` of column block b, group g, has its scale (and offset): per group, or per
// K-quant super-block.
inline int64_t scale_index(int fmt, int64_t b, int64_t g, int64_t groups, int64_t col) {
  return (is_kquant(fmt) ? b * (groups / kSuperGroups) + g / kSuperGroups : b * groups + g) * kCols + col;
}

template <typename T>
void dequantize_qx(int fmt, const uint8_t* cp, const uint16_t* dp, const uint16_t* mp, T* wp, int64_t n,
                   int64_t groups, int64_t begin, int64_t end) {
  const int64_t k = groups * kGroup, bytes = group_bytes(fmt);
  float v[kGroup];
  for (int64_t b = begin; b < end; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < std::min(kCols, n - b * kCols); ++c) {
        const int64_t at = scale_index(fmt, b, g, groups, c);
        decode_group(fmt, cp + (b * groups + g) * bytes, dp + at, mp ? mp + at : nullptr, c, v);
        T* out = wp + (b * kCols + c) * k + g * kGroup;
        for (int64_t j = 0; j < kGroup; ++j) out[j] = static_cast<T>(v[j]);
      }
    }
}

template <typename T>
void dequantize_into(const uint8_t* cp, const at::Half* dp, const at::Half* mp, T* wp, int64_t format, int64_t n,
                     int64_t groups) {
  at::parallel_for(0, (n + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    if (format > kQ8_0)
      dequantize_qx(static_cast<int>(format), cp, reinterpret_cast<const uint16_t*>(dp),
                    reinterpret_cast<const uint16_t*>(mp), wp, n, groups, begin, end);
    else if (format == kQ4_0) dequantize_blocks<kQ4_0>(cp, dp, mp, wp, n, groups, begin, end);
    else if (format == kQ4_1) dequantize_blocks<kQ4_1>(cp, dp, mp, wp, n, groups, begin, end);
    else dequantize_blocks<kQ8_0>(cp, dp, mp, wp, n, groups, begin, end);
  });
}

// The [N, K] matrix the codes stand for, exactly in fp32 (w = d q, d (q - 8), d q + m, or a
// K-quant's (d sc) q - (dmin mn); see packed_layout.h), then
// rounded once to `dtype`: the dense path for steps past the kernel's rows.
at::Tensor packed_dequantize(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                             int64_t format, int64_t n, at::ScalarType dtype) {
  const int64_t k = codes.size(1) * kGroup;
  check_weights(codes, scales, offsets, format, k);
  const int64_t groups = codes.size(1);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* dp = scales.data_ptr<at::Half>();
  const at::Half* mp = offsets ? offsets->data_ptr<at::Half>() : nullptr;
  const at::ScalarType direct = dtype == at::kBFloat16 || dtype == at::kHalf ? dtype : at::kFloat;
  at::Tensor w = at::empty({n, k}, codes.options().dtype(direct));
  if (direct == at::kBFloat16) {
    dequantize_into(cp, dp, mp, w.data_ptr<at::BFloat16>(), format, n, groups);
  } else if (direct == at::kHalf) {
    dequantize_into(cp, dp, mp, w.data_ptr<at::Half>(), format, n, groups);
  } else {
    dequantize_into(cp, dp, mp, w.data_ptr<float>(), format, n, groups);
  }
  return direct == dtype ? w : w.to(dtype);
}

// Rows `ids` of the matrix (the embedding lookup of a model whose tied head is packed), each
// weight exactly its fp32 value, then rounded once to `dtype`: no dense table is kept.
at::Tensor packed_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& offsets, int64_t format, int64_t n, at::ScalarType dtype) {
  const int64_t groups = codes.size(1), k = groups * kGroup;
  check_weights(codes, scales, offsets, format, k);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t t = idx.numel(), bytes = group_bytes(static_cast<int>(format));
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "packed_rows: id ", ip[r], " out of range");
  at::Tensor out = at::empty({t, k}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* mp = offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = ip[r] / kCols, c = ip[r] % kCols;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = scale_index(static_cast<int>(format), b, g, groups, c);
        decode_group(static_cast<int>(format), cp + (b * groups + g) * bytes, dp + at, mp ? mp + at : nullptr, c,
                     op + r * k + g * kGroup);
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("packed_rows(Tensor ids, Tensor codes, Tensor scales, Tensor? offsets, int format, int n, ScalarType dtype) -> Tensor");
  m.impl("packed_rows", c10::DispatchKey::CPU, &packed_rows);
  m.def("packed_codes(Tensor codes, int bits) -> Tensor");
  m.def("packed_dequantize(Tensor codes, Tensor scales, Tensor? offsets, int format, int n, ScalarType dtype) -> Tensor");
  m.impl("packed_codes", c10::DispatchKey::CPU, &packed_codes);
  m.impl("packed_dequantize", c10::DispatchKey::CPU, &packed_dequantize);
}
