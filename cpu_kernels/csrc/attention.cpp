// Paged causal attention (see attention.h). A task attends one context slice of one KV head for a tile of
// queries and every query head sharing that KV head: rows r = (query, head). Keys come 16 at a time: their
// K rows are gathered from the cache blocks and widened to fp32; the avx512 kernel transposes them so that
// one FMA scores a row against all 16, the avx2 kernel holds 8 rows in the lanes of a vector instead and
// scores them against one key per FMA. Each row folds the keys into its running max / sum / weighted V sum,
// with probabilities in fp32. bf16 caches on CPUs with AVX512_BF16 take a fourth kernel (attend_avx512_bf16):
// K stays bf16, transposed as pairs of head dims for vdpbf16ps, and the probabilities are rounded to bf16.
#include "attention.h"

#include "cache_aligned.h"
#include "simd_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybridd {

namespace {

// Decode rows split their context into slices of >= kSliceTokens so that about kTasksPerThread tasks per
// thread exist (a single long sequence then uses every core); a batch that already has that many takes none.
constexpr int kSliceTokens = 256;
constexpr int kMaxSlices = 64;
constexpr int kTasksPerThread = 4;
constexpr int kChunk = 16;         // keys gathered and scored together
constexpr int kTileRows = 128;     // (query, head) rows per task

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load(const void* base, int64_t i, bool f32) {
  return f32 ? static_cast<const float*>(base)[i] : bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

// Queries [q0, q0 + nq) of sequence seq (rows `row0`.. of q), KV head kv_head, keys [t0, t1).
struct Task {
  int seq, kv_head, q0, nq, t0, t1;
  int64_t row0;
};

inline int group_of(const PagedAttention& a) { return a.num_heads / a.num_kv_heads; }
// Per row: running max, running sum, then the v_head_dim weighted V sum.
inline int64_t row_floats(const PagedAttention& a) { return 2 + a.v_head_dim; }

inline int64_t token_index(const PagedAttention& a, int seq, int t) {
  const int32_t block = a.block_tables[int64_t(seq) * a.table_width + t / a.block_size];
  return int64_t(block) * a.block_size + t % a.block_size;
}

// Element offset of the query row of the task's row r (query r / group, head r % group of its KV head).
inline int64_t q_offset(const PagedAttention& a, const Task& t, int r) {
  const int group = group_of(a);
  return ((t.row0 + r / group) * a.num_heads + t.kv_head * group + r % group) * a.head_dim;
}

// Element offsets of the K and V rows of cache slot idx (token_index) for the task's KV head.
inline int64_t k_offset(const PagedAttention& a, const Task& t, int64_t idx) {
  return idx * a.k_token_stride + t.kv_head * a.k_head_stride;
}
inline int64_t v_offset(const PagedAttention& a, const Task& t, int64_t idx) {
  return idx * a.v_token_stride + t.kv_head * a.v_head_stride;
}

// Keys [0, limit) are visible to query q of the task's sequence.
inline int key_limit(const PagedAttention& a, const Task& t, int q) {
  return a.context_lens[t.seq] - a.query_lens[t.seq] + t.q0 + q + 1;
}

void init_rows(const PagedAttention& a, int rows, float* part) {
  for (int r = 0; r < rows; ++r) {
    float* p = part + r * row_floats(a);
    p[0] = kNegInf;
    p[1] = 0.0f;
    std::fill(p + 2, p + 2 + a.v_head_dim, 0.0f);
  }
}

void attend_generic(const PagedAttention& a, const Task& t, float* part) {
  const int group = group_of(a), d = a.head_dim, dv = a.v_head_dim, rows = t.nq * group;
  thread_local std::vector<float> q;
  q.resize(size_t(rows) * d);
  for (int r = 0; r < rows; ++r) {
    const int64_t q0 = q_offset(a, t, r);
    for (int i = 0; i < d; ++i) q[size_t(r) * d + i] = load(a.q, q0 + i, a.f32) * a.scale;
  }
  init_rows(a, rows, part);
  for (int r = 0; r < rows; ++r) {
    float* p = part + r * row_floats(a);
    const int end = std::min(t.t1, key_limit(a, t, r / group));
    for (int k = t.t0; k < end; ++k) {
      const int64_t idx = token_index(a, t.seq, k);
      const int64_t k0 = k_offset(a, t, idx), v0 = v_offset(a, t, idx);
      float score = 0.0f;
      for (int i = 0; i < d; ++i) score += q[size_t(r) * d + i] * load(a.k, k0 + i, a.f32);
      if (score > p[0]) {
        const float corr = std::exp(p[0] - score);
        p[1] *= corr;
        for (int i = 0; i < dv; ++i) p[2 + i] *= corr;
        p[0] = score;
      }
      const float w = std::exp(score - p[0]);
      p[1] += w;
      for (int i = 0; i < dv; ++i) p[2 + i] += w * load(a.v, v0 + i, a.f32);
    }
  }
}

AVX512F_TARGET inline __m512 load16(const void* base, int64_t i, bool f32) {
  if (f32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
}

AVX512F_TARGET inline __m512d pd(__m512 v) { return _mm512_castps_pd(v); }

// r[i][j] -> r[j][i] for 16 x 16 floats: pairs, then quads within 128-bit lanes, then lanes.
AVX512F_TARGET inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    // u[4i + j], 128-bit lane L: column 4L + j of rows 4i..4i+3
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), v2 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(v1, w1, 0xdd);
    r[8 + j] = _mm512_shuffle_f32x4(v2, w2, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(v2, w2, 0xdd);
  }
}

// acc[0, 16W) = acc * corr + sum_i p[i] * v[i][0, 16W), W registers of accumulators.
template <int W>
AVX512F_TARGET inline void weighted_sum(float* acc, __m512 corr, const float* p, const float* const* v, int off,
                                         int n) {
  __m512 r[W];
  for (int j = 0; j < W; ++j) r[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), corr);
  for (int i = 0; i < n; ++i) {
    const __m512 w = _mm512_set1_ps(p[i]);
    for (int j = 0; j < W; ++j) r[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v[i] + off + 16 * j), r[j]);
  }
  for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc + 16 * j, r[j]);
}

