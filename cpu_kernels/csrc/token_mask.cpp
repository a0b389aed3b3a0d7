#include "token_mask.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "simd_math.h"

namespace hybridd {

namespace {

constexpr float kForbidden = -std::numeric_limits<float>::infinity();

void mask_row_generic(float* row, const uint32_t* b, int64_t vocab) {
  for (int64_t base = 0; base < vocab; base += 32) {
    const uint32_t m = b[base / 32];
    const int64_t n = std::min<int64_t>(32, vocab - base);
    if (m == 0xffffffffu) continue;
    if (m == 0) {
      std::fill(row + base, row + base + n, kForbidden);
      continue;
    }
    for (int64_t j = 0; j < n; ++j)
      if (!((m >> j) & 1u)) row[base + j] = kForbidden;
  }
}

AVX512F_TARGET void mask_row_avx512(float* row, const uint32_t* b, int64_t vocab) {
  const __m512 forbidden = _mm512_set1_ps(kForbidden);
  int64_t t = 0;
  for (; t + 16 <= vocab; t += 16) {
    const __mmask16 k = static_cast<__mmask16>(b[t / 32] >> (t % 32));
    if (k != 0xffff) _mm512_storeu_ps(row + t, _mm512_mask_blend_ps(k, forbidden, _mm512_loadu_ps(row + t)));
  }
  if (t < vocab) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (vocab - t)) - 1);
    const __mmask16 k = static_cast<__mmask16>(b[t / 32] >> (t % 32)) | static_cast<__mmask16>(~tail);
    _mm512_mask_storeu_ps(row + t, tail, _mm512_mask_blend_ps(k, forbidden, _mm512_maskz_loadu_ps(tail, row + t)));
  }
}

}  // namespace

void mask_logits(Isa isa, float* logits, int64_t stride, int64_t vocab, const int64_t* rows, int64_t nrows,
                 const uint32_t* bits, int64_t words) {
  const int64_t covered = std::min(vocab, words * 32);
  for (int64_t i = 0; i < nrows; ++i) {
    float* row = logits + rows[i] * stride;
    if (avx512(isa))
      mask_row_avx512(row, bits + i * words, covered);
    else
      mask_row_generic(row, bits + i * words, covered);
    std::fill(row + covered, row + vocab, kForbidden);  // tokens past the bitmask
  }
}

}  // namespace hybridd
