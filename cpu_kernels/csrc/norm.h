// RMSNorm rows as the reference models compute them: y = w * dtype(x * rsqrt(mean(x^2) + eps)), the mean
// over fp32 values.
#pragma once

#include <cstdint>

namespace hybridd {

struct RmsNorm {
  const void* x = nullptr;       // [rows, dim]
  void* out = nullptr;           // [rows, dim]
  const void* weight = nullptr;  // [dim]
  int64_t rows = 0, dim = 0;
  float eps = 0.0f;
  bool f32 = false;  // every tensor is fp32 (else bf16)
};

// Normalizes rows [r0, r1).
void rms_norm_rows(const RmsNorm& n, int64_t r0, int64_t r1);

}  // namespace hybridd