// Scores of `m` (<= 8) rows against the 16 transposed keys kt [d][16].
template <int M>
AVX512F_TARGET inline void score_rows(const float* q, int d, const float* kt, __m512* s) {
  for (int r = 0; r < M; ++r) s[r] = _mm512_setzero_ps();
  for (int c = 0; c < d; ++c) {
    const __m512 k = _mm512_load_ps(kt + c * 16);
    for (int r = 0; r < M; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[size_t(r) * d + c]), k, s[r]);
  }
}

// head_dim and v_head_dim multiples of 16.
AVX512F_TARGET void attend_avx512(const PagedAttention& a, const Task& t, float* part) {
  const int group = group_of(a), d = a.head_dim, dv = a.v_head_dim, rows = t.nq * group;
  thread_local std::vector<float> q, vbuf, ktbuf;
  q.resize(size_t(rows) * d);
  vbuf.resize(size_t(kChunk) * dv);
  ktbuf.resize(size_t(d) * 16 + 16);
  float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ktbuf.data()) + 63) & ~uintptr_t(63));
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int r = 0; r < rows; ++r) {
    const int64_t q0 = q_offset(a, t, r);
    for (int c = 0; c < d; c += 16) _mm512_storeu_ps(&q[size_t(r) * d + c], _mm512_mul_ps(load16(a.q, q0 + c, a.f32), scale));
  }
  init_rows(a, rows, part);
  const int end = std::min(t.t1, key_limit(a, t, t.nq - 1));
  int64_t kstart[kChunk];
  const float* vrow[kChunk];
  alignas(64) float prob[kChunk];
  __m512 s[8];
  for (int c0 = t.t0; c0 < end; c0 += kChunk) {
    const int n = std::min(kChunk, end - c0);
    for (int i = 0; i < n; ++i) {
      const int64_t idx = token_index(a, t.seq, c0 + i);
      kstart[i] = k_offset(a, t, idx);
      const int64_t v0 = v_offset(a, t, idx);
      if (a.f32) {
        vrow[i] = static_cast<const float*>(a.v) + v0;
      } else {
        float* dst = vbuf.data() + size_t(i) * dv;
        for (int c = 0; c < dv; c += 16) _mm512_storeu_ps(dst + c, load16(a.v, v0 + c, false));
        vrow[i] = dst;
      }
    }
    for (int c = 0; c < d; c += 16) {
      __m512 blk[16];
      for (int i = 0; i < 16; ++i) blk[i] = i < n ? load16(a.k, kstart[i] + c, a.f32) : _mm512_setzero_ps();
      transpose16(blk);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(kt + (c + j) * 16, blk[j]);
    }
    for (int r0 = 0; r0 < rows; r0 += 8) {
      const int m = std::min(8, rows - r0);
      if (key_limit(a, t, (r0 + m - 1) / group) <= c0) continue;  // rows are in query order: the last sees most
      const float* qr = &q[size_t(r0) * d];
      if (m == 8) score_rows<8>(qr, d, kt, s);
      else
        for (int r = 0; r < m; ++r) score_rows<1>(qr + size_t(r) * d, d, kt, s + r);
      for (int r = 0; r < m; ++r) {
        const int visible = std::min(n, key_limit(a, t, (r0 + r) / group) - c0);
        if (visible <= 0) continue;
        const __mmask16 valid = __mmask16((1u << visible) - 1);
        float* p = part + (r0 + r) * row_floats(a);
        const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, s[r]);
        const float mx = std::max(p[0], _mm512_reduce_max_ps(sv));
        const float corr = std::exp(p[0] - mx);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
        _mm512_store_ps(prob, e);
        p[0] = mx;
        p[1] = p[1] * corr + _mm512_reduce_add_ps(e);
        const __m512 cv = _mm512_set1_ps(corr);
        int c = 0;
        for (; c + 128 <= dv; c += 128) weighted_sum<8>(p + 2 + c, cv, prob, vrow, c, visible);
        for (; c < dv; c += 16) weighted_sum<1>(p + 2 + c, cv, prob, vrow, c, visible);
      }
    }
  }
}

