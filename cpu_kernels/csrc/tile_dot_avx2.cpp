// The avx2 path's tile dot products: weights widened in registers to fp32 (bf16, fp8) or int16 (int8), int4
// nibbles multiplied with s8 activations by vpmaddubsw; 256-bit FMA and integer multiply-adds. The activation
// rows are widened once per tile range (widen_rows_avx2, called by tile_range), so a weight line costs its
// conversion once per token group and its multiply-adds per token.
#include "tile_dot_avx2.h"

#include "fp8_lines.h"
#include "simd_math.h"
#include "wide_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace hybridd {

namespace {

AVX2_TARGET inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

AVX2_TARGET inline __m256 widen_bf16x8(const uint16_t* p) {
  return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 2^96: fp8_bytes_raw's values times this are the codes' values times 2^-24 (1 / kFp8Rebias).
constexpr float kRawToRebias = 0x1p96f;

// Byte e of every 16-bit word of v (half h of an fp8 line: bytes 32h..32h + 31, rows 8h..8h + 7), converted
// without moving codes across words: w[p] holds, in 32-bit lane q of 128-bit lane L, row 8h + 4L + 2 * (q % 2) + p
// at k = 4c + 2 * (q / 2) + e (moe.h's line layout), as the fp32 whose sign, exponent and mantissa bits are the
// code's: s.0000eeee.mmm0.. = the code's value times 2^-120, subnormal codes included (as fp32 subnormals). A
// code in the high byte of a word, shifted right arithmetically by 4 and masked, lands there; the low byte is
// first moved up. Only the NaN codes come out wrong (as finite values): fix_fp8_pair corrects them.
AVX2_TARGET inline void fp8_bytes_raw(__m256i v, int e, __m256i keep, __m256i high, __m256* w) {
  const __m256i codes = _mm256_and_si256(_mm256_srai_epi16(e ? v : _mm256_slli_epi16(v, 8), 4), keep);
  w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 16));
  w[1] = _mm256_castsi256_ps(_mm256_and_si256(codes, high));
}

// fp8_bytes_raw's weights, times 2^96 where the activations were not widened with that scale (kScaledX false).
template <bool kScaledX>
AVX2_TARGET inline void fp8_bytes(__m256i v, int e, __m256i keep, __m256i high, __m256* w) {
  fp8_bytes_raw(v, e, keep, high, w);
  if constexpr (!kScaledX)
    for (int p = 0; p < 2; ++p) w[p] = _mm256_mul_ps(w[p], _mm256_set1_ps(kRawToRebias));
}

// Activations for fp8 lines, times `scale`: per line c, the 128-bit patterns x[4c + e], x[4c + e], x[4c + 2 + e],
// x[4c + 2 + e] for e = 0, 1 (8 floats per 4 columns), so that one 128-bit broadcast meets fp8_bytes_raw's
// outputs for byte e. A power-of-two scale keeps the values exact.
AVX2_TARGET void widen_fp8_row(const uint16_t* src, int64_t kp, float scale, float* dst) {
  const __m256i first = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(4));
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < kp; k += 8) {
    const __m256 z = _mm256_mul_ps(widen_bf16x8(src + k), s);
    _mm256_storeu_ps(dst + 2 * k, _mm256_permutevar8x32_ps(z, first));
    _mm256_storeu_ps(dst + 2 * k + 8, _mm256_permutevar8x32_ps(z, second));
  }
}

// The activation pattern fp8_bytes_raw's outputs for byte e of line c meet (widen_fp8_row's layout), broadcast to both
// 128-bit lanes. An asm load, so that GCC neither merges the loads of one pattern nor hoists a line's loads
// ahead of their use: patterns held in registers push accumulators onto the stack.
AVX2_TARGET inline __m256 fp8_x(const float* x, int c, int e) {
  __m256 v;
  asm volatile("vbroadcastf128 %1, %0" : "=x"(v) : "m"(*reinterpret_cast<const __m128*>(x + 8 * c + 4 * e)));
  return v;
}

// Rows 8h..8h + 7 in order from accumulators laid out as fp8_bytes_raw's outputs: acc[p] lanes q and q + 2 of
// each 128-bit lane L both belong to row 4L + 2 * (q % 2) + p.
AVX2_TARGET inline __m256 fp8_rows(__m256 even, __m256 odd) {
  const __m256 e = _mm256_add_ps(even, _mm256_permute_ps(even, 0x4E));  // lanes (2, 3, 0, 1)
  const __m256 o = _mm256_add_ps(odd, _mm256_permute_ps(odd, 0x4E));
  return _mm256_unpacklo_ps(e, o);
}

// o[0..8) += s * (the rows of accumulators laid out as fp8_bytes_raw's outputs + fix[0..8)) (values, not an
// array: an array passed by reference keeps the loop's accumulators in memory).
AVX2_TARGET inline void add_fp8_rows(__m256 even, __m256 odd, const float* fix, __m256 s, float* o) {
  const __m256 rows = _mm256_add_ps(fp8_rows(even, odd), _mm256_loadu_ps(fix));
  _mm256_storeu_ps(o, _mm256_fmadd_ps(rows, s, _mm256_loadu_ps(o)));
}

