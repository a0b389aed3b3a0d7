// AMX kernels. The packed layouts (moe.h) already are AMX operands: 16 consecutive lines of a bf16 tile
// (32 k of its 16 rows, k pairs interleaved) are one B operand of tdpbf16ps, 16 lines of an int8 tile (64 k)
// one B operand of tdpbusd, and the lines of an int4 group split into low and high nibbles (minus the
// bias 8) are the B lines of tdpbssd. fp8 tiles are converted to bf16 lines first. bf16 activations (bf16
// and fp8 tiles) go column step by column step over all of a task's tiles (tile_span); the int formats and
// fp32 activations against fp8 tiles run up to four tiles over the full K per call (tile_dotn). An
// accumulator is 16 tokens x 16 output rows, the [token][row] order of the callers' results.
#include "amx.h"
#include "cache_aligned.h"
#include "fp8_lines.h"
#include "simd_math.h"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace hybridd {

namespace {

// The AVX-512 features too (every AMX CPU has them): the fp8 conversion inlines into the tile loops.
#define AMX_TARGET                                                                                     \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16," \
                        "avx512vbmi,avx512vnni,gfni")))

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr int kFp8ChunkColumns = 1024;  // fp8 columns converted per step, so the bf16 lines stay in L2
constexpr int kPrefetchSteps = 4;       // k steps ahead that B lines streamed from memory are prefetched

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: accumulators C[block][tile] = (row block 0, tile 0), (0, 1), (1, 0), (1, 1), 16 x 16 fp32 or int32.
// tmm4-5: A, 16 activation rows of each row block, `kstep` bytes of each. tmm6-7: B, kstep / 4 lines of 64
// bytes of each tile. Loaded on every call: torch's oneDNN AMX kernels may run on the same thread between
// our calls and leave their own configuration, or none.
AMX_TARGET void load_config(int kstep) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  c.colsb[4] = c.colsb[5] = static_cast<uint16_t>(kstep);
  c.rows[6] = c.rows[7] = static_cast<uint8_t>(kstep / 4);
  // GCC's _tile_loadconfig declares only the first 8 bytes of the configuration as read: without this the
  // stores of colsb and rows may be dropped as dead (seen with GCC 12 when the function is not inlined).
  asm volatile("" : : "m"(c) : "memory");
  _tile_loadconfig(&c);
}

enum class Dot { kBf16, kU8S8, kS8S8 };

#define TDP(D, c, a, b)                                 \
  do {                                                  \
    if constexpr (D == Dot::kBf16) _tile_dpbf16ps(c, a, b); \
    else if constexpr (D == Dot::kU8S8) _tile_dpbusd(c, a, b); \
    else _tile_dpbssd(c, a, b);                         \
  } while (0)

// An A operand into tmm4 or tmm5; kStream: loaded with the hint that it is not reused soon (tileloaddt1), so
// that it does not push the B lines that the next row blocks reuse out of L1. (GCC's tile intrinsics paste the
// register number into the instruction: it must be a literal, not a template parameter.)
template <bool kStream>
AMX_TARGET inline void load_a(int tmm, const uint8_t* p, int64_t stride) {
  if constexpr (kStream) {
    if (tmm == 4) _tile_stream_loadd(4, p, stride);
    else _tile_stream_loadd(5, p, stride);
  } else {
    if (tmm == 4) _tile_loadd(4, p, stride);
    else _tile_loadd(5, p, stride);
  }
}

// C += A x B over `steps` k steps: A rows advance `astep` bytes per step (row stride `astride`); b(s, lines)
// sets the B operands of step s. kTwoN: a second tile (lines[1], C1/C3); kTwoM: a second row block (a1, C2/C3).
template <Dot D, bool kTwoN, bool kTwoM, bool kStreamA = false, typename B>
AMX_TARGET void run_steps(const uint8_t* a0, const uint8_t* a1, int64_t astride, int astep, int steps, B b) {
  for (int s = 0; s < steps; ++s) {
    const uint8_t* lines[2];
    b(s, lines);
    load_a<kStreamA>(4, a0 + s * astep, astride);
    _tile_loadd(6, lines[0], 64);
    TDP(D, 0, 4, 6);
    if constexpr (kTwoN) {
      _tile_loadd(7, lines[1], 64);
      TDP(D, 1, 4, 7);
    }
    if constexpr (kTwoM) {
      load_a<kStreamA>(5, a1 + s * astep, astride);
      TDP(D, 2, 5, 6);
      if constexpr (kTwoN) TDP(D, 3, 5, 7);
    }
  }
}

