#include "moe.h"

#include "amx.h"
#include "cache_aligned.h"
#include "fp8_lines.h"
#include "row_ops.h"
#include "simd_math.h"
#include "tile_dot_avx2.h"
#include "tile_dot_avx512f.h"
#include "tile_dot_vnni.h"
#include "token_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

namespace hybridd {

namespace {

// Whether a block of n rows goes to the AMX kernels: on the amx path, from these heights (measured end to end
// on Emerald Rapids, where one vdpbf16ps issues about every second cycle). bf16 / fp8 (tile_span) win from 4
// rows: fp8 12-25 % faster than AVX-512 at 2-8 rows per expert on average, even at 1-2 (DeepSeek T=8); int8
// wins from 8; int4's kernel also unpacks the nibbles and pays a dequantizing epilogue per group, and wins
// from 12.
inline bool amx_rows(Isa isa, Format f, int n) {
  return isa == Isa::kAmx && n >= (f == Format::kINT4 ? 12 : (f == Format::kINT8 ? 8 : 4));
}

// e4m3fn: bias 7, no infinities, S.1111.111 is NaN; exp 0 is subnormal (m / 8 * 2^-6).
float e4m3_to_f32(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float mag;
  if (exp == 0xf && man == 7) mag = std::nanf("");
  else if (exp == 0) mag = std::ldexp(static_cast<float>(man), -9);
  else mag = std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

inline Tile tile_of(const PackedMatrices& m, int expert, int tile, Format f, int block_k, int group) {
  int64_t tile_bytes;
  int scales_per_tile = 0;
  switch (f) {
    case Format::kBF16: tile_bytes = int64_t(m.kp) * kRows * 2; break;
    case Format::kFP8: tile_bytes = int64_t(m.kp) * kRows; scales_per_tile = m.kp / block_k; break;
    case Format::kINT8: tile_bytes = int64_t(m.kp) * kRows; scales_per_tile = kRows; break;
    default: tile_bytes = int64_t(m.kp / group) * (group / 8 + 1) * 64; break;  // scales inside the stream
  }
  Tile t;
  t.data = m.data + expert * m.data_stride + tile * tile_bytes;
  t.scales = m.scales ? m.scales + expert * m.scales_stride + int64_t(tile) * scales_per_tile : nullptr;
  t.comp = m.comp ? m.comp + expert * m.comp_stride + int64_t(tile) * kRows : nullptr;
  t.kp = m.kp;
  t.flags = m.flags ? m.flags + expert * m.flags_stride + tile * fp8_flag_bytes(m.kp) : nullptr;
  return t;
}

// ---------------------------------------------------------------------------------------------------------
// Generic kernels: plain C++ over the same layouts, for CPUs without AVX-512 or AVX2.

__attribute__((target_clones("avx512f", "avx2", "default")))
void tile_dot_generic(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                      float* out) {
  const auto& tab = fp8_tables();
  for (int i = 0; i < n; ++i) {
    float acc[kRows] = {0};
    const int64_t r0 = int64_t(rows[i]) * a.kp;
    if (f == Format::kBF16 || f == Format::kFP8) {
      const uint16_t* x = a.bf + r0;
      const int kb = f == Format::kFP8 ? block_k : t.kp;
      for (int k0 = 0; k0 < t.kp; k0 += kb) {
        float part[kRows] = {0};
        for (int k = k0; k < k0 + kb; ++k) {
          const float xv = bf16_to_f32(x[k]);
          for (int r = 0; r < kRows; ++r) {
            float w;
            if (f == Format::kBF16) {
              w = bf16_to_f32(reinterpret_cast<const uint16_t*>(t.data)[(k / 2) * 32 + r * 2 + (k & 1)]);
            } else {
              const int c = k / 4, h = (k / 2) & 1, lane = r / 4, ri = r % 4;
              w = tab.f32[t.data[c * 64 + 16 * lane + 8 * h + 2 * ri + (k & 1)]];
            }
            part[r] += w * xv;
          }
        }
        const float s = f == Format::kFP8 ? t.scales[k0 / kb] : 1.0f;
        for (int r = 0; r < kRows; ++r) acc[r] += part[r] * s;
      }
    } else if (f == Format::kINT8) {
      const uint8_t* x = reinterpret_cast<const uint8_t*>(a.q) + r0;
      int32_t iacc[kRows] = {0};
      for (int k = 0; k < t.kp; ++k)
        for (int r = 0; r < kRows; ++r)
          iacc[r] += int32_t(x[k]) * int32_t(static_cast<int8_t>(t.data[(k / 4) * 64 + r * 4 + (k & 3)]));
      for (int r = 0; r < kRows; ++r) acc[r] = float(iacc[r] - t.comp[r]) * t.scales[r] * a.scale[rows[i]];
    } else {
      const int8_t* x = a.q + r0;
      const int chunks = group / 8;
      for (int g = 0; g < t.kp / group; ++g) {
        const uint8_t* lines = t.data + int64_t(g) * (chunks + 1) * 64;
        const float* gs = reinterpret_cast<const float*>(lines + chunks * 64);
        int32_t iacc[kRows] = {0};
        for (int k = g * group; k < (g + 1) * group; ++k) {
          const int c = (k % group) / 8, j = k % 8;
          for (int r = 0; r < kRows; ++r) {
            const uint8_t byte = lines[c * 64 + r * 4 + (j & 3)];
            iacc[r] += int32_t(j < 4 ? (byte & 0xf) : (byte >> 4)) * int32_t(x[k]);
          }
        }
        const int32_t corr = 8 * a.gsum[int64_t(rows[i]) * a.ngroups + g];
        for (int r = 0; r < kRows; ++r) acc[r] += float(iacc[r] - corr) * (gs[r] * a.scale[rows[i]]);
      }
    }
    std::memcpy(out + i * kRows, acc, sizeof(acc));
  }
}

// ---------------------------------------------------------------------------------------------------------
// The bf16 / fp8 kernels of the avx512_bf16 and amx paths (AVX-512 BF16 + VBMI + GFNI: Zen 4, Sapphire Rapids
// and later); their int formats run tile_dot_vnni.cpp. TB tokens share each weight load.

template <int TB>
AVX512_TARGET void dot_bf16(const Tile& t, const uint16_t* const* x, float* out) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(t.data);
  const int pairs = t.kp / 2;
  if constexpr (TB == 1) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int p = 0;
    for (; p + 4 <= pairs; p += 4) {
      for (int l = 0; l < 4; ++l)
        stream_prefetch(w + (p + l) * 32);
      a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(w + (p + 0) * 32)), as_bh(bcast32(x[0] + 2 * p)));
      a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_loadu_si512(w + (p + 1) * 32)), as_bh(bcast32(x[0] + 2 * p + 2)));
      a2 = _mm512_dpbf16_ps(a2, as_bh(_mm512_loadu_si512(w + (p + 2) * 32)), as_bh(bcast32(x[0] + 2 * p + 4)));
      a3 = _mm512_dpbf16_ps(a3, as_bh(_mm512_loadu_si512(w + (p + 3) * 32)), as_bh(bcast32(x[0] + 2 * p + 6)));
    }
    for (; p < pairs; ++p)
      a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(w + p * 32)), as_bh(bcast32(x[0] + 2 * p)));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  } else {
    __m512 acc[TB];
    for (int i = 0; i < TB; ++i) acc[i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
      stream_prefetch(w + p * 32);
      const __m512bh wv = as_bh(_mm512_loadu_si512(w + p * 32));
      for (int i = 0; i < TB; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], wv, as_bh(bcast32(x[i] + 2 * p)));
    }
    for (int i = 0; i < TB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
  }
}

