// The avx512 path's tile dot products: weights widened in registers to fp32 (bf16, fp8) or int16 (int8, int4)
// and multiplied with AVX-512 Foundation/BW instructions only. The activation rows are widened once per block
// of rows and tile range, so a weight line costs its conversion once per token block and its multiply-adds per
// token.
#include "tile_dot_avx512f.h"

#include "fp8_lines.h"
#include "simd_math.h"
#include "token_blocks.h"
#include "wide_rows.h"

#include <immintrin.h>

namespace hybridd {

namespace {

// An fp8 line's 16-bit word w of 128-bit lane L holds the codes of row 4L + w % 4 at k = 4c + 2 * (w / 4) + e,
// e = 0 in its low byte and 1 in its high byte (moe.h). Converted in place, without moving codes across words:
// out[2e + p] holds, in 32-bit lane q of lane L, the value of row 4L + 2 * (q % 2) + p at k = 4c + 2 * (q / 2) + e,
// times 2^-24. A code s.eeee.mmm in the high byte of a word, shifted right arithmetically by 4, is
// s (5 times).eeee.mmm; in the high half of a 32-bit lane, keeping bit 31, clearing 30-27 and everything
// below 20 and setting 29-28 gives the fp32 s.0110eeee.mmm0.. = 2^(e + 96 - 127) * 1.mmm. Zero, subnormal and
// NaN codes (flagged line pairs) are read from the exact table f32 (fp8_tables().f32, looked up before the
// caller's loop: a call in the loop keeps its accumulators in memory).
AVX512F_TARGET inline void fp8_line_f32(const uint8_t* line, const float* f32, bool tables, __m512* out) {
  const __m512i v = _mm512_loadu_si512(line);
  if (__builtin_expect(tables, 0)) {
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (int b = 0; b < 4; ++b) {  // byte b = 2p + e of each 32-bit lane
      const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * b), byte);
      out[2 * (b % 2) + b / 2] = _mm512_mul_ps(_mm512_i32gather_ps(code, f32, 4), _mm512_set1_ps(1.0f / kFp8Rebias));
    }
    return;
  }
  const __m512i keep = _mm512_set1_epi32(int(0x87f00000u)), bias = _mm512_set1_epi32(0x30000000);
  const auto fp32 = [&](__m512i hi) AVX512F_TARGET {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(hi, keep, bias, 0xEA));  // (a & b) | c
  };
  const __m512i odd = _mm512_srai_epi16(v, 4), even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 4);
  out[0] = fp32(_mm512_slli_epi32(even, 16));
  out[1] = fp32(even);
  out[2] = fp32(_mm512_slli_epi32(odd, 16));
  out[3] = fp32(odd);
}

// Activations for fp8 lines: per line c, the 128-bit patterns x[4c + e], x[4c + e], x[4c + 2 + e], x[4c + 2 + e]
// for e = 0, 1 (8 floats per 4 columns), so that one broadcast meets out[2e + p] of fp8_line_f32.
AVX512F_TARGET void widen_fp8_row(const uint16_t* src, int64_t kp, float* dst) {
  const __m512i first = _mm512_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t k = 0; k < kp; k += 16) {
    const __m512 z = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
    _mm512_storeu_ps(dst + 2 * k, _mm512_permutexvar_ps(first, z));
    _mm512_storeu_ps(dst + 2 * k + 16, _mm512_permutexvar_ps(second, z));
  }
}

// Row r's sums from accumulators laid out as fp8_line_f32's outputs: acc[p] lanes q and q + 2 of each 128-bit
// lane L both belong to row 4L + 2 * (q % 2) + p.
AVX512F_TARGET inline __m512 fp8_rows(__m512 even, __m512 odd) {
  const __m512 e = _mm512_add_ps(even, _mm512_permute_ps(even, 0x4E));  // lanes (2, 3, 0, 1)
  const __m512 o = _mm512_add_ps(odd, _mm512_permute_ps(odd, 0x4E));
  return _mm512_unpacklo_ps(e, o);
}

