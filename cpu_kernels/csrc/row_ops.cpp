// Row conversions around the dot kernels (row_ops.h): portable loops, AVX-512 and avx2 versions of each.
#include "row_ops.h"

#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace hybridd {

namespace {

// ---------------------------------------------------------------------------------------------------------
// Portable loops: the generic path, and the tails the vector loops leave.

void to_f32_generic(const void* src, bool f32, int n, float* dst) {
  for (int i = 0; i < n; ++i)
    dst[i] = f32 ? static_cast<const float*>(src)[i] : bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
}

void split_bf16_generic(const float* v, int n, uint16_t* hi, uint16_t* lo) {
  for (int i = 0; i < n; ++i) {
    hi[i] = f32_to_bf16(v[i]);
    if (lo) lo[i] = f32_to_bf16(v[i] - bf16_to_f32(hi[i]));
  }
}

void put_generic(const float* hi, const float* lo, int n, float scale, bool f32, void* dst) {
  for (int i = 0; i < n; ++i) {
    const float v = (lo ? hi[i] + lo[i] : hi[i]) * scale;
    if (f32) static_cast<float*>(dst)[i] = v;
    else static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
  }
}

// Elements [i0, n) of axpy_tiles.
void axpy_tiles_generic(float w, const float* hi, const float* lo, size_t stride, int i0, int n, float* acc) {
  for (int i = i0; i < n; ++i) {
    const size_t at = i / kRows * stride + i % kRows;
    acc[i] += w * (lo ? hi[at] + lo[at] : hi[at]);
  }
}

void silu_mul_generic(const float* g, const float* u, float* out) {
  for (int c = 0; c < kRows; ++c) out[c] = g[c] / (1.0f + std::exp(-g[c])) * u[c];
}

void sigmoid_generic(const float* x, float* out) {
  for (int c = 0; c < kRows; ++c) out[c] = 1.0f / (1.0f + std::exp(-x[c]));
}

void quantize_row_generic(const float* v, int k, int kp, Format f, int group, int8_t* q, float* scale,
                          int32_t* gsum) {
  float amax = 0.0f;
  for (int i = 0; i < k; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  const float inv = 1.0f / s;
  for (int i = 0; i < kp; ++i) {
    const int x = i < k ? static_cast<int>(std::nearbyint(std::clamp(v[i] * inv, -127.0f, 127.0f))) : 0;
    q[i] = static_cast<int8_t>(f == Format::kINT8 ? (x + 128) : x);
  }
  *scale = s;
  if (f == Format::kINT4) {
    for (int g = 0; g < kp / group; ++g) {
      int32_t sum = 0;
      for (int i = g * group; i < (g + 1) * group; ++i) sum += q[i];
      gsum[g] = sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512: 16 lanes with masked tails, the portable loops' bits. Rounding to bf16 is integer arithmetic, not
// vcvtneps2bf16, which flushes subnormal inputs and results to zero (seen on an Emerald Rapids Xeon).

AVX512F_TARGET inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// f32_to_bf16 of 16 lanes: round to nearest even, NaN kept quiet.
AVX512F_TARGET inline __m256i round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), top = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, quiet));
}

AVX512F_TARGET void to_f32_avx512(const void* src, bool f32, int n, float* dst) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 v = f32 ? _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + i)
                         : widen_bf16(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + i));
    _mm512_mask_storeu_ps(dst + i, m, v);
  }
}

AVX512F_TARGET void split_bf16_avx512(const float* v, int n, uint16_t* hi, uint16_t* lo) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
    const __m256i h = round_bf16x16(x);
    _mm256_mask_storeu_epi16(hi + i, m, h);
    if (lo) _mm256_mask_storeu_epi16(lo + i, m, round_bf16x16(_mm512_sub_ps(x, widen_bf16(h))));
  }
}

AVX512F_TARGET void put_avx512(const float* hi, const float* lo, int n, float scale, bool f32, void* dst) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    __m512 v = _mm512_maskz_loadu_ps(m, hi + i);
    if (lo) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, lo + i));
    if (scale != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
    if (f32) _mm512_mask_storeu_ps(static_cast<float*>(dst) + i, m, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + i, m, round_bf16x16(v));
  }
}

AVX512F_TARGET void put_tile_avx512(const float* y, int R, int rows, int cols, bool f32, void* dst, size_t stride) {
  const __mmask16 m = first(cols);
  for (int t = 0; t < rows; ++t) {
    const float* src = y + size_t(t) * R * kRows;
    __m512 v = _mm512_loadu_ps(src);
    if (R == 2) v = _mm512_add_ps(v, _mm512_loadu_ps(src + kRows));
    if (f32) _mm512_mask_storeu_ps(static_cast<float*>(dst) + t * stride, m, v);
    else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + t * stride, m, round_bf16x16(v));
  }
}

// A separate multiply and add, as in the portable loop.
AVX512F_TARGET void axpy_tiles_avx512(float w, const float* hi, const float* lo, size_t stride, int n, float* acc) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int i = 0; i < n; i += kRows) {
    const __mmask16 m = first(n - i);
    const size_t at = i / kRows * stride;
    __m512 y = _mm512_maskz_loadu_ps(m, hi + at);
    if (lo) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, lo + at));
    _mm512_mask_storeu_ps(acc + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + i), _mm512_mul_ps(wv, y)));
  }
}

