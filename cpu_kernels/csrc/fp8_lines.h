// The fp8 e4m3 -> bf16 conversion the kernels share: the few-token decode loop, prefill's scaled lines and
// the AMX kernels' unscaled lines. Everything here inlines into its callers' loops.
#pragma once

#include "moe.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace hybridd {

#define AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vnni,gfni")))

// Prefetch for the loops that stream weights from memory, called once per 64-byte line: into L2 16 KB ahead
// and into L1 2 KB ahead. Measured on Emerald Rapids, one thread of the fp8 decode loop over 1 GB: 0.90 of
// the read bandwidth with both, 0.80 with L1 prefetches 4 KB ahead alone, 0.48 with none (the hardware
// prefetchers do not run far enough ahead of a loop this dense). The AVX-512 tile dots call it at every token
// block size: when it stopped at 4 tokens, Emerald Rapids streamed int8 experts with 5-7 tokens at 0.59-0.66 of
// the bandwidth against 0.72-1.0 with it, int4 with 5-11 at 0.37-0.49 against 0.43-0.69, and the avx512_bf16
// path forced there bf16 with 5-8 at 0.42-0.53 against 0.76-0.94.
inline void stream_prefetch(const void* line) {
  const char* p = static_cast<const char*>(line);
  _mm_prefetch(p + 16384, _MM_HINT_T2);
  _mm_prefetch(p + 2048, _MM_HINT_T0);
}

// The avx2 path's prefetch: into L1 2 KB ahead only. Measured on a 2-core Zen 3 EPYC (both threads over 1 GB,
// with and without in one process, alternating): without the L2 prefetch the fp8 loop ran 5-11 % faster at
// one to four tokens, bf16 and int4 0-10 %, int8 unchanged; without either prefetch, 8-18 % slower.
inline void stream_prefetch_avx2(const void* line) {
  _mm_prefetch(static_cast<const char*>(line) + 2048, _MM_HINT_T0);
}

// fp8 lines from fp8_pair hold each code's value times 2^-8; the block scales applied to them are multiplied
// by this to undo it.
constexpr float kFp8LineScale = 256.0f;

// The avx512 and avx2 paths' fp8 kernels sum products of each code's value times 2^-24; the block scales
// applied to those sums are multiplied by this to undo it.
constexpr float kFp8Rebias = 16777216.0f;

// Whether line pair `pair` of a tile holds a code the fast conversions get wrong (fp8_code_needs_tables).
inline bool pair_flagged(const Tile& t, int pair) {
  const int64_t p = int64_t(t.pair0) + pair;
  return (t.flags[p >> 3] >> (p & 7)) & 1;
}

struct Fp8Tables {
  float f32[256];
  alignas(64) uint8_t hi[128];  // bf16 high byte of the code's magnitude (sign added separately)
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi_scaled[128];  // the same for the magnitude / kFp8LineScale
  alignas(64) uint8_t lo_scaled[128];
  Fp8Tables();
};
const Fp8Tables& fp8_tables();


struct Fp8Regs {
  __m512i lo0, lo1, hi0, hi1, sign;
};

AVX512_TARGET inline Fp8Regs fp8_regs(bool scaled = false) {
  const auto& tab = fp8_tables();
  const uint8_t* lo = scaled ? tab.lo_scaled : tab.lo;
  const uint8_t* hi = scaled ? tab.hi_scaled : tab.hi;
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64),
          _mm512_set1_epi8(static_cast<char>(0x80))};
}

// 64 e4m3 bytes -> two bf16 lines (k pairs 2c and 2c + 1 of 16 rows), exact for every code.
AVX512_TARGET inline void fp8_line(const Fp8Regs& r, const uint8_t* p, __m512bh& first, __m512bh& second) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(r.lo0, v, r.lo1);
  __m512i hi = _mm512_permutex2var_epi8(r.hi0, v, r.hi1);
  hi = _mm512_ternarylogic_epi32(hi, v, r.sign, 0xF8);  // hi | (v & 0x80)
  first = as_bh(_mm512_unpacklo_epi8(lo, hi));
  second = as_bh(_mm512_unpackhi_epi8(lo, hi));
}

// gf2p8affine matrix whose output bit i is input bit from[i] (-1: zero); row i sits in byte 7 - i.
constexpr int64_t gf2_bit_map(const int (&from)[8]) {
  uint64_t m = 0;
  for (int i = 0; i < 8; ++i)
    if (from[i] >= 0) m |= uint64_t(1) << (8 * (7 - i) + from[i]);
  return static_cast<int64_t>(m);
}

