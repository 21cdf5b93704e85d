// A GGUF file's quantized rows, put straight into the packed matmul's layout (packed_layout.h):
// `gguf_pack(raw, format, k)` reads each row's blocks as the file stores them (ggml's block_q4_0,
// q4_1, q8_0, q5_0, q5_1, q4_K, q5_K, q6_K) and writes its codes, high bits, sub-block scales and
// fp16 scales where the kernel reads them. Nothing is widened: the result is about the file's size,
// and no [N, K] array of codes is made on the way.
#include "packed_layout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kSuper = kSuperGroups * kGroup;

// ggml's block sizes (inputs) and bytes, by our format id.
constexpr int64_t block_inputs(int f) { return is_kquant(f) ? kSuper : kGroup; }
constexpr int64_t block_bytes(int f) {
  constexpr std::array<int64_t, kFormats> bytes = {18, 20, 34, 22, 24, 144, 176, 210};
  return bytes[f];
}

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One GGUF block, decoded without arithmetic: codes q (unsigned, int8 bits for Q8_0), its fp16
// scale bits (d, m / dmin) and, for K-quants, the sub-block scales sc (and mins mn).
struct Block {
  uint8_t q[kSuper];
  uint16_t d, m;
  uint8_t sc[16], mn[8];
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from their 12 packed bytes (ggml's layout).
inline void scale_min(int j, const uint8_t* s, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// long: one case per ggml block type, each a few lines of its layout, read side by side.
void decode_block(int f, const uint8_t* b, Block& out) {
  if (f == kQ8_0) {
    out.d = u16(b);
    std::memcpy(out.q, b + 2, kGroup);
  } else if (f == kQ4_0 || f == kQ4_1) {  // d, (m), 16 bytes: inputs j (low nibble) and j + 16 (high)
    const uint8_t* qs = b + (f == kQ4_1 ? 4 : 2);
    out.d = u16(b), out.m = f == kQ4_1 ? u16(b + 2) : 0;
    for (int j = 0; j < 16; ++j) out.q[j] = qs[j] & 0x0F, out.q[j + 16] = qs[j] >> 4;
  } else if (f == kQ5_0 || f == kQ5_1) {  // d, (m), 32 fifth bits, then nibbles as Q4_0
    const uint8_t* qh = b + (f == kQ5_1 ? 4 : 2);
    uint32_t high;
    std::memcpy(&high, qh, 4);
    out.d = u16(b), out.m = f == kQ5_1 ? u16(b + 2) : 0;
    for (int j = 0; j < 16; ++j) {
      out.q[j] = (qh[4 + j] & 0x0F) | (((high >> j) & 1) << 4);
      out.q[j + 16] = (qh[4 + j] >> 4) | (((high >> (j + 16)) & 1) << 4);
    }
  } else if (f == kQ4_K || f == kQ5_K) {  // d, dmin, 12 bytes of scales, (32 bytes of fifth bits), nibbles
    out.d = u16(b), out.m = u16(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (f == kQ5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles of bytes 32 (j / 2) .., low for even j
      scale_min(j, b + 4, out.sc[j], out.mn[j]);
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * (j / 2) + l];
        const int high = f == kQ5_K ? ((qh[l] >> j) & 1) << 4 : 0;
        out.q[32 * j + l] = static_cast<uint8_t>((j % 2 ? byte >> 4 : byte & 0x0F) | high);
      }
    }
  } else {  // Q6_K: 128 bytes of nibbles, 64 of top bits, 16 int8 scales (one per 16 inputs), d
    const uint8_t *ql = b, *qh = b + 128;
    out.d = u16(b + 208);
    std::memcpy(out.sc, b + 192, 16);
    for (int half = 0; half < 2; ++half)
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo0 = ql[64 * half + l], lo1 = ql[64 * half + l + 32], hi = qh[32 * half + l];
        uint8_t* q = out.q + 128 * half;
        q[l] = (lo0 & 0x0F) | ((hi & 3) << 4);
        q[l + 32] = (lo1 & 0x0F) | (((hi >> 2) & 3) << 4);
        q[l + 64] = (lo0 >> 4) | (((hi >> 4) & 3) << 4);
        q[l + 96] = (lo1 >> 4) | (((hi >> 6) & 3) << 4);
      }
  }
}

// Column `col`'s group of 32 codes into the group's bytes `dst` (packed_layout.h).
void write_group(int f, const uint8_t* q, int64_t col, uint8_t* dst) {
  for (int j = 0; j < kGroup; ++j) put_code(f, dst, j, col, q[j]);
}

std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>> gguf_pack(const at::Tensor& raw, int64_t format,
                                                                       int64_t k) {
  TORCH_CHECK(format >= 0 && format < kFormats, "gguf_pack: format must be 0..", kFormats - 1);
  const int f = static_cast<int>(format);
  const int64_t per_block = block_inputs(f);
  TORCH_CHECK(k > 0 && k % per_block == 0, "gguf_pack: rows of ", k, " inputs do not split into blocks of ", per_block);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.size(1) == k / per_block * block_bytes(f),
              "gguf_pack: raw must be uint8 [N, ", k / per_block * block_bytes(f), "]");
  const at::Tensor rc = raw.contiguous();
  const int64_t n = rc.size(0), groups = k / kGroup, blocks = (n + kCols - 1) / kCols, bytes = group_bytes(f);
  const int64_t per = is_kquant(f) ? groups / kSuperGroups : groups;
  at::Tensor codes = at::zeros({blocks, groups, bytes}, rc.options());
  at::Tensor scales = at::zeros({blocks, per, kCols}, rc.options().dtype(at::kHalf));
  c10::optional<at::Tensor> offsets;
  if (has_offsets(f)) offsets = at::zeros({blocks, per, kCols}, rc.options().dtype(at::kHalf));
  const uint8_t* src = rc.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  auto* dp = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  auto* mp = offsets ? reinterpret_cast<uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  const int64_t subs = kBytes4 + high_bytes(f), row_bytes = rc.size(1);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Block blk;
    for (int64_t row = begin * kCols; row < std::min(n, end * kCols); ++row) {
      const int64_t b = row / kCols, col = row % kCols;
      for (int64_t i = 0; i < k / per_block; ++i) {
        decode_block(f, src + row * row_bytes + i * block_bytes(f), blk);
        const int64_t at = (b * per + i) * kCols + col;  // a block is one scale entry (a group or a super-block)
        dp[at] = blk.d;
        if (mp) mp[at] = blk.m;
        for (int64_t s = 0; s < per_block / kGroup; ++s) {
          uint8_t* dst = cp + (b * groups + i * (per_block / kGroup) + s) * bytes;
          write_group(f, blk.q + s * kGroup, col, dst);
          if (f == kQ6_K) dst[subs + col] = blk.sc[2 * s], dst[subs + kCols + col] = blk.sc[2 * s + 1];
          else if (is_kquant(f)) dst[subs + col] = blk.sc[s], dst[subs + kCols + col] = blk.mn[s];
        }
      }
    }
  });
  return {codes, scales, offsets};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("gguf_pack(Tensor raw, int format, int k) -> (Tensor, Tensor, Tensor?)");
  m.impl("gguf_pack", c10::DispatchKey::CPU, &gguf_pack);
}
