// The avx2 path's tile dot products: weights widened in registers to fp32 (bf16, fp8) or int16 (int8), int4
// nibbles multiplied with s8 activations by vpmaddubsw; 256-bit FMA and integer multiply-adds. The activation
// rows of a call are widened once into a per-thread buffer, so a weight line costs its conversion once per
// token block and its multiply-adds per token.
#include "tile_dot_avx2.h"

#include "fp8_lines.h"
#include "simd_math.h"
#include "wide_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace hybridd {

namespace {

constexpr int kTokenBlock = 12;

AVX2_TARGET inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 8 bf16 values widened to fp32 (exact).
AVX2_TARGET inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// 2^96: fp8_half_raw's values times this are the codes' values times 2^-24 (1 / kFp8Rebias).
constexpr float kRawToRebias = 0x1p96f;

// Half h (bytes 32h..32h + 31, rows 8h..8h + 7) of an fp8 line, converted without moving codes across 16-bit
// words: out[2e + p] holds, in 32-bit lane q of 128-bit lane L, row 8h + 4L + 2 * (q % 2) + p at
// k = 4c + 2 * (q / 2) + e (moe.h's line layout), as the fp32 whose sign, exponent and mantissa bits are the
// code's: s.0000eeee.mmm0.. = the code's value times 2^-120, subnormal codes included (as fp32 subnormals).
// A code in the high byte of a word, shifted right arithmetically by 4 and masked, lands there; the low byte is
// first moved up. Only the NaN codes come out wrong (as finite values): fix_fp8_pair corrects them.
AVX2_TARGET inline void fp8_half_raw(const uint8_t* half, __m256* out) {
  const __m256i v = load256(half);
  const __m256i keep = _mm256_set1_epi16(int16_t(0x87f0)), high = _mm256_set1_epi32(int(0xffff0000u));
  const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 4), keep);
  const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(v, 4), keep);
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(even, 16));
  out[1] = _mm256_castsi256_ps(_mm256_and_si256(even, high));
  out[2] = _mm256_castsi256_ps(_mm256_slli_epi32(odd, 16));
  out[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, high));
}

// fp8_half_raw's outputs as the codes' values times 2^-24, exact for every code: read from the table f32
// (fp8_tables().f32).
AVX2_TARGET inline void fp8_half_exact(const uint8_t* half, const float* f32, __m256* out) {
  const __m256i v = load256(half), byte = _mm256_set1_epi32(0xff);
  for (int b = 0; b < 4; ++b) {  // byte b = 2p + e of each 32-bit lane
    const __m256i code = _mm256_and_si256(_mm256_srli_epi32(v, 8 * b), byte);
    out[2 * (b % 2) + b / 2] = _mm256_mul_ps(_mm256_i32gather_ps(f32, code, 4), _mm256_set1_ps(1.0f / kFp8Rebias));
  }
}

// Activations for fp8 lines: per line c, the 128-bit patterns x[4c + e], x[4c + e], x[4c + 2 + e], x[4c + 2 + e]
// for e = 0, 1 (8 floats per 4 columns), so that one 128-bit broadcast meets out[2e + p] of fp8_half_raw.
AVX2_TARGET void widen_fp8_row(const uint16_t* src, int64_t kp, float* dst) {
  const __m256i first = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(4));
  for (int64_t k = 0; k < kp; k += 8) {
    const __m256 z = widen_bf16x8(src + k);
    _mm256_storeu_ps(dst + 2 * k, _mm256_permutevar8x32_ps(z, first));
    _mm256_storeu_ps(dst + 2 * k + 8, _mm256_permutevar8x32_ps(z, second));
  }
}

AVX2_TARGET inline __m256 fp8_x(const float* x, int c, int e) {
  return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x + 8 * c + 4 * e));
}

// Rows 8h..8h + 7 in order from accumulators laid out as fp8_half_raw's outputs: acc[p] lanes q and q + 2 of
// each 128-bit lane L both belong to row 4L + 2 * (q % 2) + p.
AVX2_TARGET inline __m256 fp8_rows(__m256 even, __m256 odd) {
  const __m256 e = _mm256_add_ps(even, _mm256_permute_ps(even, 0x4E));  // lanes (2, 3, 0, 1)
  const __m256 o = _mm256_add_ps(odd, _mm256_permute_ps(odd, 0x4E));
  return _mm256_unpacklo_ps(e, o);
}

