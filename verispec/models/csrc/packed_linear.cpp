// The fast tier's weight-only quantized matmul for the CPU: y = x @ W^T with W kept as the file's
// blocks (GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: 32 weights per block, fp16 scales; Q4_K, Q5_K, Q6_K:
// super-blocks of 256 with 6- or 8-bit sub-block scales), 4-bit codes two per byte, a fifth or
// sixth bit in planes beside them (the 5/6-bit and K-quant tiles: packed_tile_qx.h).
//
// One call reads each block of codes once for all its rows (up to kMaxRows per register tile),
// so a verify step of several rows costs little more than one row while the weights stream from
// memory. Activations are quantized per block of 32 (packed_activations.h): int8 with an int8
// residual in outlier blocks for 4-bit codes, int16 for 8-bit ones. Each block's dot product is an
// exact int32 sum of code x activation on the CPU's integer multiply-adds (4-bit: AVX512-VNNI /
// AVX-VNNI `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd`; 8-bit: `vpdpwssd`, else `vpmaddwd`). The
// sums become fp32 once per block, in the same order on every variant: a row's result does not
// depend on how many rows share the call, nor on the instruction set.
//
// The layout of the codes and scales: packed_layout.h (built by `packed_codes`).
#include "packed_activations.h"
#include "packed_layout.h"
#include "packed_tiles.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

// Rows per panel of a long call: every column block passes over one panel's activations (128 rows
// of K int8 values, under 200 KB) while they are in L2, rather than over all M rows from L3.
constexpr int64_t kPanelRows = 128;

#if defined(VS_X86)
// CPUID leaf 7: AVX512_VNNI is sub-leaf 0's ECX bit 11, AVX-VNNI sub-leaf 1's EAX bit 4. (The OS
// saves the registers they use: torch already runs this build's level here.)
bool cpuid7(unsigned sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1;
}
#endif  // VS_X86

bool always() { return true; }

struct Variant {
  const char* name;
  bool (*supported)();
  const TileTable& (*table)();
};

// Best first: the first one this CPU runs is the default.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
#if defined(CPU_CAPABILITY_AVX512) && defined(VS_X86)
#if defined(VS_AVX512_VNNI)
      {"avx512_vnni", [] { return cpuid7(0, 2, 11); }, vs::avx512_vnni_table},
#endif
      {"avx512", always, vs::avx512_table},
#endif
#if defined(VS_X86)
#if defined(VS_AVX2_VNNI)
      {"avx2_vnni", [] { return cpuid7(1, 0, 4); }, vs::avx2_vnni_table},
#endif
      {"avx2", always, vs::avx2_table},
#endif
      {"portable", always, vs::portable_table},
  };
  return v;
}

// CPUID traps to the hypervisor on a virtual machine (tens of microseconds): asked once.
const std::vector<const Variant*>& supported_variants() {
  static const std::vector<const Variant*> v = [] {
    std::vector<const Variant*> out;
    for (const Variant& var : variants())
      if (var.supported()) out.push_back(&var);
    return out;
  }();
  return v;
}

const TileTable& pick(c10::string_view name) {
  if (name.empty()) return supported_variants().front()->table();
  for (const Variant* v : supported_variants())
    if (name == v->name) return v->table();
  throw std::invalid_argument("packed_linear: no variant '" + std::string(name) + "' in this build for this CPU");
}

std::vector<std::string> packed_variants() {
  std::vector<std::string> names;
  for (const Variant* v : supported_variants()) names.emplace_back(v->name);
  return names;
}

template <typename T>
void store_tile(const float* tile, int64_t rows, int64_t cols, T* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = static_cast<T>(tile[r * kCols + c]);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& offsets, int64_t format, int64_t n,
                         c10::string_view variant) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0, "packed_linear: x must be [M, K] with K a multiple of 32");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  check_weights(codes, scales, offsets, format, k);
  const int64_t blocks = codes.size(0);
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "packed_linear: n does not match the codes");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "packed_linear: x must be float32, bfloat16 or float16");
  const TileTable& table = pick(variant);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.contiguous();
  ActBuffers buffers;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "packed_linear", [&] {
    if (format == kQ8_0)
      quantize_int16(xc.data_ptr<scalar_t>(), m, k, buffers);
    else
      quantize_int8(xc.data_ptr<scalar_t>(), m, k, buffers);
  });
  const Act act = buffers.act(m, groups);
  const Packed w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                 offsets ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr};
  const auto& fns = table.fn[format];
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "packed_linear_out", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      alignas(64) float tile[kMaxRows * kCols];
      for (int64_t p0 = 0; p0 < m; p0 += kPanelRows) {
        const int64_t p1 = std::min(m, p0 + kPanelRows);
        for (int64_t b = begin; b < end; ++b) {
          const int64_t cols = std::min(kCols, n - b * kCols);
          for (int64_t r0 = p0; r0 < p1; r0 += table.rows) {
            const int64_t rows = std::min<int64_t>(table.rows, p1 - r0);
            fns[rows - 1](w, b, act, r0, tile);
            store_tile(tile, rows, cols, yp + r0 * n + b * kCols, n);
          }
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int format, int n, str variant=\"\") -> Tensor");
  m.def("packed_variants() -> str[]");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.impl("packed_variants", c10::DispatchKey::CompositeExplicitAutograd, &packed_variants);
}