// NT tiles against TB rows, each broadcast register meeting all NT tiles. An FMA with an embedded {1to16}
// broadcast issued once a cycle on Ice Lake against about 1.6 from a broadcast register shared by two (two with
// no load), so one tile at a time ran at half the FMA rate. A row's sums come in the same order whatever NT:
// chains by k pair and parity at one row, by parity at two to four, one chain from five (where the rows' chains
// cover the FMA latency and two tiles' accumulators still fit the registers).
template <int NT, int TB>
AVX512F_TARGET void dot_bf16(const Tile* t, const float* const* x, float* const* out) {
  const __m512i high = _mm512_set1_epi32(int(0xffff0000u));
  constexpr int kUnroll = TB == 1 ? 2 : 1;
  constexpr int kChains = TB == 1 ? 4 : (TB <= 4 ? 2 : 1);
  __m512 acc[NT][TB][kChains];
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < TB; ++i)
      for (int c = 0; c < kChains; ++c) acc[j][i][c] = _mm512_setzero_ps();
  for (int p = 0; p < t[0].kp / 2; p += kUnroll)
    for (int u = 0; u < kUnroll; ++u) {
      __m512 even[NT], odd[NT];
      for (int j = 0; j < NT; ++j) {
        const uint16_t* line = reinterpret_cast<const uint16_t*>(t[j].data) + (p + u) * 32;
        stream_prefetch(line);
        const __m512i v = _mm512_loadu_si512(line);
        even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      }
      const int k = 2 * (p + u), ce = kChains == 4 ? 2 * u : 0, co = kChains == 1 ? 0 : ce + 1;
      for (int i = 0; i < TB; ++i) {
        const __m512 xe = _mm512_set1_ps(x[i][k]), xo = _mm512_set1_ps(x[i][k + 1]);
        for (int j = 0; j < NT; ++j) {
          acc[j][i][ce] = _mm512_fmadd_ps(even[j], xe, acc[j][i][ce]);
          acc[j][i][co] = _mm512_fmadd_ps(odd[j], xo, acc[j][i][co]);
        }
      }
    }
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < TB; ++i) {
      __m512 sum = acc[j][i][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[j][i][c]);
      _mm512_storeu_ps(out[j] + i * kRows, sum);
    }
}

template <int TB>
AVX512F_TARGET void dot_fp8(const Tile& t, int block_k, const float* const* x, float* out) {
  constexpr int kChains = TB == 1 ? 4 : 2;  // by 2e + p at one token, else by p
  const int lines_per_block = block_k / 4;
  const float* f32 = fp8_tables().f32;
  __m512 acc[TB][2];
  for (int i = 0; i < TB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int kb = 0; kb < t.kp / block_k; ++kb) {
    __m512 part[TB][kChains];
    for (int i = 0; i < TB; ++i)
      for (int c = 0; c < kChains; ++c) part[i][c] = _mm512_setzero_ps();
    for (int c = kb * lines_per_block; c < (kb + 1) * lines_per_block; ++c) {
      const uint8_t* line = t.data + int64_t(c) * 64;
      stream_prefetch(line);
      __m512 w[4];
      fp8_line_f32(line, f32, pair_flagged(t, c / 2), w);
      for (int i = 0; i < TB; ++i)
        for (int e = 0; e < 2; ++e) {
          const __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps(x[i] + 8 * c + 4 * e));
          for (int p = 0; p < 2; ++p) {
            __m512& sum = part[i][TB == 1 ? 2 * e + p : p];
            sum = _mm512_fmadd_ps(w[2 * e + p], xv, sum);
          }
        }
    }
    const __m512 s = _mm512_set1_ps(t.scales[kb] * kFp8Rebias);
    for (int i = 0; i < TB; ++i)
      for (int p = 0; p < 2; ++p) {
        const __m512 sum = TB == 1 ? _mm512_add_ps(part[i][p], part[i][2 + p]) : part[i][p];
        acc[i][p] = _mm512_fmadd_ps(sum, s, acc[i][p]);
      }
  }
  for (int i = 0; i < TB; ++i) _mm512_storeu_ps(out + i * kRows, fp8_rows(acc[i][0], acc[i][1]));
}

// 16 rows' sums from the pair sums of vpmaddwd: lanes 2r, 2r + 1 of lo (rows 0-7) and of hi (rows 8-15).
AVX512F_TARGET inline __m512i row_sums(__m512i lo, __m512i hi) {
  const __m256i l = _mm512_cvtepi64_epi32(_mm512_add_epi32(lo, _mm512_srli_epi64(lo, 32)));
  const __m256i h = _mm512_cvtepi64_epi32(_mm512_add_epi32(hi, _mm512_srli_epi64(hi, 32)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
}

// u8 activations (widened to int16) x s8 weights (widened per line): vpmaddwd pair sums are exact, where
// vpmaddubsw would saturate.
template <int TB>
AVX512F_TARGET void dot_int8(const Tile& t, const Act& a, const int* rows, const int16_t* const* x, float* out) {
  __m512i acc[TB][2];
  for (int i = 0; i < TB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
  for (int c = 0; c < t.kp / 4; ++c) {
    const uint8_t* line = t.data + int64_t(c) * 64;
    stream_prefetch(line);
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
    for (int i = 0; i < TB; ++i) {
      const __m512i xv = _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(x[i] + 4 * c));
      acc[i][0] = _mm512_add_epi32(acc[i][0], _mm512_madd_epi16(w0, xv));
      acc[i][1] = _mm512_add_epi32(acc[i][1], _mm512_madd_epi16(w1, xv));
    }
  }
  const __m512i comp = _mm512_loadu_si512(t.comp);
  const __m512 ws = _mm512_loadu_ps(t.scales);
  for (int i = 0; i < TB; ++i) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(row_sums(acc[i][0], acc[i][1]), comp));
    _mm512_storeu_ps(out + i * kRows, _mm512_mul_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[rows[i]]))));
  }
}

