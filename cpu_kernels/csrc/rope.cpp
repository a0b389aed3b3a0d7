// Rotary position embedding (rope.h). Built with -ffp-contract=off (setup.py), so the compiler does not
// contract a product and a sum into one rounding: every step rounds as torch's separate ops do.
#include "rope.h"

#include <algorithm>

#include "moe.h"
#include "simd_math.h"

namespace hybridd {
namespace {

// fn(x, out, cos, sin) for every (token, head) row of tokens [t0, t1): the row's input, output and the token's
// tables.
template <typename T, typename Fn>
void for_each_row(const Rope& r, int64_t t0, int64_t t1, Fn fn) {
  for (int64_t t = t0; t < t1; ++t) {
    const T* cos = static_cast<const T*>(r.cos) + t * r.dim;
    const T* sin = static_cast<const T*>(r.sin) + t * r.dim;
    for (int64_t h = 0; h < r.heads; ++h)
      fn(static_cast<const T*>(r.x) + t * r.token_stride + h * r.head_stride,
         static_cast<T*>(r.out) + (t * r.heads + h) * r.dim, cos, sin);
  }
}

template <typename T>
void rotate_row(const Rope& r, const T* x, T* out, const T* cos, const T* sin) {
  const int64_t half = r.dim / 2;
  const bool interleave = r.interleave;  // read once: out may alias r as far as the compiler knows
  for (int64_t j = 0; j < half; ++j) {
    const float c = element_f32(cos[j]), s = element_f32(sin[j]);
    // a: the element rotated into position j (torch's x1 / first half), b: into position j + half.
    const float a = element_f32(x[interleave ? 2 * j : j]);
    const float b = element_f32(x[interleave ? 2 * j + 1 : j + half]);
    const float c2 = interleave ? c : element_f32(cos[j + half]);
    const float s2 = interleave ? s : element_f32(sin[j + half]);
    out[j] = element_from_f32<T>(stored_as<T>(a * c) - stored_as<T>(b * s));
    out[j + half] = element_from_f32<T>(stored_as<T>(b * c2) + stored_as<T>(a * s2));
  }
}

// 16 fp32 lanes rounded to bf16 and read back (f32_to_bf16 in vector form: nearest even, NaN kept quiet).
AVX512F_TARGET inline __m512 stored_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}

// n <= 16 values of a bf16 (T = uint16_t) or fp32 row as fp32 lanes, the rest zero.
template <typename T>
AVX512F_TARGET inline __m512 load16(const T* p, int n) {
  const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  if constexpr (sizeof(T) == 4) return _mm512_maskz_loadu_ps(m, p);
  else return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

template <typename T>
AVX512F_TARGET inline void store16(T* p, __m512 v, int n) {
  const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  if constexpr (sizeof(T) == 4) {
    _mm512_mask_storeu_ps(p, m, v);
  } else {  // v holds bf16 values already: their high halves
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_mask_storeu_epi16(p, m, h);
  }
}

// A product or sum as the dtype stores it.
template <typename T>
AVX512F_TARGET inline __m512 as_stored(__m512 v) {
  if constexpr (sizeof(T) == 4) return v;
  else return stored_bf16(v);
}

// rotate_row() 16 pairs at a time: the same operations on the same values, so the same bits.
template <typename T>
AVX512F_TARGET void rotate_row_avx512(const Rope& r, const T* x, T* out, const T* cos, const T* sin) {
  const int64_t half = r.dim / 2;
  // Interleaved: the even and the odd elements of 32 consecutive values.
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t j = 0; j < half; j += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, half - j));
    const __m512 c = load16(cos + j, n), s = load16(sin + j, n);
    __m512 a, b, c2, s2;
    if (r.interleave) {
      const __m512 lo = load16(x + 2 * j, std::min(16, 2 * n)), hi = load16(x + 2 * j + 16, std::max(0, 2 * n - 16));
      a = _mm512_permutex2var_ps(lo, evens, hi);
      b = _mm512_permutex2var_ps(lo, odds, hi);
      c2 = c;
      s2 = s;
    } else {
      a = load16(x + j, n);
      b = load16(x + j + half, n);
      c2 = load16(cos + j + half, n);
      s2 = load16(sin + j + half, n);
    }
    const __m512 lo = as_stored<T>(_mm512_sub_ps(as_stored<T>(_mm512_mul_ps(a, c)), as_stored<T>(_mm512_mul_ps(b, s))));
    const __m512 hi = as_stored<T>(_mm512_add_ps(as_stored<T>(_mm512_mul_ps(b, c2)), as_stored<T>(_mm512_mul_ps(a, s2))));
    store16(out + j, lo, n);
    store16(out + j + half, hi, n);
  }
}

template <typename T>
void rotate(const Rope& r, int64_t t0, int64_t t1, bool vector) {
  for_each_row<T>(r, t0, t1, [&](const T* x, T* out, const T* cos, const T* sin) {
    if (vector) rotate_row_avx512<T>(r, x, out, cos, sin);
    else rotate_row<T>(r, x, out, cos, sin);
  });
}

}  // namespace

void rope_rows(const Rope& r, int64_t t0, int64_t t1, Isa isa) {
  if (r.f32) rotate<float>(r, t0, t1, avx512(isa));
  else rotate<uint16_t>(r, t0, t1, avx512(isa));
}

void MoeRunner::rope(const Rope& r, Isa isa) {
  check_isa(isa);
  run_rows(r.tokens, r.heads * r.dim, [&](int64_t t0, int64_t t1) { rope_rows(r, t0, t1, isa); });
}

}  // namespace hybridd
