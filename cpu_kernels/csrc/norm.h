// RMSNorm rows as the reference models compute them: y = w * dtype(x * rsqrt(mean(x^2) + eps)), the mean
// over fp32 values.
#pragma once

#include <cstdint>

namespace hybridd {

struct RmsNorm {
  // [tokens, heads, dim] with rows = tokens * heads: row i at x + (i / heads) * token_stride + (i % heads) * dim
  // elements (a token's heads contiguous; tokens may be strided, as q / k columns of a fused projection are)
  const void* x = nullptr;
  int64_t heads = 1, token_stride = 0;
  void* out = nullptr;           // [rows, dim], contiguous
  const void* weight = nullptr;  // [dim]
  int64_t rows = 0, dim = 0;
  float eps = 0.0f;
  bool f32 = false;  // every tensor is fp32 (else bf16)
};

// Normalizes rows [r0, r1).
void rms_norm_rows(const RmsNorm& n, int64_t r0, int64_t r1);

}  // namespace hybridd