// The conversion of the few-token loops and of prefill's scaled lines. A code s.eeee.mmm with e > 0 is
// 2^(e-7) * 1.mmm, and the bf16 word s.0111eeee.mmm0000 is that times 2^-8: its high byte is s | 0x38 | e3e2e1
// and its low byte e0.mmm.0000, each one GF(2) affine map of the code's bits, two instructions for 64 codes
// where the tables take two three-uop byte permutes and a blend. Zero, subnormal and NaN codes do not fit the
// pattern: a line pair holding one, flagged when it was packed (fp8_code_needs_tables), is converted by the
// tables, scaled alike. Testing the codes here instead cost ~18 % of the decode loop.
struct Fp8Fast {
  __m512i hi_map, lo_map;
  Fp8Regs exact;
};

AVX512_TARGET inline Fp8Fast fp8_fast() {
  constexpr int64_t kHi = gf2_bit_map({4, 5, 6, -1, -1, -1, -1, 7});
  constexpr int64_t kLo = gf2_bit_map({-1, -1, -1, -1, 0, 1, 2, 3});
  return {_mm512_set1_epi64(kHi), _mm512_set1_epi64(kLo), fp8_regs(true)};
}

// The flags of line pairs [pair, pair + count) of t (count <= 32), the first in bit 0.
inline uint64_t pair_flags(const Tile& t, int pair, int count) {
  const int64_t p = int64_t(t.pair0) + pair;
  const int first = static_cast<int>(p & 7), bytes = (first + count + 7) / 8;  // at most 5
  uint64_t v = 0;
  for (int i = 0; i < 5; ++i)
    if (i < bytes) v |= uint64_t(t.flags[(p >> 3) + i]) << (8 * i);
  return (v >> first) & ((uint64_t(1) << count) - 1);
}

// body(c, tables) for the line pairs c = begin, begin + 2, .., end - 2 of t (begin even), tables for the flagged
// ones; the runs of pairs between flagged ones go without a test per pair.
template <typename Body>
AVX512_TARGET inline void for_line_pairs(const Tile& t, int begin, int end, Body&& body) {
  for (int g = begin; g < end; g += 64) {
    const int stop = std::min(end, g + 64);
    uint64_t flags = pair_flags(t, g / 2, (stop - g) / 2);
    int c = g;
    for (; flags; flags &= flags - 1) {
      const int flagged = g + 2 * __builtin_ctzll(flags);
      for (; c < flagged; c += 2) body(c, false);
      body(c, true);
      c += 2;
    }
    for (; c < stop; c += 2) body(c, false);
  }
}

// Lines p and p + 64 (a flagged pair when `tables`) -> out[0..4): bf16 lines of k pairs 2c, 2c + 1 of the
// first line, then of the second, holding the codes' values / kFp8LineScale.
AVX512_TARGET inline void fp8_pair(const Fp8Fast& r, const uint8_t* p, bool tables, __m512bh* out) {
  if (__builtin_expect(tables, 0)) {
    fp8_line(r.exact, p, out[0], out[1]);
    fp8_line(r.exact, p + 64, out[2], out[3]);
    return;
  }
  const __m512i v = _mm512_loadu_si512(p), w = _mm512_loadu_si512(p + 64);
  const __m512i hv = _mm512_gf2p8affine_epi64_epi8(v, r.hi_map, 0x38);
  const __m512i lv = _mm512_gf2p8affine_epi64_epi8(v, r.lo_map, 0);
  const __m512i hw = _mm512_gf2p8affine_epi64_epi8(w, r.hi_map, 0x38);
  const __m512i lw = _mm512_gf2p8affine_epi64_epi8(w, r.lo_map, 0);
  out[0] = as_bh(_mm512_unpacklo_epi8(lv, hv));
  out[1] = as_bh(_mm512_unpackhi_epi8(lv, hv));
  out[2] = as_bh(_mm512_unpacklo_epi8(lw, hw));
  out[3] = as_bh(_mm512_unpackhi_epi8(lw, hw));
}

// body(c, quad) for every line pair c of a whole tile streamed from memory, quad its four bf16 lines (k pairs
// 2c .. 2c + 3) of the codes' values / kFp8LineScale: the conversion loop of the stored-lines kernels.
template <typename Body>
AVX512_TARGET inline void for_converted_pairs(const Fp8Fast& r, const Tile& t, Body&& body) {
  for_line_pairs(t, 0, t.kp / 4, [&](int c, bool tables) AVX512_TARGET {
    stream_prefetch(t.data + c * 64);
    stream_prefetch(t.data + c * 64 + 64);
    __m512bh quad[4];
    fp8_pair(r, t.data + c * 64, tables, quad);
    body(c, quad);
  });
}

// Columns of an fp8 tile as bf16 lines in the bf16 tile layout, exact: every code's value / kFp8LineScale.
AVX512_TARGET inline void fp8_fast_lines(const Fp8Fast& r, const Tile& t, uint16_t* lines) {
  for_converted_pairs(r, t, [&](int c, const __m512bh* quad) AVX512_TARGET {
    for (int h = 0; h < 4; ++h) _mm512_storeu_si512(lines + (2 * c + h) * 32, reinterpret_cast<__m512i>(quad[h]));
  });
}

}  // namespace hybridd
