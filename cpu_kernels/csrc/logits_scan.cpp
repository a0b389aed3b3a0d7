// The pass over a step's logits before sampling (logits_scan.h): a portable loop and an AVX-512 one, which give the
// same answers (comparisons and blends only: no rounding to differ in; bf16 logits are widened exactly).
#include "logits_scan.h"

#include "moe.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace hybridd {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr uint16_t kNegInfBf16 = 0xff80;

inline float value(float v) { return v; }
inline float value(uint16_t v) { return bf16_to_f32(v); }
inline void forbid(float& v) { v = kNegInf; }
inline void forbid(uint16_t& v) { v = kNegInfBf16; }

struct RowScan {
  int64_t greedy;
  uint8_t status;
};

inline RowScan finish(bool bad, bool live, float best, int64_t at) {
  if (bad || !live) return {-1, kScanBroken};
  if (best == kNegInf) return {-1, kScanMaskedOut};
  return {at, kScanOk};
}

// The 32 tokens' bits of word w of a row's mask (`mask` null: all allowed; past the mask: none).
inline uint32_t word_bits(const uint32_t* mask, int64_t words, int64_t w) {
  return mask == nullptr ? 0xffffffffu : w < words ? mask[w] : 0u;
}

template <typename T>
RowScan scan_row_generic(T* x, int64_t n, const uint32_t* mask, int64_t words) {
  float best = kNegInf;
  int64_t at = 0;
  bool bad = false, live = false;
  for (int64_t base = 0; base < n; base += 32) {
    const uint32_t allowed = word_bits(mask, words, base / 32);
    for (int64_t i = base; i < std::min(n, base + 32); ++i) {
      float v = value(x[i]);
      bad |= std::isnan(v) || v == -kNegInf;
      live |= v > kNegInf;
      if (!((allowed >> (i - base)) & 1u)) {
        forbid(x[i]);
        v = kNegInf;
      }
      if (v > best) best = v, at = i;
    }
  }
  return finish(bad, live, best, at);
}

// Per lane, the largest value seen and its first index; a strict > keeps a lane's first occurrence, and among the
// lanes holding the row's largest value the smallest index is the row's first.
struct LaneMax {
  __m512 best;
  __m512i at, idx;
  __mmask16 bad;   // lanes that saw a NaN or +inf
  __mmask16 live;  // lanes that saw a value above -inf (before the mask)
};

// v: the values as given; allowed: the lanes the mask keeps (the caller writes -inf into the others).
AVX512F_TARGET inline void take(LaneMax& m, __m512 v, __mmask16 allowed) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  m.bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, _mm512_set1_ps(-kNegInf), _CMP_EQ_OQ);
  m.live |= _mm512_cmp_ps_mask(v, neg_inf, _CMP_GT_OQ);
  const __mmask16 gt = _mm512_mask_cmp_ps_mask(allowed, v, m.best, _CMP_GT_OQ);
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

AVX512F_TARGET inline void forbid(float* x, __mmask16 lanes) {
  _mm512_mask_storeu_ps(x, lanes, _mm512_set1_ps(kNegInf));
}

AVX512F_TARGET inline void forbid(uint16_t* x, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(x, lanes, _mm256_set1_epi16(static_cast<short>(kNegInfBf16)));
}

// A 16-token chunk starts at a multiple of 16, so its bits lie in one word.
template <typename T>
AVX512F_TARGET RowScan scan_row_avx512(T* x, int64_t n, const uint32_t* mask, int64_t words) {
  LaneMax m{_mm512_set1_ps(kNegInf), _mm512_setzero_si512(),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 0, 0};
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __mmask16 allowed = static_cast<__mmask16>(word_bits(mask, words, i / 32) >> (i % 32)) & lanes;
    take(m, load16(x + i, lanes), allowed);
    if (mask != nullptr && allowed != lanes) forbid(x + i, static_cast<__mmask16>(lanes & ~allowed));
  }
  const float top = _mm512_reduce_max_ps(m.best);
  if (m.bad || !m.live || top == kNegInf) return finish(m.bad, m.live, top, -1);
  const __mmask16 holds = _mm512_cmp_ps_mask(m.best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return {_mm512_mask_reduce_min_epi32(holds, m.at), kScanOk};
}

template <typename T>
void scan_rows(Isa isa, T* logits, int64_t rows, int64_t vocab, int64_t stride, const int64_t* mask_of_row,
               const uint32_t* bits, int64_t words, int64_t* greedy, uint8_t* status) {
  // The vector loop counts indices in 32-bit lanes.
  const bool vector = avx512(isa) && vocab < (int64_t(1) << 31);
  for (int64_t r = 0; r < rows; ++r) {
    T* x = logits + r * stride;
    const int64_t i = mask_of_row == nullptr ? -1 : mask_of_row[r];
    const uint32_t* mask = i < 0 ? nullptr : bits + i * words;
    const RowScan s = vector ? scan_row_avx512(x, vocab, mask, words) : scan_row_generic(x, vocab, mask, words);
    greedy[r] = s.greedy;
    status[r] = s.status;
  }
}

}  // namespace

void logits_scan(Isa isa, void* logits, bool bf16, int64_t rows, int64_t vocab, int64_t stride,
                 const int64_t* mask_of_row, const uint32_t* bits, int64_t words, int64_t* greedy, uint8_t* status) {
  if (bf16)
    scan_rows(isa, static_cast<uint16_t*>(logits), rows, vocab, stride, mask_of_row, bits, words, greedy, status);
  else
    scan_rows(isa, static_cast<float*>(logits), rows, vocab, stride, mask_of_row, bits, words, greedy, status);
}

}  // namespace hybridd