// c[0..3] = the four accumulators of run_steps from zero: one or two row blocks (a1) x one or two tiles (b1)
// whose B lines advance `bstep` bytes per step, prefetched kPrefetchSteps ahead when they come from memory.
template <Dot D>
AMX_TARGET void block_product(const uint8_t* a0, const uint8_t* a1, int64_t astride, int astep, const uint8_t* b0,
                              const uint8_t* b1, int bstep, int steps, bool prefetch, int32_t (*c)[kRows * kRows]) {
  const auto lines = [&](int s, const uint8_t** l) {
    if (prefetch)
      for (int o = 0; o < bstep; o += 64)
        for (const uint8_t* b : {b0, b1})
          if (b) _mm_prefetch(reinterpret_cast<const char*>(b + (s + kPrefetchSteps) * bstep + o), _MM_HINT_T0);
    l[0] = b0 + s * bstep;
    l[1] = b1 ? b1 + s * bstep : nullptr;
  };
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  if (b1 && a1) run_steps<D, true, true>(a0, a1, astride, astep, steps, lines);
  else if (b1) run_steps<D, true, false>(a0, a1, astride, astep, steps, lines);
  else if (a1) run_steps<D, false, true>(a0, a1, astride, astep, steps, lines);
  else run_steps<D, false, false>(a0, a1, astride, astep, steps, lines);
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

// What becomes of an accumulator tile: added (times a block scale) or, an int8 sum, dequantized.
struct Epilogue {
  enum Kind { kAdd, kInt8 } kind = kAdd;
  float scale = 1.0f;              // kAdd: out += scale * C
  const float* wscale = nullptr;   // int8: the 16 output rows' weight scales
  const int32_t* comp = nullptr;   // int8: 128 * row sums (activations are stored as q + 128)
};

AMX_TARGET void finish(const Epilogue& e, const Act& a, const int* rows, const void* c, float* out, int m) {
  const float* cf = static_cast<const float*>(c);
  const int32_t* ci = static_cast<const int32_t*>(c);
  for (int i = 0; i < m; ++i) {
    float* o = out + i * kRows;
    switch (e.kind) {
      case Epilogue::kAdd:
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_load_ps(cf + i * kRows), _mm512_set1_ps(e.scale),
                                            _mm512_loadu_ps(o)));
        break;
      case Epilogue::kInt8: {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(ci + i * kRows),
                                                             _mm512_loadu_si512(e.comp)));
        const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(e.wscale), _mm512_set1_ps(a.scale[rows[i]]));
        _mm512_storeu_ps(o, _mm512_mul_ps(v, s));
        break;
      }
    }
  }
}

// The n activation rows as 16-row blocks: rows [0, full) in place, a partial last block from `tail`
// (a zero-padded copy) unless the rows past it are readable.
struct RowBlocks {
  const uint8_t* base;
  const uint8_t* tail;
  int64_t stride;
  int full;
  const uint8_t* block(int row0) const { return row0 < full ? base + row0 * stride : tail; }
};

// One operand pair: B lines of one or two tiles over `steps` k steps from column byte offset acol, and what
// each tile's accumulators become.
struct Panel {
  const uint8_t* b[2];
  int64_t acol;
  int astep, bstep, steps;
  bool prefetch;
  Epilogue epi[2];
  float* out[2];
};

template <Dot D>
AMX_TARGET void run_panel(const Panel& p, const RowBlocks& blocks, const Act& a, const int* rows, int n) {
  alignas(64) int32_t c[4][kRows * kRows];
  const bool two_n = p.b[1] != nullptr;
  bool prefetch = p.prefetch;
  for (int m0 = 0; m0 < n; m0 += 2 * kRows) {
    const bool two_m = n - m0 > kRows;
    const uint8_t* a0 = blocks.block(m0) + p.acol;
    const uint8_t* a1 = two_m ? blocks.block(m0 + kRows) + p.acol : nullptr;
    block_product<D>(a0, a1, blocks.stride, p.astep, p.b[0], p.b[1], p.bstep, p.steps, prefetch, c);
    prefetch = false;  // the next row blocks find these B lines in cache
    const int ma = std::min(kRows, n - m0), mb = std::max(0, std::min(kRows, n - m0 - kRows));
    for (int j = 0; j < (two_n ? 2 : 1); ++j) {
      finish(p.epi[j], a, rows + m0, c[j], p.out[j] + m0 * kRows, ma);
      if (mb) finish(p.epi[j], a, rows + m0 + kRows, c[2 + j], p.out[j] + (m0 + kRows) * kRows, mb);
    }
  }
}