// Scores of M rows (their bf16 query rows q[r]) against the 16 keys of kt, whose 32-bit lanes hold a pair of
// head dims of one key: kt[c * 16 + key] = K[key][2c, 2c + 1].
template <int M>
AVX512BF16_TARGET inline void score_pairs(const uint16_t* const* q, int pairs, const uint32_t* kt, __m512* s) {
  for (int r = 0; r < M; ++r) s[r] = _mm512_setzero_ps();
  for (int c = 0; c < pairs; ++c) {
    const __m512bh k = as_bh(_mm512_load_si512(kt + c * 16));
    for (int r = 0; r < M; ++r) s[r] = _mm512_dpbf16_ps(s[r], as_bh(bcast32(q[r] + 2 * c)), k);
  }
}

// Columns [16j, 16j + 16) of M rows' weighted V sums (rows `stride` floats apart): acc * corr[r] + the chunk's
// keys weighted by w[r] (bf16 pairs of consecutive keys), vp[(i * blocks + j) * 16] holding keys 2i and 2i + 1
// interleaved per column.
template <int M>
AVX512BF16_TARGET inline void weigh_pairs(float* acc, int64_t stride, const float* corr, const uint32_t (*w)[kChunk / 2],
                                          const uint32_t* vp, int blocks, int npairs, int j) {
  __m512 r[M];
  for (int m = 0; m < M; ++m) r[m] = _mm512_mul_ps(_mm512_loadu_ps(acc + m * stride + 16 * j), _mm512_set1_ps(corr[m]));
  for (int i = 0; i < npairs; ++i) {
    const __m512bh v = as_bh(_mm512_load_si512(vp + (size_t(i) * blocks + j) * 16));
    for (int m = 0; m < M; ++m) r[m] = _mm512_dpbf16_ps(r[m], as_bh(_mm512_set1_epi32(int32_t(w[m][i]))), v);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc + m * stride + 16 * j, r[m]);
}