template <int TB>
AVX512_TARGET void dot_fp8(const Tile& t, int block_k, const uint16_t* const* x, float* out) {
  const Fp8Fast conv = fp8_fast();
  const int lines_per_block = block_k / 4;  // even: block_k is a multiple of 16
  __m512 acc[TB];
  for (int i = 0; i < TB; ++i) acc[i] = _mm512_setzero_ps();
  for (int kb = 0; kb < t.kp / block_k; ++kb) {
    // Independent vdpbf16ps chains per token, enough to hide its latency at every token count.
    constexpr int kChains = TB == 1 ? 4 : (TB == 2 ? 2 : 1);
    __m512 part[TB][kChains];
    for (int i = 0; i < TB; ++i)
      for (int j = 0; j < kChains; ++j) part[i][j] = _mm512_setzero_ps();
    for_line_pairs(t, kb * lines_per_block, (kb + 1) * lines_per_block, [&](int c, bool tables) AVX512_TARGET {
      const uint8_t* line = t.data + int64_t(c) * 64;
      stream_prefetch(line);
      stream_prefetch(line + 64);
      __m512bh w[4];
      fp8_pair(conv, line, tables, w);
      const int k = 4 * c;
      for (int i = 0; i < TB; ++i)
        for (int j = 0; j < 4; ++j)
          part[i][j % kChains] = _mm512_dpbf16_ps(part[i][j % kChains], w[j], as_bh(bcast32(x[i] + k + 2 * j)));
    });
    const __m512 s = _mm512_set1_ps(t.scales[kb] * kFp8LineScale);
    for (int i = 0; i < TB; ++i) {
      __m512 sum = part[i][0];
      for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, part[i][j]);
      acc[i] = _mm512_fmadd_ps(sum, s, acc[i]);
    }
  }
  for (int i = 0; i < TB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
}

// bf16 and fp8 tiles; the int formats go to tile_dot_vnni.
template <int TB>
AVX512_TARGET void tile_dot_block(Format f, const Tile& t, int block_k, const Act& a, const int* rows, float* out) {
  const uint16_t* x[TB];
  for (int i = 0; i < TB; ++i) x[i] = a.bf + int64_t(rows[i]) * a.kp;
  if (f == Format::kBF16) dot_bf16<TB>(t, x, out);
  else dot_fp8<TB>(t, block_k, x, out);
}

AVX512_TARGET void tile_dot_avx512(Format f, const Tile& t, int block_k, const Act& a, const int* rows, int n,
                                   float* out) {
  for_token_blocks(n, [&](auto tb, int b) AVX512_TARGET {
    tile_dot_block<decltype(tb)::value>(f, t, block_k, a, rows + b, out + b * kRows);
  });
}

// One fp8 tile (or column range of one) converted to bf16 lines once, so many token blocks reuse it.
AVX512_TARGET void fp8_tile_to_lines(const Tile& t, uint16_t* lines) {
  const Fp8Regs regs = fp8_regs();
  for (int c = 0; c < t.kp / 4; ++c) {
    stream_prefetch(t.data + c * 64);
    __m512bh a, b;
    fp8_line(regs, t.data + c * 64, a, b);
    _mm512_storeu_si512(lines + (2 * c) * 32, reinterpret_cast<__m512i>(a));
    _mm512_storeu_si512(lines + (2 * c + 1) * 32, reinterpret_cast<__m512i>(b));
  }
}

// fp8 lines with their block scale multiplied in and rounded to bf16 (one rounding per weight, like the
// bf16 activations they meet): the prefill inner loop then needs no per-block rescaling.
AVX512_TARGET void fp8_tile_to_scaled_lines(const Tile& t, const float* scales, int block_k, uint16_t* lines) {
  const Fp8Fast conv = fp8_fast();
  const __m512i zero = _mm512_setzero_si512(), order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
  // kp is a multiple of 16: whole line pairs
  for_converted_pairs(conv, t, [&](int c, const __m512bh* quad) AVX512_TARGET {
    const __m512 s = _mm512_set1_ps(scales[(4 * c) / block_k] * kFp8LineScale);
    for (int h = 0; h < 4; ++h) {
      // Words 0-3 and 4-7 of each 128-bit lane widened in place; the packed result's qwords come back in
      // lane order 0, 2, 4, 6, 1, 3, 5, 7.
      const __m512i v = reinterpret_cast<__m512i>(quad[h]);
      const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)), s);
      const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)), s);
      const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      _mm512_storeu_si512(lines + (2 * c + h) * 32, _mm512_permutexvar_epi64(order, packed));
    }
  });
}