// int4 on one or two tiles' unpacked lines: per block of up to 32 activation rows, every group in turn, each
// group's integer sums scaled by its row scales into fp32 sums that stay in L1 until the rows' token scales
// finish them. (Group by group over all rows instead kept every row's fp32 sums in flight, an L2 round trip
// per group.)
AMX_TARGET void run_int4(const uint8_t* const b[2], const Tile* t, int group, int kstep, const RowBlocks& blocks,
                         const Act& a, const int* rows, int n, float* const out[2]) {
  alignas(64) int32_t c[4][kRows * kRows];
  alignas(64) float acc[4][kRows * kRows];
  const bool two_n = b[1] != nullptr;
  const int chunks = group / 8, steps = group / kstep, groups = t[0].kp / group;
  const int bstep = kstep * kRows;
  for (int m0 = 0; m0 < n; m0 += 2 * kRows) {
    const bool two_m = n - m0 > kRows;
    const uint8_t* a0 = blocks.block(m0);
    const uint8_t* a1 = two_m ? blocks.block(m0 + kRows) : nullptr;
    std::memset(acc, 0, sizeof(acc));
    for (int g = 0; g < groups; ++g) {
      const int64_t col = int64_t(g) * group;
      const uint8_t* g0 = b[0] + col * kRows;
      const uint8_t* g1 = two_n ? b[1] + col * kRows : nullptr;
      const uint8_t* ga1 = two_m ? a1 + col : nullptr;
      block_product<Dot::kS8S8>(a0 + col, ga1, blocks.stride, kstep, g0, g1, bstep, steps, false, c);
      for (int j = 0; j < (two_n ? 2 : 1); ++j) {
        const __m512 s = _mm512_loadu_ps(reinterpret_cast<const float*>(t[j].data + (int64_t(g) * (chunks + 1) + chunks) * 64));
        for (int h = 0; h < (two_m ? 2 : 1); ++h) {
          float* o = acc[2 * h + j];
          const int32_t* ci = c[2 * h + j];
          for (int i = 0; i < kRows; ++i)
            _mm512_store_ps(o + i * kRows, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ci + i * kRows)), s,
                                                           _mm512_load_ps(o + i * kRows)));
        }
      }
    }
    for (int h = 0; h < (two_m ? 2 : 1); ++h) {
      const int r0 = m0 + h * kRows, m = std::min(kRows, n - r0);
      for (int j = 0; j < (two_n ? 2 : 1); ++j)
        for (int i = 0; i < m; ++i)
          _mm512_storeu_ps(out[j] + (r0 + i) * kRows,
                           _mm512_mul_ps(_mm512_load_ps(acc[2 * h + j] + i * kRows), _mm512_set1_ps(a.scale[rows[r0 + i]])));
    }
  }
}

// Low and high nibbles of an int4 tile's lines as s8 B lines q = nibble - 8 (k order restored: line c of a
// group holds k = 8c..8c+3 in its low nibbles and 8c+4..8c+7 in its high ones); the scale lines are skipped.
AMX_TARGET void unpack_int4_tile(const Tile& t, int group, uint8_t* lines) {
  const int chunks = group / 8;
  const __m512i bias = _mm512_set1_epi8(8);
  for (int g = 0; g < t.kp / group; ++g) {
    const uint8_t* src = t.data + int64_t(g) * (chunks + 1) * 64;
    for (int c = 0; c < chunks; ++c) {
      __m512i lo, hi;
      nibbles(src + c * 64, lo, hi);
      uint8_t* dst = lines + (int64_t(g) * chunks + c) * 128;
      _mm512_storeu_si512(dst, _mm512_sub_epi8(lo, bias));
      _mm512_storeu_si512(dst + 64, _mm512_sub_epi8(hi, bias));
    }
  }
}