// bf16 caches on the avx512_bf16 and amx paths: vdpbf16ps multiplies pairs, so a row's scores take half the
// fp32 kernel's FMAs with K transposed as 32-bit pairs of head dims (half its shuffles, nothing widened), and the
// weighted V sum takes half with V's rows interleaved in pairs of keys. The weights are rounded to bf16 for that
// product and the running sum adds the rounded weights, so each output stays a normalized weighting.
// head_dim a multiple of 32, v_head_dim of 16.
AVX512BF16_TARGET void attend_avx512_bf16(const PagedAttention& a, const Task& t, float* part) {
  const int group = group_of(a), pairs = a.head_dim / 2, blocks = a.v_head_dim / 16, rows = t.nq * group;
  thread_local AlignedVector<uint32_t> ktbuf, vpbuf;
  thread_local std::vector<uint16_t> zero_row;
  ktbuf.resize(size_t(pairs) * 16);
  vpbuf.resize(size_t(kChunk / 2) * blocks * 16);
  uint32_t* kt = ktbuf.data();
  uint32_t* vp = vpbuf.data();
  zero_row.assign(a.v_head_dim, 0);
  const auto* k = static_cast<const uint16_t*>(a.k);
  const auto* v = static_cast<const uint16_t*>(a.v);
  const auto* q = static_cast<const uint16_t*>(a.q);
  const __m512 scale = _mm512_set1_ps(a.scale);
  // Lane 2p takes column p of the first key, lane 2p + 1 column p of the second (index bit 5: the second operand).
  alignas(64) int16_t order[32];
  for (int l = 0; l < 32; ++l) order[l] = int16_t(l % 2 ? 32 + l / 2 : l / 2);
  const __m512i interleave = _mm512_load_si512(order);
  const int64_t stride = row_floats(a);
  init_rows(a, rows, part);
  const int end = std::min(t.t1, key_limit(a, t, t.nq - 1));
  int64_t kstart[kChunk];
  const uint16_t* vrow[kChunk];
  alignas(64) uint32_t w[8][kChunk / 2];
  float corr[8];
  __m512 s[8];
  const uint16_t* qr[8];
  for (int c0 = t.t0; c0 < end; c0 += kChunk) {
    const int n = std::min(kChunk, end - c0), npairs = (n + 1) / 2;
    for (int i = 0; i < kChunk; ++i) {
      if (i >= n) {
        vrow[i] = zero_row.data();
        continue;
      }
      const int64_t idx = token_index(a, t.seq, c0 + i);
      kstart[i] = k_offset(a, t, idx);
      vrow[i] = v + v_offset(a, t, idx);
    }
    for (int c = 0; c < pairs; c += 16) {  // 16 pairs (32 bf16) of each key: a transpose of 32-bit lanes
      __m512 blk[16];
      for (int i = 0; i < 16; ++i) blk[i] = i < n ? _mm512_loadu_ps(k + kstart[i] + 2 * c) : _mm512_setzero_ps();
      transpose16(blk);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(reinterpret_cast<float*>(kt + (c + j) * 16), blk[j]);
    }
    for (int i = 0; i < npairs; ++i)
      for (int j = 0; j < blocks; ++j) {
        const __m512i first = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * i] + 16 * j)));
        const __m512i second =
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * i + 1] + 16 * j)));
        _mm512_store_si512(vp + (size_t(i) * blocks + j) * 16, _mm512_permutex2var_epi16(first, interleave, second));
      }
    for (int r0 = 0; r0 < rows; r0 += 8) {
      const int m = std::min(8, rows - r0);
      if (key_limit(a, t, (r0 + m - 1) / group) <= c0) continue;  // rows are in query order: the last sees most
      for (int r = 0; r < m; ++r) qr[r] = q + q_offset(a, t, r0 + r);
      if (m == 8) score_pairs<8>(qr, pairs, kt, s);
      else
        for (int r = 0; r < m; ++r) score_pairs<1>(qr + r, pairs, kt, s + r);
      for (int r = 0; r < m; ++r) {
        float* p = part + (r0 + r) * stride;
        const int visible = std::min(n, key_limit(a, t, (r0 + r) / group) - c0);
        if (visible <= 0) {
          corr[r] = 1.0f;
          std::fill(w[r], w[r] + kChunk / 2, 0u);
          continue;
        }
        const __mmask16 valid = __mmask16((1u << visible) - 1);
        const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), valid, _mm512_mul_ps(s[r], scale));
        const float mx = std::max(p[0], _mm512_reduce_max_ps(sv));
        corr[r] = std::exp(p[0] - mx);
        const __m256i e = reinterpret_cast<__m256i>(
            _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mx))))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(w[r]), e);
        p[0] = mx;
        p[1] = p[1] * corr[r] + _mm512_reduce_add_ps(widen_bf16(e));
      }
      float* acc = part + r0 * stride + 2;
      for (int j = 0; j < blocks; ++j) {
        if (m == 8) weigh_pairs<8>(acc, stride, corr, w, vp, blocks, npairs, j);
        else
          for (int r = 0; r < m; ++r) weigh_pairs<1>(acc + r * stride, stride, corr + r, w + r, vp, blocks, npairs, j);
      }
    }
  }
}

