// The packed matmul's weight layout, shared by the matmul (packed_linear.cpp) and the ops that
// build and decode it (packed_layout.cpp).
//
// Layout, per block of 16 output columns and per group of 32 inputs (`packed_codes` and
// `gguf_pack` build it); a group's bytes are contiguous, so the matmul streams them in order.
// A run is 4 consecutive inputs (run p: inputs 4p..4p+3); a lane chunk is 64 bytes, byte 4c+e
// standing for column c and input e of a run, so a vector of 32-bit lanes holds every column's
// four codes of a run in input order, as the byte multiply-adds take them. The bits of a code
// sit at the same byte in every plane: one load, one 16-bit shift and one mask give a run's
// nibbles or high bits for 8 or 16 columns (a shift within 16-bit lanes never carries a
// neighbour byte's bits into the masked ones).
// - 4-bit codes: 256 bytes, 4 lane chunks; chunk q holds run 2q in its low nibbles and run 2q+1
//   in its high ones.
// - 5- and 6-bit codes: the low 4 bits as above, then the high bits. 5 bits: one lane chunk, bit p
//   of byte 4c+e the fifth bit of run p (64 bytes). 6 bits: two lane chunks, chunk j's byte 4c+e
//   holding the top two bits of run 4j+i in bits 2i, 2i+1 (128 bytes).
// - K-quants then carry their 6- or 8-bit sub-block scales as stored: Q4_K / Q5_K 16 bytes of
//   scales (one per column) and 16 of mins; Q6_K 16 int8 scales for inputs 0..15, 16 for 16..31.
// - 8-bit codes: 512 bytes, 16 runs of 32; in run p, byte 2c+e is column c's code for input 2p+e.
// - scales (and offsets): [blocks, groups, 16] fp16, the file's own d (and m); for K-quants
//   [blocks, groups / 8, 16], the super-block's d (and dmin), one per 256 inputs.
// A weight is d (q - center) + m (legacy formats; center 8 for Q4_0, 16 for Q5_0, m = 0 without
// offsets), d sc q - dmin mn (Q4_K, Q5_K) or d sc (q - 32) (Q6_K, sc per 16 inputs).
// `code_at` and `put_code` below are the layout's one definition for the scalar code.
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
constexpr int64_t kLaneBytes = 4 * kCols;  // one run's codes of every column: a lane chunk

// Where input j of column `col` keeps its code in a group's bytes: the byte of its low 4 bits and
// their shift, the byte of its high bits (5 and 6 bits) and theirs; 8-bit codes are whole bytes.
struct CodeBits {
  int64_t low_byte;
  int low_shift;
  int64_t high_byte;
  int high_shift;
};
constexpr CodeBits code_bits_at(int f, int64_t j, int64_t col) {
  if (f == kQ8_0) return {(j / 2) * 2 * kCols + 2 * col + j % 2, 0, 0, 0};
  const int64_t run = j / 4, lane = 4 * col + j % 4;
  const int64_t high = code_bits(f) == 6 ? kBytes4 + (run / 4) * kLaneBytes + lane : kBytes4 + lane;
  return {(run / 2) * kLaneBytes + lane, 4 * static_cast<int>(run % 2), high,
          code_bits(f) == 6 ? 2 * static_cast<int>(run % 4) : static_cast<int>(run)};
}
// Column `col`'s code for input j (unsigned; Q8_0's int8 code as its byte).
inline int code_at(int f, const uint8_t* group, int64_t j, int64_t col) {
  const CodeBits at = code_bits_at(f, j, col);
  if (f == kQ8_0) return group[at.low_byte];
  int q = (group[at.low_byte] >> at.low_shift) & 0x0F;
  if (code_bits(f) > 4) q |= ((group[at.high_byte] >> at.high_shift) & ((1 << (code_bits(f) - 4)) - 1)) << 4;
  return q;
}
// Writes it into a group's bytes, zero where nothing was written yet.
inline void put_code(int f, uint8_t* group, int64_t j, int64_t col, int q) {
  const CodeBits at = code_bits_at(f, j, col);
  if (f == kQ8_0) {
    group[at.low_byte] = static_cast<uint8_t>(q);
    return;
  }
  group[at.low_byte] |= static_cast<uint8_t>((q & 0x0F) << at.low_shift);
  if (code_bits(f) > 4) group[at.high_byte] |= static_cast<uint8_t>((q >> 4) << at.high_shift);
}

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