// o[0..8) += s * (the rows of accumulators laid out as fp8_half_raw's outputs + fix[0..8)) (values, not an
// array: an array passed by reference keeps the loop's accumulators in memory).
AVX2_TARGET inline void add_fp8_rows(__m256 even, __m256 odd, const float* fix, __m256 s, float* o) {
  const __m256 rows = _mm256_add_ps(fp8_rows(even, odd), _mm256_loadu_ps(fix));
  _mm256_storeu_ps(o, _mm256_fmadd_ps(rows, s, _mm256_loadu_ps(o)));
}

// fp8_half_raw's value of code c.
inline float fp8_raw_value(uint8_t c) {
  const uint32_t bits = (uint32_t(c & 0x80) << 24) | (uint32_t(c & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// For line pair (c, c + 1) at `lines`, flagged: fix[i][r] += (exact - raw value * 2^96) * x_i[k] for each of its
// codes that fp8_code_needs_tables (found by a byte compare), which the pass over the block added as its raw
// value. The difference is NaN for the NaN codes and zero for the others, unless the FPU treats subnormals as
// zero (DAZ), when it restores the subnormal codes. Added to the rows' sums before the block scale, so single
// products stay exact.
template <int TB>
AVX2_TARGET void fix_fp8_pair(const uint8_t* lines, int c, const float* f32, const uint16_t* const* x,
                              float (&fix)[TB][kRows]) {
  const __m256i one = _mm256_set1_epi8(1), bits = _mm256_set1_epi8(0x70);
  for (int j0 = 0; j0 < 128; j0 += 32) {
    const __m256i v = load256(lines + j0);
    const __m256i test = _mm256_and_si256(_mm256_add_epi8(v, one), bits);
    for (uint32_t odd = _mm256_movemask_epi8(_mm256_cmpeq_epi8(test, _mm256_setzero_si256())); odd; odd &= odd - 1) {
      const int j = j0 + __builtin_ctz(odd), b = j % 64, word = (b % 16) / 2;
      const int row = 4 * (b / 16) + word % 4, k = 4 * (c + j / 64) + 2 * (word / 4) + b % 2;
      const float d = f32[lines[j]] / kFp8Rebias - fp8_raw_value(lines[j]) * kRawToRebias;
      for (int i = 0; i < TB; ++i) fix[i][row] += d * bf16_to_f32(x[i][k]);
    }
  }
}

template <int TB>
AVX2_TARGET void dot_bf16(const Tile& t, const float* const* x, float* out) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(t.data);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  constexpr int kParity = TB == 1 ? 2 : 1;  // four FMA chains at one token: by row half and k parity
  __m256 acc[TB][2][kParity];
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < kParity; ++e) acc[i][h][e] = _mm256_setzero_ps();
  for (int p = 0; p < t.kp / 2; ++p) {
    const uint16_t* line = w + p * 32;
    if constexpr (TB <= 4) stream_prefetch(line);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load256(line + 16 * h);
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int i = 0; i < TB; ++i) {
        __m256& a0 = acc[i][h][0];
        __m256& a1 = acc[i][h][kParity - 1];
        a0 = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x[i] + 2 * p), a0);
        a1 = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x[i] + 2 * p + 1), a1);
      }
    }
  }
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + i * kRows + 8 * h,
                       kParity == 2 ? _mm256_add_ps(acc[i][h][0], acc[i][h][kParity - 1]) : acc[i][h][0]);
}

// fp8_x's patterns straight from a bf16 activation row: the 4 values of line c broadcast, each moved into the
// high half of the 32-bit lanes that need it (picks[e], e = 0, 1). Reading 8 bytes per line instead of 32 keeps
// the row in L1 (a widened 7168-column row is 57 KB).
AVX2_TARGET inline void fp8_x_picks(__m256i* picks) {
  for (int e = 0; e < 2; ++e) {
    const int8_t a = int8_t(2 * e), b = int8_t(4 + 2 * e);
    picks[e] = _mm256_setr_epi8(-1, -1, a, a + 1, -1, -1, a, a + 1, -1, -1, b, b + 1, -1, -1, b, b + 1,
                                -1, -1, a, a + 1, -1, -1, a, a + 1, -1, -1, b, b + 1, -1, -1, b, b + 1);
  }
}