// fp8_bytes_raw's value of code c.
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
    if constexpr (TB <= 4) stream_prefetch_avx2(line);
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

// acc0 += the even-word weights of byte e of v times x, acc1 += the odd-word ones.
template <bool kScaledX>
AVX2_TARGET inline void fp8_fma(__m256i v, int e, __m256 x, __m256i keep, __m256i high, __m256& acc0, __m256& acc1) {
  __m256 w[2];
  fp8_bytes<kScaledX>(v, e, keep, high, w);
  acc0 = _mm256_fmadd_ps(w[0], x, acc0);
  acc1 = _mm256_fmadd_ps(w[1], x, acc1);
}

// One token's sums over fp8 lines [c0, c1), in dot_fp8's layout: eight chains (row half x byte x word), so
// that each meets one FMA a line and the loop is not bound by FMA latency (two tokens have no registers for
// this). Named variables, not an array: GCC stores an array's accumulators on every line.
template <bool kScaledX>
AVX2_TARGET void fp8_lines_one(const uint8_t* data, int c0, int c1, const float* xw, __m256 (&part)[1][2][2]) {
  const __m256i keep = _mm256_set1_epi16(int16_t(0x87f0)), high = _mm256_set1_epi32(int(0xffff0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#pragma GCC unroll 2
  for (int c = c0; c < c1; ++c) {
    const uint8_t* line = data + int64_t(c) * 64;
    stream_prefetch_avx2(line);
    const __m256i v0 = load256(line), v1 = load256(line + 32);
    const __m256 x0 = fp8_x(xw, c, 0), x1 = fp8_x(xw, c, 1);
    fp8_fma<kScaledX>(v0, 0, x0, keep, high, a0, a1);
    fp8_fma<kScaledX>(v0, 1, x1, keep, high, b0, b1);
    fp8_fma<kScaledX>(v1, 0, x0, keep, high, a2, a3);
    fp8_fma<kScaledX>(v1, 1, x1, keep, high, b2, b3);
  }
  part[0][0][0] = _mm256_add_ps(a0, b0);
  part[0][0][1] = _mm256_add_ps(a1, b1);
  part[0][1][0] = _mm256_add_ps(a2, b2);
  part[0][1][1] = _mm256_add_ps(a3, b3);
}

// TB tokens (2 to 4) over fp8 lines [c0, c1) into part: four accumulators per token (row half x word). Two
// tokens go through the lines one by one (each accumulator meets two FMAs a line, so the loop is bound by their
// latency); three or four go through them one row half at a time, so that 2 * TB accumulators, two weight
// vectors, the codes and one pattern fit in sixteen registers.
template <int TB, bool kScaledX>
AVX2_TARGET void fp8_lines(const uint8_t* data, int c0, int c1, const float* const* xw, __m256 (&part)[TB][2][2]) {
  constexpr bool kByHalf = TB > 2;
  const __m256i keep = _mm256_set1_epi16(int16_t(0x87f0)), high = _mm256_set1_epi32(int(0xffff0000u));
  for (int i = 0; i < TB; ++i)
    for (int h = 0; h < 2; ++h) part[i][h][0] = part[i][h][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int pass = 0; pass < (kByHalf ? 2 : 1); ++pass) {
    for (int c = c0; c < c1; ++c) {
      const uint8_t* line = data + int64_t(c) * 64;
      if (pass == 0) stream_prefetch_avx2(line);
#pragma GCC unroll 2  // else GCC stores the accumulators of one token on every line
      for (int h = kByHalf ? pass : 0; h < (kByHalf ? pass + 1 : 2); ++h) {
        const __m256i v = load256(line + 32 * h);
        for (int e = 0; e < 2; ++e) {
          __m256 w[2];
          fp8_bytes<kScaledX>(v, e, keep, high, w);
          for (int i = 0; i < TB; ++i) {
            const __m256 xv = fp8_x(xw[i], c, e);
            part[i][h][0] = _mm256_fmadd_ps(w[0], xv, part[i][h][0]);
            part[i][h][1] = _mm256_fmadd_ps(w[1], xv, part[i][h][1]);
          }
        }
      }
    }
  }
}

// TB tokens (1 to 4) against an fp8 tile: each line converted in registers and multiplied at once, each block's
// sums added to out. The raw weights meet activations widened with the scale 2^96 (kScaledX) or, where an
// activation is 2^32 or more and that would overflow, are scaled themselves (more multiplies); the products are
// the same either way. The loop over a block's lines tests no flags: the flagged pairs' odd codes are corrected
// afterwards (fix_fp8_pair).
template <int TB, bool kScaledX>
AVX2_TARGET void dot_fp8(const Tile& t, int block_k, const float* const* xw, const uint16_t* const* xb, float* out) {
  const int lines_per_block = block_k / 4;
  std::fill(out, out + TB * kRows, 0.0f);
  for (int kb = 0; kb < t.kp / block_k; ++kb) {
    __m256 part[TB][2][2];
    const int c0 = kb * lines_per_block, c1 = c0 + lines_per_block;
    if constexpr (TB == 1) fp8_lines_one<kScaledX>(t.data, c0, c1, xw[0], part);
    else fp8_lines<TB, kScaledX>(t.data, c0, c1, xw, part);
    const __m256 s = _mm256_set1_ps(t.scales[kb] * kFp8Rebias);
    const int pairs = lines_per_block / 2;
    constexpr float kNoFix[kRows] = {};
    float fix[TB][kRows];
    bool fixed = false;
    for (int q = 0; q < pairs; q += 32)
      for (uint64_t flagged = pair_flags(t, c0 / 2 + q, std::min(32, pairs - q)); flagged; flagged &= flagged - 1) {
        if (!fixed) std::fill(&fix[0][0], &fix[0][0] + TB * kRows, 0.0f);
        fixed = true;
        const int c = c0 + 2 * (q + __builtin_ctzll(flagged));
        fix_fp8_pair<TB>(t.data + int64_t(c) * 64, c, fp8_tables().f32, xb, fix);
      }
    for (int i = 0; i < TB; ++i)
      for (int h = 0; h < 2; ++h)
        add_fp8_rows(part[i][h][0], part[i][h][1], (fixed ? fix[i] : kNoFix) + 8 * h, s,
                     out + i * kRows + 8 * h);
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

// u8 activations (widened to int16) x s8 weights (widened per line): vpmaddwd pair sums are exact, where
// vpmaddubsw would saturate. acc[q] lanes 2j, 2j + 1 hold row 4q + j's pair sums.
template <int TB>
AVX2_TARGET void dot_int8(const Tile& t, const Act& a, const int* rows, const int16_t* const* x, float* out) {
  __m256i acc[TB][4];
  for (int i = 0; i < TB; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_si256();
  for (int c = 0; c < t.kp / 4; ++c) {
    const uint8_t* line = t.data + int64_t(c) * 64;
    stream_prefetch_avx2(line);
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
      stream_prefetch_avx2(line);
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
    stream_prefetch_avx2(lines + chunks * 64);
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

}  // namespace

int avx2_row_block(Format f, int64_t kp, int n) {
  return wide_row_block(f, kp, n, 320 << 10, 6);  // within the L2 of every AVX2 CPU
}

void widen_rows_avx2(Format f, const Act& a, const int* rows, int n, WideRows& wide) {
  wide.scaled = false;
  if (f == Format::kFP8) {
    bool huge = false;
    for (int i = 0; i < n && !huge; ++i) huge = has_huge(a.bf + int64_t(rows[i]) * a.kp, a.kp);
    wide.scaled = !huge;
  }
  const float scale = wide.scaled ? kRawToRebias : 1.0f;
  widen_rows(f, Isa::kAvx2, a, rows, n, wide, [scale](const uint16_t* src, int64_t kp, float* dst) {
    widen_fp8_row(src, kp, scale, dst);
  });
}

void tile_dot_avx2(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                   const WideRows& wide, float* out) {
  if (f == Format::kINT4)
    return in_blocks<2>(n, [&]<int TB>(int i) { dot_int4<TB>(t, group, a, rows + i, out + i * kRows); });
  if (f == Format::kINT8) {
    return in_blocks<2>(n, [&]<int TB>(int i) {
      const int16_t* x[TB];
      for (int j = 0; j < TB; ++j) x[j] = wide.i16.data() + int64_t(i + j) * a.kp;
      dot_int8<TB>(t, a, rows + i, x, out + i * kRows);
    });
  }
  if (f == Format::kBF16) {
    return in_blocks<4>(n, [&]<int TB>(int i) {
      const float* x[TB];
      for (int j = 0; j < TB; ++j) x[j] = wide.f32.data() + (i + j) * wide.f32_row;
      dot_bf16<TB>(t, x, out + i * kRows);
    });
  }
  // fp8: tokens in groups of three or four where there are three or more (balanced: 5 = 3 + 2, 6 = 3 + 3).
  const auto fp8 = [&]<int TB>(int i) {
    const float* xw[TB];
    const uint16_t* xb[TB];
    for (int j = 0; j < TB; ++j) {
      xw[j] = wide.f32.data() + (i + j) * wide.f32_row;
      xb[j] = a.bf + int64_t(rows[i + j]) * a.kp;
    }
    if (wide.scaled) dot_fp8<TB, true>(t, block_k, xw, xb, out + i * kRows);
    else dot_fp8<TB, false>(t, block_k, xw, xb, out + i * kRows);
  };
  const int groups = (n + 3) / 4;
  for (int g = 0, i = 0; g < groups; ++g) {
    const int size = n / groups + (g < n % groups ? 1 : 0);
    if (size == 4) fp8.template operator()<4>(i);
    else if (size == 3) fp8.template operator()<3>(i);
    else if (size == 2) fp8.template operator()<2>(i);
    else fp8.template operator()<1>(i);
    i += size;
  }
}

}  // namespace hybridd
