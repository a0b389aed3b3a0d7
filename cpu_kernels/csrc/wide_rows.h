// The activation rows the avx512 and avx2 paths widen once per block of rows and tile range into a per-thread
// buffer: fp32 for bf16 and fp8 tiles (each path in its own order), int16 for int8.
#pragma once

#include "moe.h"
#include "row_ops.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace hybridd {

struct WideRows {
  std::vector<float> f32;
  std::vector<int16_t> i16;
  int64_t f32_row = 0;  // floats per row of f32
  bool scaled = false;  // the avx2 path's fp8 rows: multiplied by 2^96
};

// Bytes of one widened row of format f with kp columns; 0 where the kernels read the rows as they are (int4).
inline int64_t widened_row_bytes(Format f, int64_t kp) {
  if (f == Format::kFP8) return 2 * kp * int64_t(sizeof(float));
  if (f == Format::kBF16) return kp * int64_t(sizeof(float));
  if (f == Format::kINT8) return kp * int64_t(sizeof(int16_t));
  return 0;
}

// Rows of format f widened at a time so that their copies, about `budget` bytes, stay in L2 while every tile of
// a range meets them: at least `least`, at most 48, all n where the format widens nothing.
inline int wide_row_block(Format f, int64_t kp, int n, int64_t budget, int least) {
  const int64_t row_bytes = widened_row_bytes(f, kp);
  if (row_bytes == 0) return n;  // nothing widened: no reason to go over the tiles more than once
  return static_cast<int>(std::clamp<int64_t>(budget / row_bytes, least, 48));
}

// wide.i16[i * kp + k] = u8 activation k of row rows[i] (a.kp % 16 == 0).
AVX2_TARGET inline void widen_u8_rows(const Act& a, const int* rows, int n, WideRows& wide) {
  const int64_t kp = a.kp;
  wide.i16.resize(size_t(n) * kp);
  int16_t* dst = wide.i16.data();
  for (int i = 0; i < n; ++i) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.q) + int64_t(rows[i]) * kp;
    for (int64_t k = 0; k < kp; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * kp + k),
                          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))));
  }
}

// Rows rows[0..n) of a widened into wide: int8 by widen_u8_rows, fp8 (2 * kp floats a row) by the path's own
// row function, called as fp8_row(src, kp, dst), and bf16 (kp floats) by to_f32 on the path's isa. The
// buffers' starts are taken once: a thread-local buffer's element addresses cost a lookup each inside a loop.
template <typename Fp8Row>
inline void widen_rows(Format f, Isa isa, const Act& a, const int* rows, int n, WideRows& wide, Fp8Row fp8_row) {
  if (f == Format::kINT8) return widen_u8_rows(a, rows, n, wide);
  if (f != Format::kFP8 && f != Format::kBF16) return;
  const int64_t per_row = widened_row_bytes(f, a.kp) / int64_t(sizeof(float));
  wide.f32.resize(size_t(n) * per_row);
  wide.f32_row = per_row;
  float* dst = wide.f32.data();
  for (int i = 0; i < n; ++i) {
    if (f == Format::kFP8) fp8_row(a.bf + int64_t(rows[i]) * a.kp, a.kp, dst + i * per_row);
    else to_f32(isa, a.bf + int64_t(rows[i]) * a.kp, false, a.kp, dst + i * per_row);
  }
}

}  // namespace hybridd