// One or two tokens: each line converted in registers and multiplied at once, four accumulators per token (row
// half x p), each block's sums added to out. The raw weights meet activations scaled by 2^96 (kScaledX) or,
// where an activation is 2^32 or more and that would overflow, are scaled themselves (8 more multiplies per
// line); the products are the same either way. The loop over a block's lines tests no flags: the flagged pairs'
// odd codes are corrected afterwards (fix_fp8_pair). Sixteen registers hold exactly one token's loop: more
// accumulators, sums kept across blocks, or a table lookup (or call) inside the loop spill accumulators to the
// stack, whose store-to-load latency then binds the loop.
template <int TB, bool kScaledX>
AVX2_TARGET void dot_fp8_few(const Tile& t, int block_k, const uint16_t* const* x, float* out) {
  const int pairs_per_block = block_k / 8;
  const float* f32 = fp8_tables().f32;
  const __m256 scale = _mm256_set1_ps(kRawToRebias);
  __m256i picks[2];
  fp8_x_picks(picks);
  std::fill(out, out + TB * kRows, 0.0f);
  for (int kb = 0; kb < t.kp / block_k; ++kb) {
    __m256 part[TB][2][2];
    for (int i = 0; i < TB; ++i)
      for (int h = 0; h < 2; ++h) part[i][h][0] = part[i][h][1] = _mm256_setzero_ps();
    const int c0 = kb * 2 * pairs_per_block, c1 = c0 + 2 * pairs_per_block;
    for (int c = c0; c < c1; ++c) {
      const uint8_t* line = t.data + int64_t(c) * 64;
      stream_prefetch(line);
      __m256 xv[TB][2];
      for (int i = 0; i < TB; ++i) {
        const __m256i q = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(x[i] + 4 * c));
        for (int e = 0; e < 2; ++e) {
          xv[i][e] = _mm256_castsi256_ps(_mm256_shuffle_epi8(q, picks[e]));
          if constexpr (kScaledX) xv[i][e] = _mm256_mul_ps(xv[i][e], scale);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 w[4];
        fp8_half_raw(line + 32 * h, w);
        if constexpr (!kScaledX)
          for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], scale);
        for (int i = 0; i < TB; ++i)
          for (int e = 0; e < 2; ++e)
            for (int p = 0; p < 2; ++p) part[i][h][p] = _mm256_fmadd_ps(w[2 * e + p], xv[i][e], part[i][h][p]);
      }
    }
    float fix[TB][kRows] = {};
    for (int c = c0; c < c1; c += 2)
      if (pair_flagged(t, c / 2)) fix_fp8_pair<TB>(t.data + int64_t(c) * 64, c, f32, x, fix);
    const __m256 s = _mm256_set1_ps(t.scales[kb] * kFp8Rebias);
    for (int i = 0; i < TB; ++i)
      for (int h = 0; h < 2; ++h)
        add_fp8_rows(part[i][h][0], part[i][h][1], fix[i] + 8 * h, s, out + i * kRows + 8 * h);
  }
}

// Whether row x[0..kp) holds a finite value of magnitude 2^32 or more, which times 2^96 overflows.
AVX2_TARGET bool has_huge(const uint16_t* x, int64_t kp) {
  const __m256i mag = _mm256_set1_epi16(0x7fff), least = _mm256_set1_epi16(0x4f7f), inf = _mm256_set1_epi16(0x7f80);
  __m256i any = _mm256_setzero_si256();
  for (int64_t k = 0; k < kp; k += 16) {
    const __m256i m = _mm256_and_si256(load256(x + k), mag);
    any = _mm256_or_si256(any, _mm256_andnot_si256(_mm256_cmpgt_epi16(m, inf), _mm256_cmpgt_epi16(m, least)));
  }
  return !_mm256_testz_si256(any, any);
}

// TB tokens' sums over converted lines (8 fp32 vectors per line, fp8_half_raw's outputs of both halves), scaled
// by s and added to out.
template <int TB>
AVX2_TARGET void fp8_block_from_lines(const float* lines, int c0, int nlines, const float* const* x, __m256 s,
                                      float* out) {
  __m256 part[TB][2][2];
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h) part[i][h][0] = part[i][h][1] = _mm256_setzero_ps();
  for (int l = 0; l < nlines; ++l)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        const __m256 w0 = _mm256_load_ps(lines + l * 64 + 32 * h + 16 * e);
        const __m256 w1 = _mm256_load_ps(lines + l * 64 + 32 * h + 16 * e + 8);
        for (int i = 0; i < TB; ++i) {
          const __m256 xv = fp8_x(x[i], c0 + l, e);
          part[i][h][0] = _mm256_fmadd_ps(w0, xv, part[i][h][0]);
          part[i][h][1] = _mm256_fmadd_ps(w1, xv, part[i][h][1]);
        }
      }
  constexpr float kNoFix[kRows] = {};
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h) add_fp8_rows(part[i][h][0], part[i][h][1], kNoFix + 8 * h, s, out + i * kRows + 8 * h);
}

