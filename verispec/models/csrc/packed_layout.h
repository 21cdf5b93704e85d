// The packed matmul's weight layout, shared by the matmul (packed_linear.cpp) and the ops that
// build and decode it (packed_layout.cpp).
//
// Layout, per block of 16 output columns and per group of 32 inputs (`packed_codes` and
// `gguf_pack` build it); a group's bytes are contiguous, so the matmul streams them in order:
// - 4-bit codes: 256 bytes, 8 runs of 32. In run p, byte 2c+e holds column c's code for input 4p+e
//   in its low nibble and 4p+2+e in its high one: zero-extending the run to 16-bit lanes gives
//   input pair (4p, 4p+1) of every column, a shift by 4 the pair (4p+2, 4p+3).
// - 5- and 6-bit codes: the low 4 bits as above, then the high bits. 5 bits: 4 chunks of 16 bytes,
//   chunk j's byte c holding column c's fifth bits of run 2j (bit i: input 8j+i) in its low nibble
//   and of run 2j+1 in its high one (64 bytes). 6 bits: 8 chunks of 16 bytes, chunk p's byte c
//   holding column c's top two bits of inputs 4p..4p+3 (bits 2i, 2i+1: input 4p+i) (128 bytes).
// - K-quants then carry their 6- or 8-bit sub-block scales as stored: Q4_K / Q5_K 16 bytes of
//   scales (one per column) and 16 of mins; Q6_K 16 int8 scales for inputs 0..15, 16 for 16..31.
// - 8-bit codes: 512 bytes, 16 runs of 32; in run p, byte 2c+e is column c's code for input 2p+e.
// - scales (and offsets): [blocks, groups, 16] fp16, the file's own d (and m); for K-quants
//   [blocks, groups / 8, 16], the super-block's d (and dmin), one per 256 inputs.
// A weight is d (q - center) + m (legacy formats; center 8 for Q4_0, 16 for Q5_0, m = 0 without
// offsets), d sc q - dmin mn (Q4_K, Q5_K) or d sc (q - 32) (Q6_K, sc per 16 inputs).
#pragma once

#include <cstdint>

#ifndef VS_PACKED_NO_ATEN  // the tiles' own sources do without ATen's headers (a third of a build's time)
#include <ATen/ATen.h>
#endif

namespace {

constexpr int64_t kCols = 16;   // output columns per block
constexpr int64_t kGroup = 32;  // inputs per quantization block
constexpr int64_t kBytes4 = kCols * kGroup / 2, kBytes8 = kCols * kGroup;
constexpr int64_t kSuperGroups = 8;  // groups of 32 per K-quant super-block of 256
// The formats, as the ops' `format` argument (models/linear.py: PACKED_FORMATS).
constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7;
constexpr int kFormats = 8;

constexpr int code_bits(int f) {
  return f == kQ8_0 ? 8 : f == kQ6_K ? 6 : (f == kQ5_0 || f == kQ5_1 || f == kQ5_K) ? 5 : 4;
}
constexpr bool is_kquant(int f) { return f == kQ4_K || f == kQ5_K || f == kQ6_K; }
constexpr int center(int f) { return f == kQ4_0 ? 8 : f == kQ5_0 ? 16 : f == kQ6_K ? 32 : 0; }
// Whether `offsets` is given: Q4_1 / Q5_1's m per group, Q4_K / Q5_K's dmin per super-block.
constexpr bool has_offsets(int f) { return f == kQ4_1 || f == kQ5_1 || f == kQ4_K || f == kQ5_K; }
constexpr int64_t high_bytes(int f) { return code_bits(f) == 5 ? 64 : code_bits(f) == 6 ? 128 : 0; }
constexpr int64_t sub_bytes(int f) { return is_kquant(f) ? 2 * kCols : 0; }
constexpr int64_t group_bytes(int f) { return f == kQ8_0 ? kBytes8 : kBytes4 + high_bytes(f) + sub_bytes(f); }

#ifndef VS_PACKED_NO_ATEN
inline void check_weights(const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& offsets, int64_t format, int64_t k) {
  TORCH_CHECK(format >= 0 && format < kFormats, "packed_linear: format must be 0..", kFormats - 1);
  const int64_t bytes = group_bytes(static_cast<int>(format)), groups = k / kGroup;
  const bool kq = is_kquant(static_cast<int>(format));
  TORCH_CHECK(codes.dim() == 3 && codes.size(1) == groups && codes.size(2) == bytes &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "packed_linear: codes must be uint8 [N/16, K/32, ", bytes, "] for K = ", k);
  TORCH_CHECK(!kq || groups % kSuperGroups == 0, "packed_linear: K-quants need K a multiple of 256");
  const int64_t per = kq ? groups / kSuperGroups : groups;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == per &&
                  scales.size(2) == kCols && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "packed_linear: scales must be float16 [N/16, ", kq ? "K/256" : "K/32", ", 16]");
  TORCH_CHECK(offsets.has_value() == has_offsets(static_cast<int>(format)),
              "packed_linear: offsets are given for Q4_1, Q5_1, Q4_K and Q5_K only");
  if (offsets)
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kHalf && offsets->is_contiguous(),
                "packed_linear: offsets must match scales");
}

#endif

}  // namespace