AVX2_TARGET inline __m256 load8(const void* base, int64_t i, bool f32) {
  if (f32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
}

// The avx2 kernel keeps rows in vector lanes: lane i of a "lane group" holds row 8g + i, so one FMA scores
// 8 rows against one key (broadcast from its fp32 row) and the online softmax runs lane-wise, without
// transposing K. Per lane group: qt [d][8] (scaled queries), then state [2 + dv][8]: max, sum, weighted V sum.
constexpr int kLanes = 8;

// Scores of a lane group against the 8 keys at k[0..7] (fp32 rows): s[j] lanes = rows.
AVX2_TARGET inline void score_lanes(const float* qt, int d, const float* const* k, __m256* s) {
  __m256 acc[kLanes];  // local and unrolled, so that GCC keeps it in registers (see weigh_lanes)
#pragma GCC unroll 8
  for (int j = 0; j < kLanes; ++j) acc[j] = _mm256_setzero_ps();
  for (int c = 0; c < d; ++c) {
    const __m256 q = _mm256_load_ps(qt + c * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(k[j] + c), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < kLanes; ++j) s[j] = acc[j];
}

// Columns [c, c + W) of a lane group's weighted V sum: out = out * corr + sum_j prob[j] * v[j][c..].
// Every loop over `acc` is unrolled by pragma: otherwise GCC keeps the array in memory and stores it on every key.
template <int W>
AVX2_TARGET inline void weigh_lanes(float* out, __m256 corr, const float* prob, const float* const* v, int c, int n) {
  float* o = out + c * kLanes;
  __m256 acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = _mm256_mul_ps(_mm256_load_ps(o + i * kLanes), corr);
  for (int j = 0; j < n; ++j) {
    const __m256 p = _mm256_load_ps(prob + j * kLanes);
    const float* vj = v[j] + c;
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(vj + i), acc[i]);
  }
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) _mm256_store_ps(o + i * kLanes, acc[i]);
}