// Three or more tokens: each block of block_k columns is converted once into an L1-resident buffer of fp32
// lines, then multiplied by three tokens at a time (12 accumulators), so prefill runs at the FMA rate.
AVX2_TARGET void dot_fp8_many(const Tile& t, int block_k, const float* const* x, int n, float* out) {
  thread_local AlignedVector<float> buffer;
  const int lines_per_block = block_k / 4;
  buffer.resize(size_t(lines_per_block) * 64);
  float* lines = buffer.data();
  const float* f32 = fp8_tables().f32;
  std::fill(out, out + n * kRows, 0.0f);
  for (int kb = 0; kb < t.kp / block_k; ++kb) {
    const int c0 = kb * lines_per_block;
    for (int l = 0; l < lines_per_block; ++l) {
      const uint8_t* line = t.data + int64_t(c0 + l) * 64;
      stream_prefetch(line);
      const bool exact = pair_flagged(t, (c0 + l) / 2);
      for (int h = 0; h < 2; ++h) {
        __m256 w[4];
        if (exact) {
          fp8_half_exact(line + 32 * h, f32, w);
        } else {
          fp8_half_raw(line + 32 * h, w);
          for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], _mm256_set1_ps(kRawToRebias));
        }
        for (int j = 0; j < 4; ++j) _mm256_store_ps(lines + l * 64 + 32 * h + 8 * j, w[j]);
      }
    }
    const __m256 s = _mm256_set1_ps(t.scales[kb] * kFp8Rebias);
    int i = 0;
    for (; i + 3 <= n; i += 3) fp8_block_from_lines<3>(lines, c0, lines_per_block, x + i, s, out + i * kRows);
    if (n - i == 2) fp8_block_from_lines<2>(lines, c0, lines_per_block, x + i, s, out + i * kRows);
    else if (n - i == 1) fp8_block_from_lines<1>(lines, c0, lines_per_block, x + i, s, out + i * kRows);
  }
}

// u8 activations (widened to int16) x s8 weights (widened per line): vpmaddwd pair sums are exact, where
// vpmaddubsw would saturate. acc[q] lanes 2j, 2j + 1 hold row 4q + j's pair sums.
template <int TB>
AVX2_TARGET void dot_int8(const Tile& t, const Act& a, const int* rows, const int16_t* const* x, float* out) {
  __m256i acc[TB][4];
  for (int i = 0; i < TB; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_si256();
  for (int c = 0; c < t.kp / 4; ++c) {
    const uint8_t* line = t.data + int64_t(c) * 64;
    stream_prefetch(line);
    __m256i w[4];
    for (int q = 0; q < 4; ++q)
      w[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * q)));
    for (int i = 0; i < TB; ++i) {
      const __m256i xv = _mm256_set1_epi64x(*reinterpret_cast<const int64_t*>(x[i] + 4 * c));
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_add_epi32(acc[i][q], _mm256_madd_epi16(w[q], xv));
    }
  }
  const __m256 ws0 = _mm256_loadu_ps(t.scales), ws1 = _mm256_loadu_ps(t.scales + 8);
  const __m256i comp0 = load256(t.comp), comp1 = load256(t.comp + 8);
  for (int i = 0; i < TB; ++i) {
    // hadd of (q0, q1) holds rows 0, 1, 4, 5 | 2, 3, 6, 7 in lane order.
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[i][0], acc[i][1]), order);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[i][2], acc[i][3]), order);
    const __m256 xs = _mm256_set1_ps(a.scale[rows[i]]);
    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, comp0));
    const __m256 v1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, comp1));
    _mm256_storeu_ps(out + i * kRows, _mm256_mul_ps(v0, _mm256_mul_ps(ws0, xs)));
    _mm256_storeu_ps(out + i * kRows + 8, _mm256_mul_ps(v1, _mm256_mul_ps(ws1, xs)));
  }
}