AMX_TARGET void tile_dotn(Format f, const Tile* t, int nt, int block_k, int group, const Act& a, const int* rows,
                          int n, float* const* out, uint16_t* scratch) {
  const bool bf = f == Format::kBF16 || f == Format::kFP8;
  const int64_t stride = a.kp * (bf ? 2 : 1);
  const uint8_t* src = bf ? reinterpret_cast<const uint8_t*>(a.bf) : reinterpret_cast<const uint8_t*>(a.q);
  for (int i = 1; i < n; ++i)
    if (rows[i] != rows[0] + i) throw std::logic_error("the AMX kernels read contiguous activation rows");
  thread_local std::vector<uint8_t> tail;
  RowBlocks blocks{src + rows[0] * stride, nullptr, stride, n};
  if (n % kRows && !a.padded) {
    blocks.full = n / kRows * kRows;
    tail.assign(size_t(kRows) * stride, 0);
    std::memcpy(tail.data(), blocks.base + blocks.full * stride, size_t(n - blocks.full) * stride);
    blocks.tail = tail.data();
  }
  const int kp = t[0].kp;
  // int4 groups of a multiple of 64 columns run full 64-byte k steps; other groups (multiples of 32) half ones.
  const int int4_kstep = group % 64 ? 32 : 64;
  load_config(f == Format::kINT4 ? int4_kstep : 64);

  if (f == Format::kINT8) {
    for (int j = 0; j < nt; j += 2) {
      Panel p{{t[j].data, j + 1 < nt ? t[j + 1].data : nullptr}, 0, 64, 1024, kp / 64, true, {},
              {out[j], j + 1 < nt ? out[j + 1] : nullptr}};
      for (int h = 0; h < 2 && j + h < nt; ++h) p.epi[h] = {Epilogue::kInt8, 1.0f, t[j + h].scales, t[j + h].comp};
      run_panel<Dot::kU8S8>(p, blocks, a, rows, n);
    }
  } else if (f == Format::kFP8) {
    // fp32 activations (hi + lo rows; bf16 ones run tile_span) meet unrounded lines: one partial sum per fp8
    // block, scaled as it is added.
    const int chunk = std::min(kp, std::max(block_k, kFp8ChunkColumns / block_k * block_k));
    for (int j = 0; j < nt; ++j) std::memset(out[j], 0, sizeof(float) * n * kRows);
    for (int k0 = 0; k0 < kp; k0 += chunk) {
      const int klen = std::min(chunk, kp - k0);
      uint16_t* lines[4];
      for (int j = 0; j < nt; ++j) {
        lines[j] = scratch + size_t(j) * chunk * kRows;
        convert_fp8_tile(fp8_columns(t[j], k0, klen), nullptr, block_k, lines[j]);
      }
      for (int j = 0; j < nt; j += 2) {
        const bool two = j + 1 < nt;
        for (int s0 = 0; s0 < klen; s0 += block_k) {
          Panel p{{reinterpret_cast<const uint8_t*>(lines[j] + s0 * kRows),
                   two ? reinterpret_cast<const uint8_t*>(lines[j + 1] + s0 * kRows) : nullptr},
                  int64_t(k0 + s0) * 2, 64, 1024, block_k / 32, false, {}, {out[j], two ? out[j + 1] : nullptr}};
          for (int h = 0; h < (two ? 2 : 1); ++h)
            p.epi[h] = {Epilogue::kAdd, t[j + h].scales[(k0 + s0) / block_k], nullptr, nullptr};
          run_panel<Dot::kBf16>(p, blocks, a, rows, n);
        }
      }
    }
  } else {
    uint8_t* lines = reinterpret_cast<uint8_t*>(scratch);
    const int64_t tile_lines = int64_t(kp) * kRows;  // bytes of one tile's unpacked s8 lines
    for (int j = 0; j < nt; ++j) unpack_int4_tile(t[j], group, lines + j * tile_lines);
    for (int j = 0; j < nt; j += 2) {
      const bool two = j + 1 < nt;
      const uint8_t* b[2] = {lines + j * tile_lines, two ? lines + (j + 1) * tile_lines : nullptr};
      float* const o[2] = {out[j], two ? out[j + 1] : nullptr};
      run_int4(b, t + j, group, int4_kstep, blocks, a, rows, n, o);
    }
  }
  _tile_release();
}