// Prefill: NT weight tiles (gate and up tiles of two row blocks, or adjacent down tiles) share every
// activation broadcast: per k pair NT line loads and TB broadcasts feed NT * TB vdpbf16ps.
// Lines are bf16 [kp/2][32]; with kScaled, each block_k columns form one partial sum scaled by that
// block's factor (fp8 blocks) and added to out[j] [TB][16]; without, the sums are stored.
template <int NT, int TB, bool kScaled>
AVX512_TARGET void dotn_lines(const uint16_t* const* w, const float* const* s, int kp, int block_k,
                              const uint16_t* const* x, float* const* out) {
  const int block = kScaled ? block_k : kp;
  for (int kb = 0; kb < kp / block; ++kb) {
    __m512 acc[NT][TB];
    for (int j = 0; j < NT; ++j)
      for (int i = 0; i < TB; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int p = kb * block / 2; p < (kb + 1) * block / 2; ++p) {
      __m512bh line[NT];
      for (int j = 0; j < NT; ++j) line[j] = as_bh(_mm512_loadu_si512(w[j] + p * 32));
      for (int i = 0; i < TB; ++i) {
        const __m512bh xv = as_bh(bcast32(x[i] + 2 * p));
        for (int j = 0; j < NT; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], line[j], xv);
      }
    }
    for (int j = 0; j < NT; ++j)
      for (int i = 0; i < TB; ++i) {
        float* o = out[j] + i * kRows;
        if (kScaled) _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[j][i], _mm512_set1_ps(s[j][kb]), _mm512_loadu_ps(o)));
        else _mm512_storeu_ps(o, acc[j][i]);
      }
  }
}

// TB rows (tokens) x columns [k0, k0 + kp) of NT tiles; s[j] are tile j's scales for that column range.
template <int NT, int TB>
AVX512_TARGET void dotn_block(bool scaled, const uint16_t* const* w, const float* const* s, int k0, int kp,
                              int block_k, const Act& a, const int* rows, float* const* out, int row0) {
  const uint16_t* x[TB];
  float* o[NT];
  for (int i = 0; i < TB; ++i) x[i] = a.bf + int64_t(rows[row0 + i]) * a.kp + k0;
  for (int j = 0; j < NT; ++j) o[j] = out[j] + row0 * kRows;
  if (scaled) dotn_lines<NT, TB, true>(w, s, kp, block_k, x, o);
  else dotn_lines<NT, TB, false>(w, s, kp, block_k, x, o);
}

template <int NT, int TB>
AVX512_TARGET void dotn_tail(int rest, bool scaled, const uint16_t* const* w, const float* const* s, int k0, int kp,
                             int block_k, const Act& a, const int* rows, float* const* out, int row0) {
  if constexpr (TB > 0) {
    if (rest == TB) dotn_block<NT, TB>(scaled, w, s, k0, kp, block_k, a, rows, out, row0);
    else dotn_tail<NT, TB - 1>(rest, scaled, w, s, k0, kp, block_k, a, rows, out, row0);
  }
}

template <int NT>
AVX512_TARGET void dotn_rows(bool scaled, const uint16_t* const* w, const float* const* s, int k0, int kp,
                             int block_k, const Act& a, const int* rows, int n, float* const* out) {
  constexpr int kTB = NT >= 4 ? 6 : 8;  // NT * kTB accumulators + NT lines + 1 broadcast fit 32 registers
  int i = 0;
  for (; i + kTB <= n; i += kTB) dotn_block<NT, kTB>(scaled, w, s, k0, kp, block_k, a, rows, out, i);
  dotn_tail<NT, kTB - 1>(n - i, scaled, w, s, k0, kp, block_k, a, rows, out, i);
}

// Columns converted per step in the fp8 prefill path, so the tiles' bf16 lines stay in L2.
constexpr int kFp8ChunkColumns = 1024;

// Many tokens against NT bf16 or fp8 tiles. fp8 tiles are converted chunk by chunk of columns into
// `scratch` (NT * min(kp, chunk) * 16 bf16) and every token block runs over a chunk before the next.
template <int NT>
AVX512_TARGET void tile_dotn_avx512(Format f, const Tile* t, int block_k, const Act& a, const int* rows, int n,
                                    float* const* out, uint16_t* scratch) {
  const uint16_t* w[NT];
  const float* s[NT] = {};
  if (f != Format::kFP8) {
    for (int j = 0; j < NT; ++j) w[j] = reinterpret_cast<const uint16_t*>(t[j].data);
    dotn_rows<NT>(false, w, s, 0, t[0].kp, block_k, a, rows, n, out);
    return;
  }
  for (int j = 0; j < NT; ++j) std::memset(out[j], 0, sizeof(float) * n * kRows);
  const int chunk = std::min(t[0].kp, std::max(block_k, kFp8ChunkColumns / block_k * block_k));
  static const float kOne = 1.0f;
  for (int k0 = 0; k0 < t[0].kp; k0 += chunk) {
    const int klen = std::min(chunk, t[0].kp - k0);
    for (int j = 0; j < NT; ++j) {
      uint16_t* lines = scratch + size_t(j) * chunk * kRows;
      const Tile part = fp8_columns(t[j], k0, klen);
      if (a.exact) {
        fp8_tile_to_lines(part, lines);
        s[j] = t[j].scales + k0 / block_k;
      } else {
        fp8_tile_to_scaled_lines(part, t[j].scales + k0 / block_k, block_k, lines);
        s[j] = &kOne;
      }
      w[j] = lines;
    }
    // bf16 activations: the block scales are already in the weights, so the chunk is one partial sum.
    dotn_rows<NT>(true, w, s, k0, klen, a.exact ? block_k : klen, a, rows, n, out);
  }
}

// Rows of one expert against nt (1, 2 or 4) tiles of the same column count: the shared-broadcast prefill
// kernel where it pays (bf16/fp8 on AVX-512 with more than one token block), else one tile at a time.
// `scratch` holds nt * kp * 16 bf16.
void tile_dot_multi(Isa isa, Format f, const Tile* tiles, int nt, int block_k, int group, const Act& a,
                    const int* rows, int n, float* const* outs, uint16_t* scratch);

void tile_dot(Isa isa, Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
              float* out) {
  if (int_format(f) && vnni(isa)) tile_dot_vnni(f, t, group, a, rows, n, out);
  else if (avx512_bf16(isa)) tile_dot_avx512(f, t, block_k, a, rows, n, out);
  else tile_dot_generic(f, t, block_k, group, a, rows, n, out);
}