// Nibbles (q + 8, 0..15) x s8 activations by vpmaddubsw: a pair sum is at most 2 * 15 * 127, and the low and
// high nibbles' sums together stay within int16 before vpmaddwd widens them.
template <int TB>
AVX512F_TARGET void dot_int4(const Tile& t, int group, const Act& a, const int* rows, float* out) {
  const int chunks = group / 8, groups = t.kp / group;
  const int64_t stride = int64_t(chunks + 1) * 64;
  const __m512i ones = _mm512_set1_epi16(1);
  __m512 acc[TB];
  const int8_t* x[TB];
  for (int i = 0; i < TB; ++i) {
    acc[i] = _mm512_setzero_ps();
    x[i] = a.q + int64_t(rows[i]) * a.kp;
  }
  for (int g = 0; g < groups; ++g) {
    const uint8_t* lines = t.data + g * stride;
    __m512i sum[TB];
    for (int i = 0; i < TB; ++i) sum[i] = _mm512_setzero_si512();
    for (int c = 0; c < chunks; ++c) {
      const uint8_t* line = lines + c * 64;
      stream_prefetch(line);
      __m512i lo, hi;
      nibbles(line, lo, hi);
      const int k = g * group + 8 * c;
      for (int i = 0; i < TB; ++i) {
        const __m512i xlo = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[i] + k));
        const __m512i xhi = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[i] + k + 4));
        const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xlo), _mm512_maddubs_epi16(hi, xhi));
        sum[i] = _mm512_add_epi32(sum[i], _mm512_madd_epi16(pairs, ones));
      }
    }
    stream_prefetch(lines + chunks * 64);
    const __m512 gs = _mm512_loadu_ps(reinterpret_cast<const float*>(lines + chunks * 64));
    for (int i = 0; i < TB; ++i) {
      const __m512i corr = _mm512_set1_epi32(8 * a.gsum[int64_t(rows[i]) * a.ngroups + g]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[i], corr)),
                               _mm512_mul_ps(gs, _mm512_set1_ps(a.scale[rows[i]])), acc[i]);
    }
  }
  for (int i = 0; i < TB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
}

template <int TB>
AVX512F_TARGET void tile_dot_block(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows,
                                   const WideRows& wide, int first, float* out) {
  if (f == Format::kINT4) {
    dot_int4<TB>(t, group, a, rows, out);
  } else if (f == Format::kINT8) {
    const int16_t* x[TB];
    for (int i = 0; i < TB; ++i) x[i] = wide.i16.data() + int64_t(first + i) * a.kp;
    dot_int8<TB>(t, a, rows, x, out);
  } else {
    const float* x[TB];
    for (int i = 0; i < TB; ++i) x[i] = wide.f32.data() + (first + i) * wide.f32_row;
    if (f == Format::kBF16) dot_bf16<1, TB>(&t, x, &out);
    else dot_fp8<TB>(t, block_k, x, out);
  }
}

}  // namespace

int avx512f_row_block(Format f, int64_t kp, int n) {
  // Whole token blocks: a block of 9 rows would run its ninth alone over every tile.
  const int block = wide_row_block(f, kp, n, 256 << 10, kTokenBlock);
  return block >= n ? n : block / kTokenBlock * kTokenBlock;
}

void widen_rows_avx512f(Format f, const Act& a, const int* rows, int n, WideRows& wide) {
  widen_rows(f, Isa::kAvx512, a, rows, n, wide, widen_fp8_row);
}

void tile_dot_avx512f(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                      const WideRows& wide, float* out) {
  for_token_blocks(n, [&](auto tb, int b) AVX512F_TARGET {
    tile_dot_block<decltype(tb)::value>(f, t, block_k, group, a, rows + b, wide, b, out + b * kRows);
  });
}

void tile_dot2_avx512f(Format f, const Tile* t, int block_k, int group, const Act& a, const int* rows, int n,
                       const WideRows& wide, float* const* out) {
  if (f != Format::kBF16) {
    for (int j = 0; j < 2; ++j) tile_dot_avx512f(f, t[j], block_k, group, a, rows, n, wide, out[j]);
    return;
  }
  for_token_blocks(n, [&](auto tb, int b) AVX512F_TARGET {
    constexpr int TB = decltype(tb)::value;
    const float* x[TB];
    for (int i = 0; i < TB; ++i) x[i] = wide.f32.data() + (b + i) * wide.f32_row;
    float* o[2] = {out[0] + b * kRows, out[1] + b * kRows};
    dot_bf16<2, TB>(t, x, o);
  });
}

}  // namespace hybridd