// Columns per step of tile_span: the step's activation operands (n x columns bf16, at most kSpanRowBytes)
// stay in L2 while every tile's lines of those columns stream past them.
constexpr int kSpanColumns = 1024;
// k steps of a tile pair (32 KB of its lines) that all row blocks run before the next ones (see tile_span).
constexpr int kSpanChunkSteps = 16;
constexpr int64_t kSpanRowBytes = 512 << 10;

AMX_TARGET int span_columns(Format f, int kp, int n, int block_k) {
  const int64_t fit = kSpanRowBytes / (2 * ((n + kRows - 1) / kRows * kRows));
  int cols = static_cast<int>(std::max<int64_t>(256, std::min<int64_t>(kSpanColumns, fit))) / 32 * 32;
  if (f == Format::kFP8) cols = std::max(block_k, cols / block_k * block_k);
  return std::min(kp, cols);
}

// C[block][tile] for one or two row blocks x one or two tiles, added to over `steps` k steps: zeroed first
// when `fresh`, else loaded from the outputs, and stored back (fp32 [16 rows][16] at c0/c1 (+ 256)). The
// second row block's A operands sit `ablock` bytes after the first's; b(s, lines) sets the two tiles' B
// operands of k step s; kStreamA: A loaded as not reused soon (see load_a).
template <bool kTwoN, bool kTwoM, bool kStreamA, typename B>
AMX_TARGET void span_block(const uint8_t* a0, int64_t ablock, int steps, bool fresh, float* c0, float* c1, B b) {
  const uint8_t* a1 = a0 + ablock;
  if (fresh) {
    _tile_zero(0);
    if constexpr (kTwoN) _tile_zero(1);
    if constexpr (kTwoM) _tile_zero(2);
    if constexpr (kTwoN && kTwoM) _tile_zero(3);
  } else {
    _tile_loadd(0, c0, 64);
    if constexpr (kTwoN) _tile_loadd(1, c1, 64);
    if constexpr (kTwoM) _tile_loadd(2, c0 + kRows * kRows, 64);
    if constexpr (kTwoN && kTwoM) _tile_loadd(3, c1 + kRows * kRows, 64);
  }
  run_steps<Dot::kBf16, kTwoN, kTwoM, kStreamA>(a0, a1, 64, 1024, steps, b);
  _tile_stored(0, c0, 64);
  if constexpr (kTwoN) _tile_stored(1, c1, 64);
  if constexpr (kTwoM) _tile_stored(2, c0 + kRows * kRows, 64);
  if constexpr (kTwoN && kTwoM) _tile_stored(3, c1 + kRows * kRows, 64);
}

template <bool kStreamA = false, typename B>
AMX_TARGET void span_blocks(bool two_n, bool two_m, const uint8_t* a0, int64_t ablock, int steps, bool fresh,
                            float* c0, float* c1, B b) {
  if (two_n && two_m) span_block<true, true, kStreamA>(a0, ablock, steps, fresh, c0, c1, b);
  else if (two_m) span_block<false, true, kStreamA>(a0, ablock, steps, fresh, c0, c1, b);
  else if (two_n) span_block<true, false, kStreamA>(a0, ablock, steps, fresh, c0, c1, b);
  else span_block<false, false, kStreamA>(a0, ablock, steps, fresh, c0, c1, b);
}

// Weight bytes that a span reads from memory next, prefetched into L2 a few lines per k step of the tile
// products before them (the same bytes prefetched in a burst before every row block ran 0.95x as fast as
// no prefetch).
struct NextLines {
  const uint8_t* p[2] = {};
  int64_t lines = 0, per_step = 0, done = 0;

  // `lines` 64-byte lines from a and b (either may be null), over the next `calls` k steps.
  void start(const uint8_t* a, const uint8_t* b, int64_t n, int64_t calls) {
    p[0] = a;
    p[1] = b;
    lines = n;
    per_step = (n + calls - 1) / calls;
    done = 0;
  }
  AMX_TARGET void step() {
    for (int64_t q = 0; q < per_step && done < lines; ++q, ++done)
      for (const uint8_t* l : p)
        if (l) _mm_prefetch(reinterpret_cast<const char*>(l + done * 64), _MM_HINT_T1);
  }
};

