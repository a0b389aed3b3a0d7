// Number helpers shared by the kernels: bf16 <-> fp32 conversions, the AVX-512 and AVX2 exp and int4 nibbles.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hybridd {

// AVX-512 Foundation with the byte/word, vector-length and dword/qword extensions: Skylake-SP and every later
// AVX-512 CPU. Code under this target runs on all of the avx512, avx512_vnni, avx512_bf16 and amx paths.
#define AVX512F_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
// The same with the int8 dot product (vpdpbusd): Cascade Lake, Ice Lake and every later AVX-512 CPU; code under it
// runs on the avx512_vnni, avx512_bf16 and amx paths.
#define AVX512VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// The same with the bf16 dot product (vdpbf16ps): Cooper Lake, Sapphire Rapids and later, Zen 4 and later; code
// under it runs on the avx512_bf16 and amx paths only.
#define AVX512BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
// AVX2 with FMA: Haswell, Zen 1 and every later x86-64 CPU but the Atom-derived ones.
#define AVX2_TARGET __attribute__((target("avx2,fma")))

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// An element of a bf16 (held as uint16_t) or fp32 tensor: read as fp32, written from fp32 (bf16 rounds to
// nearest even), and a value as the tensor would store it, read back.
template <typename T>
inline float element_f32(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else return bf16_to_f32(v);
}

template <typename T>
inline T element_from_f32(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else return f32_to_bf16(v);
}

template <typename T>
inline float stored_as(float v) {
  return element_f32(element_from_f32<T>(v));
}

// The bits of v as 32 bf16 values: a vdpbf16ps operand.
AVX512BF16_TARGET inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The 32 bits at p (a pair of bf16 values, four int8 values) in every lane.
AVX512F_TARGET inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 bf16 values widened to fp32 (exact).
__attribute__((target("avx512f"))) inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 8 bf16 values widened to fp32 (exact).
AVX2_TARGET inline __m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Taylor coefficients of e^f, degree 7 down to 0.
constexpr float kExpTaylor[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

// exp(x) = 2^n * 2^f with |f| <= 1/2 and a degree-7 Taylor polynomial of 2^f. Relative error about
// 1.3e-7 for |x| <= 1, growing by ~7e-8 per unit of |x| (x * log2(e) is rounded to fp32 first): 4e-6 at -87.
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// exp512 for 8 lanes; 2^n is built in the exponent field (n lies in [-126, 127] after the clamp).
AVX2_TARGET inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The 64 bytes at p split into their low and their high nibbles, one per byte (int4 weight lines).
AVX512F_TARGET inline void nibbles(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(p), nib = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(v, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
}

// The same for the 32 bytes at p.
AVX2_TARGET inline void nibbles(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nib = _mm256_set1_epi8(0x0f);
  lo = _mm256_and_si256(v, nib);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
}

}  // namespace hybridd