void tile_dot_multi(Isa isa, Format f, const Tile* tiles, int nt, int block_k, int group, const Act& a,
                    const int* rows, int n, float* const* outs, uint16_t* scratch) {
  if (amx_rows(isa, f, n) && amx_handles(f, block_k, group, tiles[0].kp)) {
    tile_dotn_amx(f, tiles, nt, block_k, group, a, rows, n, outs, scratch);
    return;
  }
  if (avx512_bf16(isa) && (f == Format::kBF16 || f == Format::kFP8) && n > kTokenBlock) {
    if (nt == 4) tile_dotn_avx512<4>(f, tiles, block_k, a, rows, n, outs, scratch);
    else if (nt == 2) tile_dotn_avx512<2>(f, tiles, block_k, a, rows, n, outs, scratch);
    else tile_dotn_avx512<1>(f, tiles, block_k, a, rows, n, outs, scratch);
    return;
  }
  for (int j = 0; j < nt; ++j)
    for (int b = 0; b < n; b += kTokenBlock)
      tile_dot(isa, f, tiles[j], block_k, group, a, rows + b, std::min(kTokenBlock, n - b), outs[j] + b * kRows);
}

void check_flags(Format f, const PackedMatrices& m) {
  if (f == Format::kFP8 && !m.flags) throw std::invalid_argument("fp8 weights need their line pair flags");
}

}  // namespace

Fp8Tables::Fp8Tables() {
  for (int v = 0; v < 256; ++v) f32[v] = e4m3_to_f32(static_cast<uint8_t>(v));
  for (int v = 0; v < 128; ++v) {
    // Every finite e4m3 value is exact in bf16 (3 mantissa bits, exponents 2^-9..2^8), also over 256.
    const uint16_t b = (v == 0x7f) ? 0x7fc0 : static_cast<uint16_t>(f32_to_bf16(f32[v]));
    const uint16_t bs = (v == 0x7f) ? 0x7fc0 : static_cast<uint16_t>(f32_to_bf16(f32[v] / kFp8LineScale));
    hi[v] = static_cast<uint8_t>(b >> 8);
    lo[v] = static_cast<uint8_t>(b & 0xff);
    hi_scaled[v] = static_cast<uint8_t>(bs >> 8);
    lo_scaled[v] = static_cast<uint8_t>(bs & 0xff);
  }
}

const Fp8Tables& fp8_tables() {
  static const Fp8Tables t;
  return t;
}

void convert_fp8_tile(const Tile& t, const float* scales, int block_k, uint16_t* lines) {
  if (scales) fp8_tile_to_scaled_lines(t, scales, block_k, lines);
  else fp8_tile_to_lines(t, lines);
}

void fp8_to_bf16_lines(const uint8_t* src, int64_t lines, uint16_t* dst, Isa isa) {
  check_isa(isa);
  if (avx512_bf16(isa)) {
    Tile t{src, nullptr, nullptr, static_cast<int>(lines * 4)};
    fp8_tile_to_lines(t, dst);
    return;
  }
  const auto& tab = fp8_tables();
  for (int64_t c = 0; c < lines; ++c)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < 2; ++j) {
          const uint8_t v = src[c * 64 + 16 * (r / 4) + 8 * h + 2 * (r % 4) + j];
          dst[(2 * c + h) * 32 + r * 2 + j] = (v & 0x7f) == 0x7f ? uint16_t((v & 0x80) << 8 | 0x7fc0)
                                                                  : f32_to_bf16(tab.f32[v]);
        }
}

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kGeneric: return true;
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAmx: return isa_supported(Isa::kAvx512Bf16) && amx_usable();
    case Isa::kAvx512:
      return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case Isa::kAvx512Vnni: return isa_supported(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512Bf16:
      return isa_supported(Isa::kAvx512Vnni) && __builtin_cpu_supports("avx512bf16") &&
             __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  }
  return false;
}

void check_isa(Isa isa) {
  if (!isa_supported(isa))
    throw std::invalid_argument(std::string("this CPU cannot run the ") + isa_name(isa) + " kernels");
}