// Column step by column step over the rows' A operands (packed once per call, see pack_amx_block): every
// pair of tiles runs all row blocks against the step's columns, adding into the outputs, kSpanChunkSteps k
// steps at a time: the pair's 32 KB of lines stay in L1 for all row blocks while their A operands stream past
// (tileloaddt1). Whole column steps (64 KB of lines) came from L2 for every row block: a loop of this shape
// with 8 row blocks ran 1.10-1.15x faster chunked on Emerald Rapids. Each pair's weight lines come from
// memory once (bf16: prefetched into L2 while the chunk before them computes); later row blocks find them in
// cache. fp8 tiles become bf16 lines: for one or two row blocks unscaled (4 instead of 16 vector operations
// per 64 codes), a k step at a time into L1 interleaved with the tile products that read them, and every fp8
// block's sums scaled as they are added; for more, scaled lines of the pair's whole column step at once,
// reused by every row block. (Qwen3-30B-A3B shapes at T=512, ~32 rows per expert: scaled lines from one row
// block on ran 0.89-0.91x as fast, stepwise up to four blocks 0.73x; DeepSeek-V3 at T=128 0.76x.)
AMX_TARGET void tile_span(Format f, const Tile* t, int nt, int block_k, const Act& a, const uint8_t* packed,
                          int n, float* const* out) {
  const int kp = t[0].kp, cols = span_columns(f, kp, n, block_k), blocks = (n + kRows - 1) / kRows;
  const bool stepwise = f == Format::kFP8 && blocks <= 2;
  // A operands of row block b, k step s at packed + (b * ksteps + s) * 1 KB.
  const int ksteps = kp / 32;
  const int64_t ablock = int64_t(ksteps) * 1024;
  // 64-byte aligned, so that every 64-byte operand line is one cache line.
  thread_local AlignedVector<uint8_t> lines_buf;
  // fp8 lines: two tiles' column step, or (stepwise) two alternating k steps of two tiles, 4 KB.
  const size_t line_bytes = std::max<size_t>(4096, size_t(2) * cols * kRows * 2);
  lines_buf.resize(line_bytes);
  uint16_t* lines = reinterpret_cast<uint16_t*>(lines_buf.data());
  const Fp8Fast conv = fp8_fast();
  load_config(64);
  for (int k0 = 0; k0 < kp; k0 += cols) {
    const int klen = std::min(cols, kp - k0), steps = klen / 32;
    for (int j = 0; j < nt; j += 2) {
      const bool two_n = j + 1 < nt;
      const float* scales[2] = {t[j].scales + k0 / block_k, two_n ? t[j + 1].scales + k0 / block_k : nullptr};
      const bool fresh = k0 == 0;
      float* c1 = two_n ? out[j + 1] : nullptr;
      if (stepwise) {
        // Unscaled lines, a k step at a time into two alternating 2 KB buffers (step s + 1 converts while step
        // s's tiles may still be loading); each fp8 block's sums are added to the outputs times its scale.
        for (int h = 0; fresh && h < (two_n ? 2 : 1); ++h)
          std::memset(out[j + h], 0, sizeof(float) * blocks * kRows * kRows);
        for (int kb = 0; kb < klen; kb += block_k) {
          const auto convert_step = [&](int s, const uint8_t** b) AMX_TARGET {
            uint16_t* l = lines + (s & 1) * 2 * 512;
            for (int h = 0; h < (two_n ? 2 : 1); ++h) {
              fp8_fast_lines(conv, fp8_columns(t[j + h], k0 + kb + 32 * s, 32), l + h * 512);
              b[h] = reinterpret_cast<const uint8_t*>(l + h * 512);
            }
          };
          alignas(64) float c[2][2 * kRows * kRows];
          span_blocks(two_n, blocks == 2, packed + (k0 + kb) / 32 * 1024, ablock, block_k / 32, true, c[0], c[1],
                      convert_step);
          for (int h = 0; h < (two_n ? 2 : 1); ++h)
            finish({Epilogue::kAdd, scales[h][kb / block_k] * kFp8LineScale, nullptr, nullptr}, a, nullptr, c[h],
                   out[j + h], blocks * kRows);
        }
        continue;
      }
      const uint8_t* b[2] = {};
      for (int h = 0; h < (two_n ? 2 : 1); ++h) {
        if (f == Format::kFP8) {
          uint16_t* l = lines + size_t(h) * klen * kRows;
          convert_fp8_tile(fp8_columns(t[j + h], k0, klen), scales[h], block_k, l);
          b[h] = reinterpret_cast<const uint8_t*>(l);
        } else {
          b[h] = t[j + h].data + int64_t(k0) * kRows * 2;
        }
      }
      // bf16 lines are read in place: this pair's next chunk, or the next pair's first, comes from memory next.
      // (fp8 pairs convert a column step at once; prefetching the next pair's codes measured no different.)
      const int block_pairs = (blocks + 1) / 2;
      NextLines next;
      for (int s0 = 0; s0 < steps; s0 += kSpanChunkSteps) {
        const int chunk = std::min(kSpanChunkSteps, steps - s0);
        if (f == Format::kBF16 && s0 + chunk < steps)
          next.start(b[0] + (s0 + chunk) * 1024, two_n ? b[1] + (s0 + chunk) * 1024 : nullptr,
                     std::min(kSpanChunkSteps, steps - s0 - chunk) * 16, int64_t(chunk) * block_pairs);
        else if (f == Format::kBF16 && j + 2 < nt)
          next.start(t[j + 2].data + int64_t(k0) * kRows * 2,
                     j + 3 < nt ? t[j + 3].data + int64_t(k0) * kRows * 2 : nullptr,
                     std::min(kSpanChunkSteps, steps) * 16, int64_t(chunk) * block_pairs);
        else
          next = NextLines();
        const auto in_place = [&](int s, const uint8_t** lb) AMX_TARGET {
          lb[0] = b[0] + (s0 + s) * 1024;
          lb[1] = two_n ? b[1] + (s0 + s) * 1024 : nullptr;
          next.step();
        };
        for (int m0 = 0; m0 < blocks * kRows; m0 += 2 * kRows)
          span_blocks<true>(two_n, blocks * kRows - m0 > kRows,
                            packed + (int64_t(m0 / kRows) * ksteps + k0 / 32 + s0) * 1024, ablock,
                            chunk, fresh && s0 == 0, out[j] + m0 * kRows,
                            two_n ? c1 + m0 * kRows : nullptr, in_place);
      }
    }
  }
  _tile_release();
}

