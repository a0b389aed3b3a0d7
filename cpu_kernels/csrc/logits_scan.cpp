// The pass over a step's logits before sampling (logits_scan.h): a portable loop and an AVX-512 one, which give the
// same answers (comparisons only: no rounding to differ in).
#include "logits_scan.h"

#include "moe.h"
#include "simd_math.h"

#include <immintrin.h>

#include <cmath>
#include <limits>

namespace hybridd {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t scan_row_generic(const float* x, int64_t n) {
  float best = kNegInf;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (std::isnan(v) || v == -kNegInf) return -1;
    if (v > best) best = v, at = i;
  }
  return best == kNegInf ? -1 : at;
}

// Per lane, the largest value seen and its first index; a strict > keeps a lane's first occurrence, and among the
// lanes holding the row's largest value the smallest index is the row's first.
AVX512F_TARGET int64_t scan_row_avx512(const float* x, int64_t n) {
  const __m512 pos_inf = _mm512_set1_ps(-kNegInf);
  __m512 best = _mm512_set1_ps(kNegInf);
  __m512i at = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, pos_inf, _CMP_EQ_OQ);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), tail, x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, pos_inf, _CMP_EQ_OQ);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
  }
  const float top = _mm512_reduce_max_ps(best);
  if (bad || top == kNegInf) return -1;
  const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holds, at);
}

}  // namespace

void logits_scan(Isa isa, const float* logits, int64_t rows, int64_t vocab, int64_t stride, int64_t* greedy,
                 uint8_t* broken) {
  // The vector loop counts indices in 32-bit lanes.
  const bool vector = avx512(isa) && vocab < (int64_t(1) << 31);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * stride;
    const int64_t at = vector ? scan_row_avx512(x, vocab) : scan_row_generic(x, vocab);
    greedy[r] = at;
    broken[r] = at < 0;
  }
}

}  // namespace hybridd
