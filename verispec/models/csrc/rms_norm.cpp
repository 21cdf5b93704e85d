// RMSNorm of fp32, bf16 or fp16 rows for the CPU, in one fixed order of arithmetic:
//   y = weight * half(x * 1 / sqrt(mean(x^2) + eps)),
// normalised in fp32 and rounded once before the scale (no rounding for fp32), as the reference
// implementation does.
//
// Why an op of its own: the compiled layer stack and the eager one must give a row the same bits
// (a verify step too long for the graph runs eager, the same request's decode steps compiled), and
// Inductor's fused reduction sums the squares in another order than ATen's, which rounds a row
// differently now and then. Here the squares go into 16 fp32 lanes in order (a bf16 or fp16 square
// is exact in fp32, so a fused multiply-add changes nothing) and the lanes are summed pairwise in
// a fixed tree: the same bits at every instruction-set level, in every path and for every row
// (for fp32 the squares round, so the bits are fixed per build: every path of one machine).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;

template <typename T>
float sum_of_squares(const T* x, int64_t d) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      acc[l] += v * v;
    }
  }
  for (int64_t l = 0; i + l < d; ++l) {
    const float v = static_cast<float>(x[i + l]);
    acc[l] += v * v;
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

template <typename T>
void normalize_rows(const T* x, const T* w, T* y, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      const float inv = 1.0f / std::sqrt(sum_of_squares(xr, d) / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        const T normed = static_cast<T>(static_cast<float>(xr[i]) * inv);  // the one rounding before the scale
        yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must have x's last dimension");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                   x.scalar_type() == at::kHalf),
              "rms_norm: x and weight must both be float32, bfloat16 or float16");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    normalize_rows(xc.const_data_ptr<scalar_t>(), wc.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
                   rows, d, static_cast<float>(eps));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
}