// head_dim and v_head_dim multiples of 8.
AVX2_TARGET void attend_avx2(const PagedAttention& a, const Task& t, float* part) {
  const int group = group_of(a), d = a.head_dim, dv = a.v_head_dim, rows = t.nq * group;
  const int lane_groups = (rows + kLanes - 1) / kLanes, elem = a.f32 ? 4 : 2;
  const int64_t state_floats = int64_t(2 + dv) * kLanes;
  thread_local std::vector<float, CacheAligned<float>> qt, state, limits, kbuf, vbuf;
  qt.assign(size_t(lane_groups) * d * kLanes, 0.0f);
  state.assign(size_t(lane_groups) * state_floats, 0.0f);
  limits.assign(size_t(lane_groups) * kLanes, 0.0f);
  kbuf.resize(size_t(kChunk) * d);
  vbuf.resize(size_t(kChunk) * dv);
  const int end = std::min(t.t1, key_limit(a, t, t.nq - 1));
  for (int r = 0; r < rows; ++r) {
    const int64_t q0 = q_offset(a, t, r);
    float* dst = qt.data() + size_t(r / kLanes) * d * kLanes + r % kLanes;
    for (int c = 0; c < d; ++c) dst[c * kLanes] = load(a.q, q0 + c, a.f32) * a.scale;
    limits[r] = static_cast<float>(std::min(end, key_limit(a, t, r / group)));  // a lane past `rows` sees none
  }
  for (int g = 0; g < lane_groups; ++g) std::fill_n(state.data() + g * state_floats, kLanes, kNegInf);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const float* krow[kChunk];
  const float* vrow[kChunk];
  alignas(32) float prob[kChunk * kLanes];
  __m256 s[kChunk];
  for (int c0 = t.t0; c0 < end; c0 += kChunk) {
    const int n = std::min(kChunk, end - c0);
    for (int i = 0; i < kChunk; ++i) {
      const int64_t idx = token_index(a, t.seq, c0 + std::min(i, n - 1));  // past n: a real key, masked out
      const int64_t k0 = k_offset(a, t, idx), v0 = v_offset(a, t, idx);
      if (a.f32) {
        krow[i] = static_cast<const float*>(a.k) + k0;
        vrow[i] = static_cast<const float*>(a.v) + v0;
      } else if (i < n) {
        float* kd = kbuf.data() + size_t(i) * d;
        float* vd = vbuf.data() + size_t(i) * dv;
        for (int c = 0; c < d; c += 8) _mm256_storeu_ps(kd + c, load8(a.k, k0 + c, false));
        for (int c = 0; c < dv; c += 8) _mm256_storeu_ps(vd + c, load8(a.v, v0 + c, false));
        krow[i] = kd;
        vrow[i] = vd;
      } else {
        krow[i] = krow[n - 1];
        vrow[i] = vrow[n - 1];
      }
    }
    // The next chunk's K and V rows start loading now: a task reads one head's slice of each token, a
    // stride the hardware prefetchers do not follow.
    for (int i = c0 + kChunk; i < std::min(c0 + 2 * kChunk, end); ++i) {
      const int64_t idx = token_index(a, t.seq, i);
      const char* k = static_cast<const char*>(a.k) + k_offset(a, t, idx) * elem;
      const char* v = static_cast<const char*>(a.v) + v_offset(a, t, idx) * elem;
      for (int b = 0; b < d * elem; b += 64) _mm_prefetch(k + b, _MM_HINT_T0);
      for (int b = 0; b < dv * elem; b += 64) _mm_prefetch(v + b, _MM_HINT_T0);
    }
    for (int g = 0; g < lane_groups; ++g) {
      // rows are in query order: the group's last row sees most
      if (key_limit(a, t, (std::min(rows, (g + 1) * kLanes) - 1) / group) <= c0) continue;
      const __m256 limit = _mm256_load_ps(limits.data() + g * kLanes);
      for (int h = 0; h < n; h += kLanes) score_lanes(qt.data() + size_t(g) * d * kLanes, d, krow + h, s + h);
      float* st = state.data() + g * state_floats;
      const __m256 old_max = _mm256_load_ps(st);
      __m256 mx = old_max;
      for (int j = 0; j < n; ++j) {
        const __m256 valid = _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(c0 + j)), limit, _CMP_LT_OQ);
        s[j] = _mm256_blendv_ps(neg_inf, s[j], valid);
        mx = _mm256_max_ps(mx, s[j]);
      }
      // A lane that has seen no key keeps max -inf; it subtracts 0 instead so that no inf - inf appears.
      const __m256 base = _mm256_andnot_ps(_mm256_cmp_ps(mx, neg_inf, _CMP_EQ_OQ), mx);
      const __m256 corr = exp256(_mm256_sub_ps(old_max, base));
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < n; ++j) {
        const __m256 e = _mm256_and_ps(_mm256_cmp_ps(s[j], neg_inf, _CMP_NEQ_UQ), exp256(_mm256_sub_ps(s[j], base)));
        _mm256_store_ps(prob + j * kLanes, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_store_ps(st, mx);
      _mm256_store_ps(st + kLanes, _mm256_fmadd_ps(_mm256_load_ps(st + kLanes), corr, sum));
      float* out = st + 2 * kLanes;
      int c = 0;
      for (; c + 12 <= dv; c += 12) weigh_lanes<12>(out, corr, prob, vrow, c, n);
      if (dv - c >= 8) {
        weigh_lanes<8>(out, corr, prob, vrow, c, n);
        c += 8;
      }
      if (dv - c >= 4) weigh_lanes<4>(out, corr, prob, vrow, c, n);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float* st = state.data() + (r / kLanes) * state_floats + r % kLanes;
    float* p = part + r * row_floats(a);
    for (int i = 0; i < 2 + dv; ++i) p[i] = st[i * kLanes];
  }
}