std::atomic<int64_t> calls{0};

bool request_tile_state() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("amx-int8"))
    return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_usable() {
  static const bool usable = request_tile_state();
  return usable;
}

bool amx_handles(Format f, int block_k, int group, int kp) {
  switch (f) {
    case Format::kBF16: return kp % 32 == 0;
    case Format::kINT8: return kp % 64 == 0;
    case Format::kFP8: return block_k % 32 == 0;
    case Format::kINT4: return group % 32 == 0;
  }
  return false;
}

void tile_dotn_amx(Format f, const Tile* tiles, int nt, int block_k, int group, const Act& a, const int* rows, int n,
                   float* const* out, uint16_t* scratch) {
  calls.fetch_add(1, std::memory_order_relaxed);
  tile_dotn(f, tiles, nt, block_k, group, a, rows, n, out, scratch);
}

bool amx_spans(Format f, bool exact, int block_k, int kp) {
  return kp % 32 == 0 && (f == Format::kBF16 || (f == Format::kFP8 && !exact && block_k % 32 == 0));
}

void tile_span_amx(Format f, const Tile* tiles, int nt, int block_k, const Act& a, const int* rows, int n,
                   float* const* out) {
  if (!a.amx_packed) throw std::logic_error("tile_span_amx reads activation rows packed by pack_amx_block");
  for (int i = 1; i < n; ++i)
    if (rows[i] != rows[0] + i) throw std::logic_error("the AMX kernels read contiguous activation rows");
  calls.fetch_add(1, std::memory_order_relaxed);
  tile_span(f, tiles, nt, block_k, a, reinterpret_cast<const uint8_t*>(a.bf + int64_t(rows[0]) * a.kp), n, out);
}

void pack_amx_block(const uint16_t* const* src, int n, int kp, uint16_t* dst) {
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kp; c += 32) {
      uint16_t* d = dst + amx_operand_index(kp, r, c);
      if (r < n) std::memcpy(d, src[r] + c, 64);
      else std::memset(d, 0, 64);
    }
}

int64_t amx_calls() { return calls.load(std::memory_order_relaxed); }

}  // namespace hybridd
