// RMSNorm rows (norm.h). The loops are plain C++ over fixed lanes, which the compiler vectorizes for any x86-64.
#include "norm.h"

#include <algorithm>
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

void widen(const void* src, bool f32, int64_t n, float* dst) {
  if (f32) {
    const float* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

// The value as the tensor's dtype stores it, read back as fp32.
inline float rounded(float v, bool f32) { return f32 ? v : bf16_to_f32(f32_to_bf16(v)); }

void store(const float* src, bool f32, int64_t n, void* dst) {
  if (f32) {
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = src[i];
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

}  // namespace

void rms_norm_rows(const RmsNorm& n, int64_t r0, int64_t r1) {
  const int64_t d = n.dim, elem = n.f32 ? 4 : 2;
  thread_local std::vector<float> x, w;
  x.resize(d);
  w.resize(d);
  widen(n.weight, n.f32, d, w.data());
  for (int64_t i = r0; i < r1; ++i) {
    widen(static_cast<const uint8_t*>(n.x) + i * d * elem, n.f32, d, x.data());
    // torch: mean = sum / dim, then rsqrt(mean + eps) = 1 / sqrt(...), each rounded to fp32.
    const float inv = 1.0f / std::sqrt(sum_squares(x.data(), d) / static_cast<float>(d) + n.eps);
    for (int64_t j = 0; j < d; ++j) x[j] = w[j] * rounded(x[j] * inv, n.f32);
    store(x.data(), n.f32, d, static_cast<uint8_t*>(n.out) + i * d * elem);
  }
}

void MoeRunner::rms_norm(const RmsNorm& n) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int tasks = static_cast<int>(std::min<int64_t>(n.rows, 4 * num_threads()));
  run(tasks, n.rows * n.dim, [&](int t, int) { rms_norm_rows(n, n.rows * t / tasks, n.rows * (t + 1) / tasks); });
}

}  // namespace hybridd
