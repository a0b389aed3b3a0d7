// The pass over a step's logits before sampling (logits_scan.h): a portable loop and an AVX-512 one, which give the
// same answers (comparisons only: no rounding to differ in; bf16 logits are widened exactly).
#include "logits_scan.h"

#include "moe.h"
#include "simd_math.h"

#include <immintrin.h>

#include <cmath>
#include <limits>

namespace hybridd {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float value(float v) { return v; }
inline float value(uint16_t v) { return bf16_to_f32(v); }

template <typename T>
int64_t scan_row_generic(const T* x, int64_t n) {
  float best = kNegInf;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = value(x[i]);
    if (std::isnan(v) || v == -kNegInf) return -1;
    if (v > best) best = v, at = i;
  }
  return best == kNegInf ? -1 : at;
}

// Per lane, the largest value seen and its first index; a strict > keeps a lane's first occurrence, and among the
// lanes holding the row's largest value the smallest index is the row's first.
struct LaneMax {
  __m512 best;
  __m512i at, idx;
  __mmask16 bad;  // lanes that saw a NaN or +inf
};

AVX512F_TARGET inline void take(LaneMax& m, __m512 v) {
  m.bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, _mm512_set1_ps(-kNegInf), _CMP_EQ_OQ);
  const __mmask16 gt = _mm512_cmp_ps_mask(v, m.best, _CMP_GT_OQ);
  m.best = _mm512_mask_mov_ps(m.best, gt, v);
  m.at = _mm512_mask_mov_epi32(m.at, gt, m.idx);
  m.idx = _mm512_add_epi32(m.idx, _mm512_set1_epi32(16));
}

// 16 values from x + i (bf16 widened exactly), lanes outside `lanes` reading -inf: never above `best`, never a NaN or
// +inf.
AVX512F_TARGET inline __m512 load16(const float* x, __mmask16 lanes) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), lanes, x);
}

AVX512F_TARGET inline __m512 load16(const uint16_t* x, __mmask16 lanes) {
  return _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), lanes, widen_bf16(_mm256_maskz_loadu_epi16(lanes, x)));
}

template <typename T>
AVX512F_TARGET int64_t scan_row_avx512(const T* x, int64_t n) {
  LaneMax m{_mm512_set1_ps(kNegInf), _mm512_setzero_si512(),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) take(m, load16(x + i, 0xffff));
  if (i < n) take(m, load16(x + i, static_cast<__mmask16>((1u << (n - i)) - 1)));
  const float top = _mm512_reduce_max_ps(m.best);
  if (m.bad || top == kNegInf) return -1;
  const __mmask16 holds = _mm512_cmp_ps_mask(m.best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holds, m.at);
}

template <typename T>
void scan_rows(Isa isa, const T* logits, int64_t rows, int64_t vocab, int64_t stride, int64_t* greedy,
               uint8_t* broken) {
  // The vector loop counts indices in 32-bit lanes.
  const bool vector = avx512(isa) && vocab < (int64_t(1) << 31);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * stride;
    const int64_t at = vector ? scan_row_avx512(x, vocab) : scan_row_generic(x, vocab);
    greedy[r] = at;
    broken[r] = at < 0;
  }
}

}  // namespace

void logits_scan(Isa isa, const void* logits, bool bf16, int64_t rows, int64_t vocab, int64_t stride,
                 int64_t* greedy, uint8_t* broken) {
  if (bf16) scan_rows(isa, static_cast<const uint16_t*>(logits), rows, vocab, stride, greedy, broken);
  else scan_rows(isa, static_cast<const float*>(logits), rows, vocab, stride, greedy, broken);
}

}  // namespace hybridd