Isa best_isa() {
  if (isa_supported(Isa::kAmx)) return Isa::kAmx;
  if (isa_supported(Isa::kAvx512Bf16)) return Isa::kAvx512Bf16;
  if (isa_supported(Isa::kAvx512Vnni)) return Isa::kAvx512Vnni;
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  return isa_supported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kGeneric;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAmx: return "amx";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

// Work below this many elements runs on the calling thread: waking the pool costs more than it saves.
constexpr int64_t kInlineElements = 1 << 16;

void MoeRunner::run(int ntasks, int64_t elements, const std::function<void(int, int)>& fn) {
  if (elements < kInlineElements) {
    for (int t = 0; t < ntasks; ++t) fn(t, 0);
    return;
  }
  pool_.run(ntasks, fn);
}

void MoeRunner::run_rows(int64_t rows, int64_t elements_per_row, const std::function<void(int64_t, int64_t)>& fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int tasks = static_cast<int>(std::min<int64_t>(rows, 4 * num_threads()));
  run(tasks, rows * elements_per_row, [&](int t, int) { fn(rows * t / tasks, rows * (t + 1) / tasks); });
}

Act MoeRunner::prepare_input(Format f, int group, const void* x, bool f32_io, int T, int K, int kp, int R,
                             Isa isa) {
  const size_t in_bytes = f32_io ? 4 : 2;
  const auto row_in = [&](int t) { return static_cast<const uint8_t*>(x) + size_t(t) * K * in_bytes; };
  thread_local std::vector<float> row;
  Act xa;
  xa.kp = kp;
  xa.exact = R == 2;
  if (f == Format::kBF16 || f == Format::kFP8) {
    if (R == 1 && kp == K && !f32_io) {
      xa.bf = static_cast<const uint16_t*>(x);
      return xa;
    }
    xbf_.assign((size_t(T) * R + kRows) * kp, 0);
    xa.padded = true;
    run(T, int64_t(T) * K, [&](int t, int) {
      uint16_t* dst = &xbf_[size_t(t) * R * kp];
      if (!f32_io && R == 1) {
        std::memcpy(dst, row_in(t), size_t(K) * 2);
        return;
      }
      row.resize(K);
      to_f32(isa, row_in(t), f32_io, K, row.data());
      split_bf16(isa, row.data(), K, dst, R == 2 ? dst + kp : nullptr);
    });
    xa.bf = xbf_.data();
    return xa;
  }
  xa.ngroups = kp / group;
  xq_.resize((size_t(T) + kRows) * kp);
  xa.padded = true;
  xscale_.resize(T);
  xgsum_.resize(size_t(T) * xa.ngroups);
  run(T, int64_t(T) * K, [&](int t, int) {
    row.resize(K);
    to_f32(isa, row_in(t), f32_io, K, row.data());
    quantize_row(isa, row.data(), K, kp, f, group, &xq_[size_t(t) * kp], &xscale_[t],
                 &xgsum_[size_t(t) * xa.ngroups]);
  });
  xa.q = xq_.data();
  xa.scale = xscale_.data();
  xa.gsum = xgsum_.data();
  return xa;
}

Act MoeRunner::sort_rows(const Act& a, const std::vector<int>& tok, const std::vector<int>& count,
                         const std::vector<int>& active, int R, const SortedRows& sorted) {
  const int used = static_cast<int>(tok.size());
  Act s = a;
  s.padded = true;
  const size_t kp = size_t(a.kp);
  if (a.bf) {
    std::vector<std::pair<int, int>> blocks;  // (expert, first row) of every expert's 16-row blocks
    for (int e : active)
      for (int p = 0; p < (count[e + 1] - count[e]) * R; p += kRows) blocks.push_back({e, p});
    sortbf_.resize((size_t(sorted.rows) + kRows) * kp);
    run(static_cast<int>(blocks.size()), int64_t(used) * R * a.kp, [&](int b, int) {
      const auto [e, p0] = blocks[b];
      const int m = std::min(kRows, (count[e + 1] - count[e]) * R - p0);
      const uint16_t* src[kRows];
      for (int i = 0; i < m; ++i) {
        const int p = p0 + i;
        src[i] = a.bf + (size_t(tok[count[e] + p / R]) * R + p % R) * kp;
      }
      uint16_t* dst = &sortbf_[(size_t(sorted.first[e]) + p0) * kp];
      if (sorted.packed[e]) pack_amx_block(src, m, a.kp, dst);
      else
        for (int i = 0; i < m; ++i) std::memcpy(dst + i * kp, src[i], sizeof(uint16_t) * kp);
    });
    s.bf = sortbf_.data();
    s.amx_packed = true;
    return s;
  }
  sortq_.resize((size_t(used) + kRows) * kp);
  sortscale_.resize(used);
  sortgsum_.resize(size_t(used) * a.ngroups);
  run(used, int64_t(used) * a.kp, [&](int r, int) {
    std::memcpy(&sortq_[size_t(r) * kp], a.q + size_t(tok[r]) * kp, kp);
    sortscale_[r] = a.scale[tok[r]];
    for (int g = 0; g < a.ngroups; ++g) sortgsum_[size_t(r) * a.ngroups + g] = a.gsum[size_t(tok[r]) * a.ngroups + g];
  });
  s.q = sortq_.data();
  s.scale = sortscale_.data();
  s.gsum = sortgsum_.data();
  return s;
}

// The tasks of one phase: `chunks` tile chunks of every active expert. With several NUMA nodes, node n's share
// of the task range (ThreadPool::run) holds chunk slice n of every expert, so a node always computes the
// same rows of every expert and is the one to first-touch their pages; with one node tasks go expert by
// expert, so consecutive tasks find the expert's activation rows in cache.
struct TaskGrid {
  int experts, chunks, nodes, per_node;

  TaskGrid(int experts_, int chunks_, int nodes_)
      : experts(experts_), chunks(chunks_), nodes(std::min(nodes_, chunks_)),
        per_node((chunks_ + nodes - 1) / nodes) {}
  int size() const { return nodes * experts * per_node; }
  // (index into the active experts, chunk) of a task; chunk -1 for an empty slot of a node's slice.
  std::pair<int, int> at(int task) const {
    const int node = task / (experts * per_node), r = task % (experts * per_node);
    const int chunk = node * per_node + r % per_node;
    return {r / per_node, chunk < chunks ? chunk : -1};
  }
};

// Tiles per task when `tiles` of each of `experts` experts are split among `threads`: long runs stream
// better, as long as every thread still gets about eight tasks. Measured at batch 1: 16 intermediate / 32
// hidden tiles per task read 7 % more of the bandwidth than 4 / 8, and 24 / 64 (where every expert has one
// row) another ~6 % on Qwen3-30B-A3B shapes, whose phases last well under a millisecond.
int tiles_per_task(int tiles, int experts, int threads, int longest) {
  return std::max(1, std::min({tiles, longest, tiles * experts / (8 * threads)}));
}

void MoeRunner::run_expert_tiles(const std::vector<int>& active, int tiles, int longest,
                                 const std::function<void(int, int, int)>& fn) {
  const int experts = static_cast<int>(active.size());
  const int per_task = tiles_per_task(tiles, experts, num_threads(), longest);
  const TaskGrid grid(experts, (tiles + per_task - 1) / per_task, num_nodes());
  pool_.run(grid.size(), [&](int task, int) {
    const auto [ei, chunk] = grid.at(task);
    if (chunk >= 0) fn(active[ei], chunk * per_task, std::min(tiles, (chunk + 1) * per_task));
  });
}

// The AMX kernels write their accumulators into these in place.
using TileResults = std::vector<AlignedVector<float>>;

// Per-thread scratch of one task: row ids, the results of its tiles and fp8 conversion lines.
struct TaskBuffers {
  std::vector<int> rows;
  TileResults ys;
  std::vector<uint16_t> scratch;

  // m rows of `tiles` results, in whole 16-row blocks (tile_span_amx writes the rows past m).
  void prepare(int m, int kp, int tiles) {
    rows.resize(m);
    ys.resize(std::max(ys.size(), size_t(tiles)));
    for (int j = 0; j < tiles; ++j) ys[j].resize(size_t(m + kRows - 1) / kRows * kRows * kRows);
    scratch.resize(size_t(4) * kp * kRows);
  }
};

TaskBuffers& task_buffers() {
  thread_local TaskBuffers buffers;
  return buffers;
}

// Whether tile_range runs an n-row product on tile_span_amx, which reads the activation rows packed as its
// operands (only the bf16 and fp8 formats qualify, whose rows are bf16: hi + lo pairs when exact).
bool spans_rows(Isa isa, Format f, bool exact, int block_k, int kp, int n) {
  return amx_rows(isa, f, n) && amx_spans(f, exact, block_k, kp);
}

// Where the sorted rows of the active experts go when the products of those of spans(m) rows (R per slot)
// read them packed.
template <typename Spans>
SortedRows sorted_rows(const std::vector<int>& count, const std::vector<int>& active, int R, Spans spans) {
  SortedRows s;
  s.first.assign(count.size() - 1, 0);
  s.packed.assign(count.size() - 1, 0);
  for (int e : active) {
    const int m = (count[e + 1] - count[e]) * R;
    s.first[e] = s.rows;
    s.packed[e] = spans(m);
    s.rows += s.packed[e] ? (m + kRows - 1) / kRows * kRows : m;
  }
  return s;
}

// The kernels that read activation rows widened beforehand (wide_rows.h).
struct WidePath {
  int (*row_block)(Format f, int64_t kp, int n);
  void (*widen)(Format f, const Act& a, const int* rows, int n, WideRows& wide);
  void (*dot)(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
              const WideRows& wide, float* out);
  // dot over two tiles at once, with the same bits; nullptr where the path has none
  void (*dot2)(Format f, const Tile* t, int block_k, int group, const Act& a, const int* rows, int n,
               const WideRows& wide, float* const* out);
};

const WidePath* wide_path(Isa isa, Format f) {
  static constexpr WidePath kAvx2Path{avx2_row_block, widen_rows_avx2, tile_dot_avx2, nullptr};
  static constexpr WidePath kAvx512Path{avx512f_row_block, widen_rows_avx512f, tile_dot_avx512f, tile_dot2_avx512f};
  if (isa == Isa::kAvx2) return &kAvx2Path;
  if (isa == Isa::kAvx512 || (isa == Isa::kAvx512Vnni && !int_format(f))) return &kAvx512Path;
  return nullptr;
}

// Runs tiles [t0, t1) of one matrix into out(tile) ([rows][16] fp32, whole 16-row blocks where tile_span_amx
// runs): all at once on tile_span_amx where it applies, on the avx2 and avx512 paths over each block of rows
// widened once (wide_path), else four (then two, then one) at a time; store(y, tile) takes each result, in
// tile order.
template <typename Out, typename Store>
void tile_range(Isa isa, Format f, const PackedMatrices& m, int expert, int t0, int t1, int block_k, int group,
                const Act& a, const int* rows, int n, uint16_t* scratch, Out out, Store store) {
  if (spans_rows(isa, f, a.exact, block_k, m.kp, n)) {
    std::vector<Tile> tiles;
    std::vector<float*> outs;
    for (int ti = t0; ti < t1; ++ti) {
      tiles.push_back(tile_of(m, expert, ti, f, block_k, group));
      outs.push_back(out(ti));
    }
    tile_span_amx(f, tiles.data(), t1 - t0, block_k, a, rows, n, outs.data());
    for (int ti = t0; ti < t1; ++ti) store(out(ti), ti);
    return;
  }
  if (const WidePath* wp = wide_path(isa, f)) {  // each block of rows widened once, then met by every tile
    thread_local WideRows wide;
    const int block = wp->row_block(f, m.kp, n);
    for (int b = 0; b < n; b += block) {
      const int rb = std::min(block, n - b);
      wp->widen(f, a, rows + b, rb, wide);
      for (int ti = t0; ti < t1;) {
        if (wp->dot2 && ti + 1 < t1) {
          const Tile pair[2] = {tile_of(m, expert, ti, f, block_k, group),
                                tile_of(m, expert, ti + 1, f, block_k, group)};
          float* outs[2] = {out(ti) + b * kRows, out(ti + 1) + b * kRows};
          wp->dot2(f, pair, block_k, group, a, rows + b, rb, wide, outs);
          ti += 2;
        } else {
          wp->dot(f, tile_of(m, expert, ti, f, block_k, group), block_k, group, a, rows + b, rb, wide,
                  out(ti) + b * kRows);
          ++ti;
        }
      }
    }
    for (int ti = t0; ti < t1; ++ti) store(out(ti), ti);
    return;
  }
  for (int ti = t0; ti < t1;) {
    const int nt = t1 - ti >= 4 ? 4 : (t1 - ti >= 2 ? 2 : 1);
    Tile tiles[4];
    float* outs[4];
    for (int j = 0; j < nt; ++j) {
      tiles[j] = tile_of(m, expert, ti + j, f, block_k, group);
      outs[j] = out(ti + j);
    }
    tile_dot_multi(isa, f, tiles, nt, block_k, group, a, rows, n, outs, scratch);
    for (int j = 0; j < nt; ++j) store(outs[j], ti + j);
    ti += nt;
  }
}

void MoeRunner::linear(Format f, const PackedMatrices& w, int n, int k, int block_k, int group, const void* x,
                       bool f32_io, int T, void* out, Isa isa) {
  check_isa(isa);
  check_flags(f, w);
  std::lock_guard<std::mutex> lock(mutex_);
  const bool int_fmt = int_format(f);
  const int R = (f32_io && !int_fmt) ? 2 : 1;
  const int m = T * R;
  Act xa = prepare_input(f, group, x, f32_io, T, k, w.kp, R, isa);
  if (spans_rows(isa, f, xa.exact, block_k, w.kp, m)) {
    const int blocks = (m + kRows - 1) / kRows;
    xpacked_.resize(size_t(blocks) * kRows * w.kp);
    run(blocks, int64_t(m) * w.kp, [&](int b, int) {
      const int n = std::min(kRows, m - b * kRows);
      const uint16_t* src[kRows];
      for (int i = 0; i < n; ++i) src[i] = xa.bf + size_t(b * kRows + i) * w.kp;
      pack_amx_block(src, n, w.kp, &xpacked_[size_t(b) * kRows * w.kp]);
    });
    xa.bf = xpacked_.data();
    xa.amx_packed = true;
  }
  std::vector<int> rows(m);
  std::iota(rows.begin(), rows.end(), 0);
  // Tasks are runs of row tiles over all tokens; small batches split finer so both cores stay busy.
  const int per_task = std::max(1, std::min(16, w.tiles / (8 * num_threads())));
  const int tasks = (w.tiles + per_task - 1) / per_task;
  pool_.run(tasks, [&](int task, int) {
    TaskBuffers& buf = task_buffers();
    buf.prepare(m, w.kp, per_task);
    const auto store = [&](const float* y, int ti) {
      put_tile(isa, y, R, T, std::min(kRows, n - ti * kRows), f32_io,
               static_cast<uint8_t*>(out) + size_t(ti) * kRows * (f32_io ? 4 : 2), n);
    };
    const int t0 = task * per_task;
    tile_range(isa, f, w, 0, t0, std::min(w.tiles, t0 + per_task), block_k, group, xa, rows.data(), m,
               buf.scratch.data(), [&](int ti) { return buf.ys[ti - t0].data(); }, store);
  });
}

void MoeRunner::head_linear(Format f, const PackedMatrices& w, int heads, int n, int k, int block_k, int group,
                            const void* x, const int64_t x_strides[2], bool f32_io, int T, void* out,
                            const int64_t out_strides[2], Isa isa) {
  check_isa(isa);
  check_flags(f, w);
  // A head's rows are picked from every head's rows, which AMX spans do not read: its tiles run as on the
  // avx512_bf16 path.
  if (isa == Isa::kAmx) isa = Isa::kAvx512Bf16;
  std::lock_guard<std::mutex> lock(mutex_);
  const bool int_fmt = int_format(f);
  const int R = (f32_io && !int_fmt) ? 2 : 1;
  const int m = T * R;
  const size_t io_bytes = f32_io ? 4 : 2;
  const int in_rows = T * heads;
  const void* dense = x;
  if (x_strides[1] != k || (T > 1 && x_strides[0] != int64_t(heads) * k)) {  // gathered into [T * heads][k]
    xdense_.resize(size_t(in_rows) * k * io_bytes);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        std::memcpy(&xdense_[(size_t(t) * heads + h) * k * io_bytes],
                    static_cast<const uint8_t*>(x) + (t * x_strides[0] + h * x_strides[1]) * io_bytes,
                    size_t(k) * io_bytes);
    dense = xdense_.data();
  }
  Act xa = prepare_input(f, group, dense, f32_io, in_rows, k, w.kp, R, isa);
  std::vector<int> rows(size_t(heads) * m);  // head h's activation rows: token t's R rows of input row (t, h)
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < R; ++j) rows[size_t(h) * m + t * R + j] = (t * heads + h) * R + j;
  const int per_task = std::max(1, std::min(w.tiles, w.tiles * heads / (8 * num_threads())));
  const int chunks = (w.tiles + per_task - 1) / per_task;
  pool_.run(heads * chunks, [&](int task, int) {
    const int h = task / chunks, t0 = (task % chunks) * per_task, t1 = std::min(w.tiles, t0 + per_task);
    TaskBuffers& buf = task_buffers();
    buf.prepare(m, w.kp, per_task);
    uint8_t* head_out = static_cast<uint8_t*>(out) + size_t(h) * out_strides[1] * io_bytes;
    const auto store = [&](const float* y, int ti) {
      put_tile(isa, y, R, T, std::min(kRows, n - ti * kRows), f32_io, head_out + size_t(ti) * kRows * io_bytes,
               size_t(out_strides[0]));
    };
    tile_range(isa, f, w, h, t0, t1, block_k, group, xa, rows.data() + size_t(h) * m, m, buf.scratch.data(),
               [&](int ti) { return buf.ys[ti - t0].data(); }, store);
  });
}