AVX512F_TARGET void sigmoid_avx512(const float* x, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 den = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x))));
  _mm512_storeu_ps(out, _mm512_div_ps(one, den));
}

AVX512F_TARGET void silu_mul_avx512(const float* g, const float* u, float* out) {
  const __m512 gv = _mm512_loadu_ps(g);
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
  _mm512_storeu_ps(out, _mm512_div_ps(_mm512_mul_ps(gv, _mm512_loadu_ps(u)), den));
}

// The generic arithmetic 16 lanes at a time (cvtps rounds to nearest even like nearbyint); kp % 16 == 0.
AVX512F_TARGET void quantize_row_avx512(const float* v, int k, int kp, Format f, int group, int8_t* q, float* scale,
                                       int32_t* gsum) {
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < k; i += 16) amax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(first(k - i), v + i)), amax);
  const float a = _mm512_reduce_max_ps(amax);
  const float s = a > 0.0f ? a / 127.0f : 1.0f;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
  int32_t run = 0;
  for (int i = 0; i < kp; i += 16) {
    const __mmask16 m = i >= k ? __mmask16(0) : first(k - i);
    const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, v + i), inv), lo), hi);
    const __m512i xi = _mm512_cvtps_epi32(x);
    __m128i b = _mm512_cvtsepi32_epi8(xi);
    if (f == Format::kINT8) b = _mm_xor_si128(b, bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
    if (f == Format::kINT4) {
      run += _mm512_reduce_add_epi32(xi);
      if ((i + 16) % group == 0) {
        gsum[(i + 16) / group - 1] = run;
        run = 0;
      }
    }
  }
  *scale = s;
}

// ---------------------------------------------------------------------------------------------------------
// avx2: 8 lanes, the tails left to the portable loops.

// f32_to_bf16 of 8 lanes: round to nearest even, NaN kept quiet.
AVX2_TARGET inline __m128i round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2_TARGET inline void store_bf16x8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16x8(v));
}

AVX2_TARGET void to_f32_avx2(const void* src, bool f32, int n, float* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = f32 ? _mm256_loadu_ps(static_cast<const float*>(src) + i)
                         : widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i)));
    _mm256_storeu_ps(dst + i, v);
  }
  to_f32_generic(static_cast<const uint8_t*>(src) + size_t(i) * (f32 ? 4 : 2), f32, n - i, dst + i);
}

AVX2_TARGET void split_bf16_avx2(const float* v, int n, uint16_t* hi, uint16_t* lo) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    const __m128i h = round_bf16x8(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), h);
    if (lo) store_bf16x8(lo + i, _mm256_sub_ps(x, widen_bf16(h)));
  }
  split_bf16_generic(v + i, n - i, hi + i, lo ? lo + i : nullptr);
}

AVX2_TARGET void put_avx2(const float* hi, const float* lo, int n, float scale, bool f32, void* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(hi + i);
    if (lo) v = _mm256_add_ps(v, _mm256_loadu_ps(lo + i));
    v = _mm256_mul_ps(v, _mm256_set1_ps(scale));
    if (f32) _mm256_storeu_ps(static_cast<float*>(dst) + i, v);
    else store_bf16x8(static_cast<uint16_t*>(dst) + i, v);
  }
  put_generic(hi + i, lo ? lo + i : nullptr, n - i, scale, f32, static_cast<uint8_t*>(dst) + size_t(i) * (f32 ? 4 : 2));
}

// A separate multiply and add, as in the portable loop (no contraction: setup.py): the same bits.
AVX2_TARGET void axpy_tiles_avx2(float w, const float* hi, const float* lo, size_t stride, int n, float* acc) {
  const __m256 wv = _mm256_set1_ps(w);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const size_t at = i / kRows * stride + i % kRows;
    __m256 y = _mm256_loadu_ps(hi + at);
    if (lo) y = _mm256_add_ps(y, _mm256_loadu_ps(lo + at));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(wv, y)));
  }
  axpy_tiles_generic(w, hi, lo, stride, i, n, acc);
}

AVX2_TARGET void sigmoid_avx2(const float* x, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int c = 0; c < kRows; c += 8) {
    const __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(x + c))));
    _mm256_storeu_ps(out + c, _mm256_div_ps(one, den));
  }
}

AVX2_TARGET void silu_mul_avx2(const float* g, const float* u, float* out) {
  for (int c = 0; c < kRows; c += 8) {
    const __m256 gv = _mm256_loadu_ps(g + c);
    const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + c, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + c)), den));
  }
}

// 16 int32 lanes (a, b) to 16 int8 in order, saturating (the values are within [-127, 127]).
AVX2_TARGET inline __m128i narrow_i8x16(__m256i a, __m256i b) {
  const __m256i w = _mm256_packs_epi32(a, b);  // a0-3 b0-3 | a4-7 b4-7
  const __m256i bytes = _mm256_packs_epi16(w, w);  // a0-3 b0-3 (twice) | a4-7 b4-7 (twice), 4 bytes each
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
}