// Output row (query, head) from its partial rows in `slices` consecutive tasks of task_floats each.
void merge(const PagedAttention& a, const float* part, int64_t task_floats, int64_t task0, int slices, int row,
           int64_t out_row) {
  const int dv = a.v_head_dim;
  const auto at = [&](int i) { return part + (task0 + i) * task_floats + row * row_floats(a); };
  float m = kNegInf;
  for (int i = 0; i < slices; ++i) m = std::max(m, at(i)[0]);
  float weight[kMaxSlices];
  float total = 0.0f;
  for (int i = 0; i < slices; ++i) total += at(i)[1] * (weight[i] = std::exp(at(i)[0] - m));
  // Slice by slice over contiguous columns (the compiler vectorizes these loops; a column at a time it did not).
  thread_local std::vector<float> sum;
  sum.assign(dv, 0.0f);
  for (int i = 0; i < slices; ++i) {
    const float* src = at(i) + 2;
    const float w = weight[i];
    for (int c = 0; c < dv; ++c) sum[c] += src[c] * w;
  }
  if (a.f32) {
    float* out = static_cast<float*>(a.out) + out_row * dv;
    for (int c = 0; c < dv; ++c) out[c] = sum[c] / total;
  } else {
    uint16_t* out = static_cast<uint16_t*>(a.out) + out_row * dv;
    for (int c = 0; c < dv; ++c) out[c] = f32_to_bf16(sum[c] / total);
  }
}

}  // namespace

void check_paged_attention(const PagedAttention& a) {
  const auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  const int64_t capacity = int64_t(a.table_width) * a.block_size;
  int64_t queries = 0;
  for (int s = 0; s < a.num_seqs; ++s) {
    const int len = a.context_lens[s], nq = a.query_lens[s];
    if (len < 1 || len > capacity) fail("context lengths must be in [1, " + std::to_string(capacity) + "]");
    if (nq < 1 || nq > len) fail("every sequence needs 1 to context-length query tokens");
    queries += nq;
    const int32_t* table = a.block_tables + int64_t(s) * a.table_width;
    for (int b = 0; b < (len + a.block_size - 1) / a.block_size; ++b)
      if (table[b] < 0 || table[b] >= a.num_blocks)
        fail("block tables must index the cache's " + std::to_string(a.num_blocks) + " blocks");
  }
  if (queries != a.num_queries)
    fail("query lengths add up to " + std::to_string(queries) + ", but there are " + std::to_string(a.num_queries) +
         " query rows");
}

