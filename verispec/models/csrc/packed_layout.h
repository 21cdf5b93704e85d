// The packed matmul's weight layout, shared by the matmul (packed_linear.cpp) and the ops that
// build and decode it (packed_layout.cpp).
//
// Layout, per block of 16 output columns and per group of 32 inputs (`packed_codes` builds it):
// - 4 bits: 256 bytes, 8 runs of 32. In run p, byte 2c+e holds column c's code for input 4p+e
//   in its low nibble and 4p+2+e in its high one: zero-extending the run to 16-bit lanes gives
//   input pair (4p, 4p+1) of every column, a shift by 4 the pair (4p+2, 4p+3).
// - 8 bits: 512 bytes, 16 runs of 32; in run p, byte 2c+e is column c's code for input 2p+e.
// - scales (and Q4_1's offsets): [blocks, groups, 16] fp16, the file's own values.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int64_t kCols = 16;   // output columns per block
constexpr int64_t kGroup = 32;  // inputs per quantization block
constexpr int64_t kBytes4 = kCols * kGroup / 2, kBytes8 = kCols * kGroup;
constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2;  // the formats, as the ops' `format` argument

inline void check_weights(const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& offsets, int64_t format, int64_t k) {
  TORCH_CHECK(format == kQ4_0 || format == kQ4_1 || format == kQ8_0, "packed_linear: format must be 0, 1 or 2");
  const int64_t bytes = format == kQ8_0 ? kBytes8 : kBytes4;
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == k / kGroup && codes.size(2) == bytes &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "packed_linear: codes must be uint8 [N/16, K/32, ", bytes, "] for K = ", k);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == kCols && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "packed_linear: scales must be float16 [N/16, K/32, 16]");
  TORCH_CHECK(offsets.has_value() == (format == kQ4_1), "packed_linear: offsets are given for Q4_1 only");
  if (offsets)
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kHalf && offsets->is_contiguous(),
                "packed_linear: offsets must match scales");
}

}  // namespace