AVX2_TARGET inline int32_t sum_i32x8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// v[at..at + 8) times inv, clamped to [-127, 127] and rounded to int32 (zero past k).
AVX2_TARGET inline __m256i codes_i32x8(const float* v, int k, int at, __m256 inv) {
  alignas(32) float tail[8] = {};
  const float* src = v + at;
  if (at + 8 > k) {
    std::copy(v + std::min(at, k), v + k, tail);
    src = tail;
  }
  const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src), inv);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
}

// The generic arithmetic 8 lanes at a time (cvtps rounds to nearest even like nearbyint); kp % 16 == 0 and
// group % 16 == 0.
AVX2_TARGET void quantize_row_avx2(const float* v, int k, int kp, Format f, int group, int8_t* q, float* scale,
                                  int32_t* gsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= k; i += 8) amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask), amax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float a = 0.0f;
  for (float l : lanes) a = std::max(a, l);
  for (; i < k; ++i) a = std::max(a, std::fabs(v[i]));
  const float s = a > 0.0f ? a / 127.0f : 1.0f;
  const __m256 inv = _mm256_set1_ps(1.0f / s);
  __m256i run = _mm256_setzero_si256();
  for (i = 0; i < kp; i += 16) {
    const __m256i x0 = codes_i32x8(v, k, i, inv), x1 = codes_i32x8(v, k, i + 8, inv);
    __m128i b = narrow_i8x16(x0, x1);
    if (f == Format::kINT8) b = _mm_xor_si128(b, _mm_set1_epi8(static_cast<char>(0x80)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), b);
    if (f == Format::kINT4) {
      run = _mm256_add_epi32(run, _mm256_add_epi32(x0, x1));
      if ((i + 16) % group == 0) {
        gsum[(i + 16) / group - 1] = sum_i32x8(run);
        run = _mm256_setzero_si256();
      }
    }
  }
  *scale = s;
}

}  // namespace

void to_f32(Isa isa, const void* src, bool f32, int n, float* dst) {
  if (avx512(isa)) return to_f32_avx512(src, f32, n, dst);
  if (runs_avx2(isa)) return to_f32_avx2(src, f32, n, dst);
  to_f32_generic(src, f32, n, dst);
}

void split_bf16(Isa isa, const float* v, int n, uint16_t* hi, uint16_t* lo) {
  if (avx512(isa)) return split_bf16_avx512(v, n, hi, lo);
  if (runs_avx2(isa)) return split_bf16_avx2(v, n, hi, lo);
  split_bf16_generic(v, n, hi, lo);
}

void put(Isa isa, const float* hi, const float* lo, int n, float scale, bool f32, void* dst) {
  if (avx512(isa)) return put_avx512(hi, lo, n, scale, f32, dst);
  if (runs_avx2(isa)) return put_avx2(hi, lo, n, scale, f32, dst);
  put_generic(hi, lo, n, scale, f32, dst);
}

void put_tile(Isa isa, const float* y, int R, int rows, int cols, bool f32, void* dst, size_t stride) {
  if (avx512(isa)) return put_tile_avx512(y, R, rows, cols, f32, dst, stride);
  for (int t = 0; t < rows; ++t) {
    const float* src = y + size_t(t) * R * kRows;
    put(isa, src, R == 2 ? src + kRows : nullptr, cols, 1.0f, f32,
        static_cast<uint8_t*>(dst) + t * stride * (f32 ? 4 : 2));
  }
}

void axpy_tiles(Isa isa, float w, const float* hi, const float* lo, size_t stride, int n, float* acc) {
  if (avx512(isa)) return axpy_tiles_avx512(w, hi, lo, stride, n, acc);
  if (runs_avx2(isa)) return axpy_tiles_avx2(w, hi, lo, stride, n, acc);
  axpy_tiles_generic(w, hi, lo, stride, 0, n, acc);
}

void silu_mul_row(Isa isa, const float* g, const float* u, float* out) {
  if (avx512(isa)) return silu_mul_avx512(g, u, out);
  if (runs_avx2(isa)) return silu_mul_avx2(g, u, out);
  silu_mul_generic(g, u, out);
}

void sigmoid_row(Isa isa, const float* x, float* out) {
  if (avx512(isa)) return sigmoid_avx512(x, out);
  if (runs_avx2(isa)) return sigmoid_avx2(x, out);
  sigmoid_generic(x, out);
}

void quantize_row(Isa isa, const float* v, int k, int kp, Format f, int group, int8_t* q, float* scale,
                  int32_t* gsum) {
  const bool whole = kp % 16 == 0 && (f == Format::kINT8 || group % 16 == 0);
  if (avx512(isa) && whole) return quantize_row_avx512(v, k, kp, f, group, q, scale, gsum);
  if (runs_avx2(isa) && whole) return quantize_row_avx2(v, k, kp, f, group, q, scale, gsum);
  quantize_row_generic(v, k, kp, f, group, q, scale, gsum);
}

}  // namespace hybridd