void paged_attention(ThreadPool& pool, const PagedAttention& a, Isa isa) {
  check_paged_attention(a);
  const int group = group_of(a);
  const int tile = std::max(1, kTileRows / group);  // queries per task
  // Tasks of sequence s: first[s] + (kv_head * tiles[s] + query tile) * slices[s] + slice.
  std::vector<int64_t> first(a.num_seqs), row0(a.num_seqs);
  std::vector<int> tiles(a.num_seqs), slices(a.num_seqs);
  std::vector<Task> work;
  int64_t rows = 0, unsliced = 0;
  for (int s = 0; s < a.num_seqs; ++s) unsliced += int64_t(a.num_kv_heads) * ((a.query_lens[s] + tile - 1) / tile);
  const int64_t want = int64_t(kTasksPerThread) * pool.size();
  const int split = static_cast<int>(std::clamp<int64_t>((want + unsliced - 1) / unsliced, 1, kMaxSlices));
  for (int s = 0; s < a.num_seqs; ++s) {
    const int len = a.context_lens[s], nq = a.query_lens[s];
    const int per = nq == 1 ? std::max(kSliceTokens, (len + split - 1) / split) : len;
    slices[s] = (len + per - 1) / per;
    tiles[s] = (nq + tile - 1) / tile;
    first[s] = static_cast<int64_t>(work.size());
    row0[s] = rows;
    for (int h = 0; h < a.num_kv_heads; ++h)
      for (int qt = 0; qt < tiles[s]; ++qt)
        for (int i = 0; i < slices[s]; ++i)
          work.push_back({s, h, qt * tile, std::min(tile, nq - qt * tile), i * per, std::min(len, (i + 1) * per),
                          rows + qt * tile});
    rows += nq;
  }
  thread_local std::vector<float> part;
  const int64_t task_floats = int64_t(tile) * group * row_floats(a);
  part.resize(work.size() * task_floats);
  const bool pairs = avx512_bf16(isa) && !a.f32 && a.head_dim % 32 == 0 && a.v_head_dim % 16 == 0;
  const bool wide = avx512(isa) && a.head_dim % 16 == 0 && a.v_head_dim % 16 == 0;
  // AVX-512 paths take the avx2 kernel where a head dimension is a multiple of 8 but not of 16.
  const bool avx2 = !wide && runs_avx2(isa) && a.head_dim % 8 == 0 && a.v_head_dim % 8 == 0;
  float* parts = part.data();
  pool.run(static_cast<int>(work.size()), [&](int i, int) {
    if (pairs) attend_avx512_bf16(a, work[i], parts + i * task_floats);
    else if (wide) attend_avx512(a, work[i], parts + i * task_floats);
    else if (avx2) attend_avx2(a, work[i], parts + i * task_floats);
    else attend_generic(a, work[i], parts + i * task_floats);
  });
  // One merge task per (sequence, query); `seq_of` finds the sequence of a query row.
  std::vector<int> seq_of(rows);
  for (int s = 0; s < a.num_seqs; ++s) std::fill(seq_of.begin() + row0[s], seq_of.begin() + row0[s] + a.query_lens[s], s);
  pool.run(static_cast<int>(rows), [&](int qrow, int) {
    const int s = seq_of[qrow], qi = static_cast<int>(qrow - row0[s]);
    for (int h = 0; h < a.num_heads; ++h) {
      const int64_t task0 = first[s] + (int64_t(h / group) * tiles[s] + qi / tile) * slices[s];
      merge(a, parts, task_floats, task0, slices[s], (qi % tile) * group + h % group, int64_t(qrow) * a.num_heads + h);
    }
  });
}

void MoeRunner::attention(const PagedAttention& a, Isa isa) {
  check_isa(isa);
  std::lock_guard<std::mutex> lock(mutex_);
  paged_attention(pool_, a, isa);
}

void store_rows(const StoreRows& s) {
  for (int64_t i = 0; i < s.rows; ++i)
    if (s.slots[i] < 0 || s.slots[i] >= s.num_slots)
      throw std::invalid_argument("cache slot " + std::to_string(s.slots[i]) + " of row " + std::to_string(i) +
                                  " is outside the cache's " + std::to_string(s.num_slots) + " slots");
  for (int64_t i = 0; i < s.rows; ++i)
    std::memcpy(static_cast<uint8_t*>(s.cache) + s.slots[i] * s.slot_stride,
                static_cast<const uint8_t*>(s.src) + i * s.src_stride, s.row_bytes);
}

}  // namespace hybridd