// Nibbles (q + 8, 0..15) x s8 activations by vpmaddubsw: a pair sum is at most 2 * 15 * 128, and the low and
// high nibbles' sums together stay within int16 before vpmaddwd widens them, one int32 per row.
template <int TB>
AVX2_TARGET void dot_int4(const Tile& t, int group, const Act& a, const int* rows, float* out) {
  const int chunks = group / 8, groups = t.kp / group;
  const int64_t stride = int64_t(chunks + 1) * 64;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[TB][2];
  const int8_t* x[TB];
  for (int i = 0; i < TB; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    x[i] = a.q + int64_t(rows[i]) * a.kp;
  }
  for (int g = 0; g < groups; ++g) {
    const uint8_t* lines = t.data + g * stride;
    __m256i sum[TB][2];
    for (int i = 0; i < TB; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
    for (int c = 0; c < chunks; ++c) {
      const uint8_t* line = lines + c * 64;
      stream_prefetch(line);
      const int k = g * group + 8 * c;
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        nibbles(line + 32 * h, lo, hi);
        for (int i = 0; i < TB; ++i) {
          const __m256i xlo = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x[i] + k));
          const __m256i xhi = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x[i] + k + 4));
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
          sum[i][h] = _mm256_add_epi32(sum[i][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    stream_prefetch(lines + chunks * 64);
    const float* gs = reinterpret_cast<const float*>(lines + chunks * 64);
    for (int i = 0; i < TB; ++i) {
      const __m256i corr = _mm256_set1_epi32(8 * a.gsum[int64_t(rows[i]) * a.ngroups + g]);
      const __m256 xs = _mm256_set1_ps(a.scale[rows[i]]);
      for (int h = 0; h < 2; ++h)
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[i][h], corr)),
                                    _mm256_mul_ps(_mm256_loadu_ps(gs + 8 * h), xs), acc[i][h]);
    }
  }
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + i * kRows + 8 * h, acc[i][h]);
}

// A bf16 activation row widened to fp32 (kp % 8 == 0).
AVX2_TARGET void widen_bf16_row(const uint16_t* src, int64_t kp, float* dst) {
  for (int64_t k = 0; k < kp; k += 8) _mm256_storeu_ps(dst + k, widen_bf16x8(src + k));
}

// Runs kernel<TB> over n rows in blocks of up to B.
template <int B, typename Kernel>
void in_blocks(int n, Kernel&& kernel) {
  int i = 0;
  for (; i + B <= n; i += B) kernel.template operator()<B>(i);
  if constexpr (B > 1) {
    if (n - i > 0) {
      if constexpr (B > 2) {
        if (n - i == 3) return kernel.template operator()<3>(i);
        if (n - i == 2) return kernel.template operator()<2>(i);
      }
      return kernel.template operator()<1>(i);
    }
  }
}

AVX2_TARGET void tile_dot_rows(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                               const WideRows& wide, float* out) {
  if (f == Format::kINT4) {
    in_blocks<2>(n, [&]<int TB>(int i) { dot_int4<TB>(t, group, a, rows + i, out + i * kRows); });
  } else if (f == Format::kINT8) {
    const int16_t* x[kTokenBlock];
    for (int i = 0; i < n; ++i) x[i] = wide.i16.data() + int64_t(i) * a.kp;
    in_blocks<2>(n, [&]<int TB>(int i) { dot_int8<TB>(t, a, rows + i, x + i, out + i * kRows); });
  } else {
    const int64_t stride = f == Format::kFP8 ? 2 * a.kp : a.kp;
    const float* x[kTokenBlock];
    for (int i = 0; i < n; ++i) x[i] = wide.f32.data() + i * stride;
    if (f == Format::kBF16) in_blocks<4>(n, [&]<int TB>(int i) { dot_bf16<TB>(t, x + i, out + i * kRows); });
    else dot_fp8_many(t, block_k, x, n, out);
  }
}

}  // namespace

void tile_dot_avx2(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                   float* out) {
  if (f == Format::kFP8 && n <= 2) {
    const uint16_t* x[2];
    bool huge = false;
    for (int i = 0; i < n; ++i) {
      x[i] = a.bf + int64_t(rows[i]) * a.kp;
      huge = huge || has_huge(x[i], a.kp);
    }
    if (n == 2) huge ? dot_fp8_few<2, false>(t, block_k, x, out) : dot_fp8_few<2, true>(t, block_k, x, out);
    else huge ? dot_fp8_few<1, false>(t, block_k, x, out) : dot_fp8_few<1, true>(t, block_k, x, out);
    return;
  }
  thread_local WideRows wide;
  for (int b = 0; b < n; b += kTokenBlock) {
    const int m = std::min(kTokenBlock, n - b);
    widen_rows(f, a, rows + b, m, wide, widen_fp8_row, widen_bf16_row);
    tile_dot_rows(f, t, block_k, group, a, rows + b, m, wide, out + b * kRows);
  }
}

}  // namespace hybridd
