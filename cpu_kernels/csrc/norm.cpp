// RMSNorm rows (norm.h). The loops are plain C++ over fixed lanes, which the compiler vectorizes for any x86-64.
#include "norm.h"

#include <cmath>
#include <vector>

#include "moe.h"
#include "simd_math.h"

namespace hybridd {
namespace {

constexpr int kLanes = 16;

// Sum of squares over kLanes independent partial sums, folded pairwise (an order close to torch's vectorized
// reduction; exact equality with it is not promised, only fp32 accuracy).
float sum_squares(const float* v, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += v[i + l] * v[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += v[i] * v[i];
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

template <typename T>
void normalize(const RmsNorm& n, int64_t r0, int64_t r1) {
  const int64_t d = n.dim;
  thread_local std::vector<float> x, w;
  x.resize(d);
  w.resize(d);
  for (int64_t j = 0; j < d; ++j) w[j] = element_f32(static_cast<const T*>(n.weight)[j]);
  for (int64_t i = r0; i < r1; ++i) {
    const T* src = static_cast<const T*>(n.x) + (i / n.heads) * n.token_stride + (i % n.heads) * d;
    for (int64_t j = 0; j < d; ++j) x[j] = element_f32(src[j]);
    // torch: mean = sum / dim, then rsqrt(mean + eps) = 1 / sqrt(...), each rounded to fp32.
    const float inv = 1.0f / std::sqrt(sum_squares(x.data(), d) / static_cast<float>(d) + n.eps);
    T* dst = static_cast<T*>(n.out) + i * d;
    for (int64_t j = 0; j < d; ++j) dst[j] = element_from_f32<T>(w[j] * stored_as<T>(x[j] * inv));
  }
}

}  // namespace

void rms_norm_rows(const RmsNorm& n, int64_t r0, int64_t r1) {
  if (n.f32) normalize<float>(n, r0, r1);
  else normalize<uint16_t>(n, r0, r1);
}

void MoeRunner::rms_norm(const RmsNorm& n) {
  run_rows(n.rows, n.dim, [&](int64_t r0, int64_t r1) { rms_norm_rows(n, r0, r1); });
}

}  // namespace hybridd
