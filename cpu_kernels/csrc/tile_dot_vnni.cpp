// The int8 and int4 tile dot products by vpdpbusd (AVX-512 VNNI): u8 activations x s8 weights for int8,
// nibbles (q + 8) x s8 activations for int4, four products per 32-bit lane. They run on every path whose CPU
// has VNNI: avx512_vnni (Cascade Lake, Ice Lake) and avx512_bf16 / amx (Zen 4 and later, Sapphire Rapids and
// later), where the AMX kernels do not take the block.
#include "tile_dot_vnni.h"

#include "fp8_lines.h"
#include "simd_math.h"
#include "token_blocks.h"

#include <immintrin.h>

namespace hybridd {

namespace {

template <int TB>
AVX512VNNI_TARGET void dot_int8(const Tile& t, const Act& a, const int* rows, float* out) {
  __m512i acc[TB];
  const uint8_t* x[TB];
  for (int i = 0; i < TB; ++i) {
    acc[i] = _mm512_setzero_si512();
    x[i] = reinterpret_cast<const uint8_t*>(a.q) + int64_t(rows[i]) * a.kp;
  }
  for (int q = 0; q < t.kp / 4; ++q) {
    stream_prefetch(t.data + q * 64);
    const __m512i w = _mm512_loadu_si512(t.data + q * 64);
    for (int i = 0; i < TB; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], bcast32(x[i] + 4 * q), w);
  }
  const __m512i comp = _mm512_loadu_si512(t.comp);
  const __m512 ws = _mm512_loadu_ps(t.scales);
  for (int i = 0; i < TB; ++i) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], comp));
    _mm512_storeu_ps(out + i * kRows, _mm512_mul_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[rows[i]]))));
  }
}

// Separate accumulators for the low and high nibbles, and two groups in flight, so the vpdpbusd
// dependency chains stay short even for a single token.
template <int TB>
AVX512VNNI_TARGET inline void int4_group(const uint8_t* lines, int chunks, int k, const int8_t* const* x,
                                         __m512i* lo_acc, __m512i* hi_acc) {
  for (int c = 0; c < chunks; ++c) {
    const uint8_t* line = lines + c * 64;
    stream_prefetch(line);
    __m512i lo, hi;
    nibbles(line, lo, hi);
    for (int i = 0; i < TB; ++i) {
      lo_acc[i] = _mm512_dpbusd_epi32(lo_acc[i], lo, bcast32(x[i] + k + 8 * c));
      hi_acc[i] = _mm512_dpbusd_epi32(hi_acc[i], hi, bcast32(x[i] + k + 8 * c + 4));
    }
  }
}

template <int TB>
AVX512VNNI_TARGET inline void int4_finish(const float* scales, const Act& a, const int* rows, int g,
                                          const __m512i* lo_acc, const __m512i* hi_acc, __m512* acc) {
  const __m512 gs = _mm512_loadu_ps(scales);
  for (int i = 0; i < TB; ++i) {
    const __m512i corr = _mm512_set1_epi32(8 * a.gsum[int64_t(rows[i]) * a.ngroups + g]);
    const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(lo_acc[i], hi_acc[i]), corr);
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(gs, _mm512_set1_ps(a.scale[rows[i]])), acc[i]);
  }
}

// Each group of an int4 tile is `chunks` weight lines followed by one line of its 16 row scales.
template <int TB>
AVX512VNNI_TARGET void dot_int4(const Tile& t, int group, const Act& a, const int* rows, float* out) {
  const int chunks = group / 8, groups = t.kp / group;
  const int64_t stride = int64_t(chunks + 1) * 64;
  __m512 acc[TB];
  const int8_t* x[TB];
  for (int i = 0; i < TB; ++i) {
    acc[i] = _mm512_setzero_ps();
    x[i] = a.q + int64_t(rows[i]) * a.kp;
  }
  int g = 0;
  if constexpr (TB == 1) {
    for (; g + 2 <= groups; g += 2) {
      const uint8_t* g0 = t.data + g * stride;
      const uint8_t* g1 = g0 + stride;
      __m512i l0[1] = {_mm512_setzero_si512()}, h0[1] = {_mm512_setzero_si512()};
      __m512i l1[1] = {_mm512_setzero_si512()}, h1[1] = {_mm512_setzero_si512()};
      int4_group<1>(g0, chunks, g * group, x, l0, h0);
      stream_prefetch(g0 + chunks * 64);
      int4_group<1>(g1, chunks, (g + 1) * group, x, l1, h1);
      stream_prefetch(g1 + chunks * 64);
      int4_finish<1>(reinterpret_cast<const float*>(g0 + chunks * 64), a, rows, g, l0, h0, acc);
      int4_finish<1>(reinterpret_cast<const float*>(g1 + chunks * 64), a, rows, g + 1, l1, h1, acc);
    }
  }
  for (; g < groups; ++g) {
    const uint8_t* lines = t.data + g * stride;
    __m512i lo_acc[TB], hi_acc[TB];
    for (int i = 0; i < TB; ++i) lo_acc[i] = hi_acc[i] = _mm512_setzero_si512();
    int4_group<TB>(lines, chunks, g * group, x, lo_acc, hi_acc);
    int4_finish<TB>(reinterpret_cast<const float*>(lines + chunks * 64), a, rows, g, lo_acc, hi_acc, acc);
  }
  for (int i = 0; i < TB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
}

template <int TB>
AVX512VNNI_TARGET void tile_dot_block(Format f, const Tile& t, int group, const Act& a, const int* rows, float* out) {
  if (f == Format::kINT8) dot_int8<TB>(t, a, rows, out);
  else dot_int4<TB>(t, group, a, rows, out);
}

}  // namespace

void tile_dot_vnni(Format f, const Tile& t, int group, const Act& a, const int* rows, int n, float* out) {
  for_token_blocks(n, [&](auto tb, int b) AVX512VNNI_TARGET {
    tile_dot_block<decltype(tb)::value>(f, t, group, a, rows + b, out + b * kRows);
  });
}

}  // namespace hybridd