void MoeRunner::forward(const ExpertLayer& L, const void* x, bool f32_io, int T, int topk, const int32_t* ids,
                        const float* weights, float scale, void* out, Isa isa) {
  check_isa(isa);
  check_flags(L.format, L.w13);
  check_flags(L.format, L.w2);
  std::lock_guard<std::mutex> lock(mutex_);
  const Format f = L.format;
  const bool int_fmt = int_format(f);
  // fp32 activations keep fp32 accuracy through vdpbf16ps as a hi + lo pair of bf16 rows.
  const int R = (f32_io && !int_fmt) ? 2 : 1;
  const int E = L.num_experts, H = L.hidden, I = L.inter;
  const int kp1 = L.w13.kp, kp2 = L.w2.kp, htiles = L.w2.tiles, itiles = L.w13.tiles / 2;
  const int nslots = T * topk;

  // An id of -1 marks a slot computed elsewhere (a GPU-resident expert): it is neither run nor summed.
  int used = 0;
  for (int s = 0; s < nslots; ++s) {
    if (ids[s] == -1) continue;
    if (ids[s] < 0 || ids[s] >= E)
      throw std::invalid_argument("expert ids must be in [0, " + std::to_string(E) + ") or -1, got " +
                                  std::to_string(ids[s]));
    ++used;
  }
  // Group (token, slot) pairs by expert; slot s of the sorted order gets act and y row r.
  std::vector<int> count(E + 1, 0), order(used);
  for (int s = 0; s < nslots; ++s)
    if (ids[s] >= 0) ++count[ids[s] + 1];
  std::partial_sum(count.begin(), count.end(), count.begin());
  {
    std::vector<int> fill(count.begin(), count.end() - 1);
    for (int s = 0; s < nslots; ++s)
      if (ids[s] >= 0) order[fill[ids[s]]++] = s;
  }
  std::vector<int> tok(used), slot_row(nslots, -1), active;
  for (int r = 0; r < used; ++r) {
    tok[r] = order[r] / topk;
    slot_row[order[r]] = r;
  }
  const int rows = std::max(used, 1);
  for (int e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);

  // Gate/up inputs: R bf16 rows per token padded to kp1, or quantized rows for the int formats.
  Act xa = prepare_input(f, L.group, x, f32_io, T, H, kp1, R, isa);
  // AMX reads 16 activation rows per operand in place: give every expert its rows contiguously, as tile
  // operands where tile_span_amx reads them.
  int most = 0;
  for (int e : active) most = std::max(most, count[e + 1] - count[e]);
  const bool sorted = amx_rows(isa, f, most * R);
  const SortedRows in_rows =
      sorted_rows(count, active, R, [&](int m) { return spans_rows(isa, f, xa.exact, L.block_k, kp1, m); });
  if (sorted) xa = sort_rows(xa, tok, count, active, R, in_rows);
  const SortedRows act_rows =
      sorted_rows(count, active, R, [&](int m) { return spans_rows(isa, f, R == 2, L.block_k, kp2, m); });

  // Phase A: act[r] = silu(gate) * up for every sorted slot r, tiles of 16 intermediate rows.
  if (int_fmt) actf_.assign(size_t(rows) * kp2, 0.0f);
  else actbf_.assign((size_t(act_rows.rows) + kRows) * kp2, 0);
  run_expert_tiles(active, itiles, most == 1 ? 24 : 16, [&](int e, int t0, int t1) {
    const int begin = count[e], n = count[e + 1] - count[e], m = n * R;
    TaskBuffers& buf = task_buffers();
    buf.prepare(m, kp1, 2 * (t1 - t0));
    for (int i = 0; i < m; ++i) buf.rows[i] = sorted ? in_rows.first[e] + i : tok[begin + i / R] * R + i % R;
    uint16_t* const act_base = int_fmt ? nullptr : &actbf_[size_t(act_rows.first[e]) * kp2];
    const auto act_at = [&](int p, size_t col) {
      return act_base + (act_rows.packed[e] ? amx_operand_index(kp2, p, static_cast<int>(col)) : int64_t(p) * kp2 + col);
    };
    // Tiles 2ti (gate) and 2ti + 1 (up) arrive in order, each in its own result buffer.
    float* pending_gate = nullptr;
    const auto store = [&](float* y, int tile) {
      if (tile % 2 == 0) {
        pending_gate = y;
        return;
      }
      const int ti = tile / 2;
      for (int i = 0; i < n; ++i) {
        const size_t r = size_t(begin + i);
        float* g = pending_gate + size_t(i) * R * kRows;
        const float* u0 = y + size_t(i) * R * kRows;
        float u[kRows];
        put(isa, u0, R == 2 ? u0 + kRows : nullptr, kRows, 1.0f, true, u);
        if (R == 2) put(isa, g, g + kRows, kRows, 1.0f, true, g);
        const size_t col = size_t(ti) * kRows;
        if (int_fmt) {
          silu_mul_row(isa, g, u, &actf_[r * kp2 + col]);
        } else {
          float act[kRows];
          silu_mul_row(isa, g, u, act);
          split_bf16(isa, act, kRows, act_at(i * R, col), R == 2 ? act_at(i * R + 1, col) : nullptr);
        }
      }
    };
    tile_range(isa, f, L.w13, e, 2 * t0, 2 * t1, L.block_k, L.group, xa, buf.rows.data(), m, buf.scratch.data(),
               [&](int ti) { return buf.ys[ti - 2 * t0].data(); }, store);
  });

  Act aa;
  aa.kp = kp2;
  aa.exact = R == 2;
  aa.padded = true;
  if (int_fmt) {
    aa.ngroups = kp2 / L.group;
    actq_.resize((size_t(rows) + kRows) * kp2);
    actscale_.resize(rows);
    actgsum_.resize(size_t(rows) * aa.ngroups);
    run(used, int64_t(used) * kp2, [&](int r, int) {
      quantize_row(isa, &actf_[size_t(r) * kp2], I, kp2, f, L.group, &actq_[size_t(r) * kp2], &actscale_[r],
                   &actgsum_[size_t(r) * aa.ngroups]);
    });
    aa.q = actq_.data();
    aa.scale = actscale_.data();
    aa.gsum = actgsum_.data();
  } else {
    aa.bf = actbf_.data();
    aa.amx_packed = true;
  }

  // Phase B: y = act @ W2^T for each expert, tiles of 16 hidden rows, each tile's results of every row in
  // one block of ybuf_: [tile][act_rows.rows][16], written in place (tile_span_amx's padding rows included).
  const size_t yrows = act_rows.rows;
  ybuf_.resize(size_t(htiles) * yrows * kRows);
  run_expert_tiles(active, htiles, most == 1 ? 64 : 32, [&](int e, int t0, int t1) {
    const int n = count[e + 1] - count[e], m = n * R;
    TaskBuffers& buf = task_buffers();
    buf.prepare(m, kp2, 0);  // results go to ybuf_
    for (int i = 0; i < m; ++i) buf.rows[i] = act_rows.first[e] + i;
    tile_range(isa, f, L.w2, e, t0, t1, L.block_k, L.group, aa, buf.rows.data(), m, buf.scratch.data(),
               [&](int ti) { return &ybuf_[(ti * yrows + act_rows.first[e]) * kRows]; }, [](const float*, int) {});
  });

  // Phase C: out[t] = scale * sum over its experts (ascending id) of weight * y, rounded once. Tasks go
  // token by token through one chunk of columns: the chunk's blocks of ybuf_ stay in cache.
  constexpr int kChunk = 256;
  const int hchunks = (H + kChunk - 1) / kChunk;
  run(T * hchunks, int64_t(nslots) * H, [&](int task, int) {
    const int t = task % T, h0 = task / T * kChunk, h1 = std::min(H, h0 + kChunk);
    std::vector<int> js(topk);
    std::iota(js.begin(), js.end(), 0);
    std::sort(js.begin(), js.end(), [&](int a, int b) { return ids[t * topk + a] < ids[t * topk + b]; });
    float acc[kChunk];
    std::fill(acc, acc + (h1 - h0), 0.0f);
    for (int j : js) {
      const int s = t * topk + j;
      if (slot_row[s] < 0) continue;
      const int e = ids[s];
      const float* y = &ybuf_[(h0 / kRows * yrows + act_rows.first[e] + size_t(slot_row[s] - count[e]) * R) * kRows];
      axpy_tiles(isa, weights[s], y, R == 2 ? y + kRows : nullptr, yrows * kRows, h1 - h0, acc);
    }
    put(isa, acc, nullptr, h1 - h0, scale, f32_io,
        static_cast<uint8_t*>(out) + (size_t(t) * H + h0) * (f32_io ? 4 : 2));
  });
}

}  // namespace hybridd
