// Decode attention over a paged KV cache (see attention.h). A task attends one context slice of one KV head
// for the query heads that share it, 16 tokens at a time: their K and V rows are gathered from the cache
// blocks (bf16 widened to fp32 once, shared by every query head), scored, and folded into a running
// max / sum / weighted V sum per head. Probabilities stay fp32 throughout.
#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace hybridd {

namespace {

#define ATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

constexpr int kSliceTokens = 256;  // context tokens per task: long contexts spread over every thread
constexpr int kChunk = 16;         // tokens gathered and scored together

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float load(const void* base, int64_t i, bool f32) {
  return f32 ? static_cast<const float*>(base)[i] : bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

struct Slice {
  int seq, kv_head, t0, t1;
};

// Per task and query head: running max, running sum, then the v_head_dim weighted V sum.
inline int64_t partial_floats(const DecodeAttention& a) { return 2 + a.v_head_dim; }

inline int64_t token_index(const DecodeAttention& a, int seq, int t) {
  const int32_t block = a.block_tables[int64_t(seq) * a.table_width + t / a.block_size];
  return int64_t(block) * a.block_size + t % a.block_size;
}

void attend_slice_generic(const DecodeAttention& a, const Slice& s, float* part) {
  const int group = a.num_heads / a.num_kv_heads, d = a.head_dim, dv = a.v_head_dim;
  thread_local std::vector<float> q;
  q.resize(size_t(group) * d);
  for (int g = 0; g < group; ++g)
    for (int i = 0; i < d; ++i)
      q[size_t(g) * d + i] = load(a.q, (int64_t(s.seq) * a.num_heads + s.kv_head * group + g) * d + i, a.f32) * a.scale;
  for (int g = 0; g < group; ++g) {
    float* p = part + g * partial_floats(a);
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.0f;
    std::fill(p + 2, p + 2 + dv, 0.0f);
  }
  for (int t = s.t0; t < s.t1; ++t) {
    const int64_t idx = token_index(a, s.seq, t);
    const int64_t k0 = idx * a.k_token_stride + s.kv_head * a.k_head_stride;
    const int64_t v0 = idx * a.v_token_stride + s.kv_head * a.v_head_stride;
    for (int g = 0; g < group; ++g) {
      float* p = part + g * partial_floats(a);
      float score = 0.0f;
      for (int i = 0; i < d; ++i) score += q[size_t(g) * d + i] * load(a.k, k0 + i, a.f32);
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

// e^x for x <= 0 (x = score - running max): 2^n * e^r with |r| <= ln2 / 2, degree-7 Taylor polynomial
// (truncation < 6e-9 relative), scalef for 2^n, which also flushes very negative x to 0.
ATTN_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

ATTN_AVX512 inline __m512 load16(const void* base, int64_t i, bool f32) {
  if (f32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rows of `n` tokens as fp32 pointers: fp32 caches are read in place, bf16 rows widened into `buf`.
ATTN_AVX512 void gather_rows(const void* cache, const int64_t* start, int n, int width, bool f32, float* buf,
                             const float** rows) {
  for (int i = 0; i < n; ++i) {
    if (f32) {
      rows[i] = static_cast<const float*>(cache) + start[i];
      continue;
    }
    float* dst = buf + size_t(i) * width;
    for (int c = 0; c < width; c += 16) _mm512_storeu_ps(dst + c, load16(cache, start[i] + c, false));
    rows[i] = dst;
  }
}

// acc[0, 16W) = acc * corr + sum_i p[i] * v[i][0, 16W), W registers of accumulators.
template <int W>
ATTN_AVX512 inline void weighted_sum(float* acc, __m512 corr, const float* p, const float* const* v, int off, int n) {
  __m512 r[W];
  for (int j = 0; j < W; ++j) r[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), corr);
  for (int i = 0; i < n; ++i) {
    const __m512 w = _mm512_set1_ps(p[i]);
    for (int j = 0; j < W; ++j) r[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v[i] + off + 16 * j), r[j]);
  }
  for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc + 16 * j, r[j]);
}

// head_dim and v_head_dim multiples of 16.
ATTN_AVX512 void attend_slice_avx512(const DecodeAttention& a, const Slice& s, float* part) {
  const int group = a.num_heads / a.num_kv_heads, d = a.head_dim, dv = a.v_head_dim;
  thread_local std::vector<float> q, kbuf, vbuf;
  q.resize(size_t(group) * d);
  kbuf.resize(size_t(kChunk) * d);
  vbuf.resize(size_t(kChunk) * dv);
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < group; ++g) {
    const int64_t q0 = (int64_t(s.seq) * a.num_heads + s.kv_head * group + g) * d;
    for (int c = 0; c < d; c += 16) _mm512_storeu_ps(&q[size_t(g) * d + c], _mm512_mul_ps(load16(a.q, q0 + c, a.f32), scale));
    float* p = part + g * partial_floats(a);
    p[0] = -std::numeric_limits<float>::infinity();
    p[1] = 0.0f;
    std::fill(p + 2, p + 2 + dv, 0.0f);
  }
  int64_t kstart[kChunk], vstart[kChunk];
  const float* krow[kChunk + 3];
  const float* vrow[kChunk];
  alignas(64) float score[kChunk], prob[kChunk];
  for (int c0 = s.t0; c0 < s.t1; c0 += kChunk) {
    const int n = std::min(kChunk, s.t1 - c0);
    for (int i = 0; i < n; ++i) {
      const int64_t idx = token_index(a, s.seq, c0 + i);
      kstart[i] = idx * a.k_token_stride + s.kv_head * a.k_head_stride;
      vstart[i] = idx * a.v_token_stride + s.kv_head * a.v_head_stride;
    }
    gather_rows(a.k, kstart, n, d, a.f32, kbuf.data(), krow);
    gather_rows(a.v, vstart, n, dv, a.f32, vbuf.data(), vrow);
    for (int i = n; i < n + 3; ++i) krow[i] = krow[n - 1];  // groups of four read past the end harmlessly
    const __mmask16 valid = __mmask16((1u << n) - 1);
    for (int g = 0; g < group; ++g) {
      const float* qg = &q[size_t(g) * d];
      for (int i = 0; i < n; i += 4) {
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int c = 0; c < d; c += 16) {
          const __m512 qv = _mm512_loadu_ps(qg + c);
          s0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[i] + c), s0);
          s1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[i + 1] + c), s1);
          s2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[i + 2] + c), s2);
          s3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[i + 3] + c), s3);
        }
        score[i] = _mm512_reduce_add_ps(s0);
        if (i + 1 < kChunk) score[i + 1] = _mm512_reduce_add_ps(s1);
        if (i + 2 < kChunk) score[i + 2] = _mm512_reduce_add_ps(s2);
        if (i + 3 < kChunk) score[i + 3] = _mm512_reduce_add_ps(s3);
      }
      float* p = part + g * partial_floats(a);
      const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, score);
      const float m = std::max(p[0], _mm512_reduce_max_ps(sv));
      const float corr = std::exp(p[0] - m);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(sv, _mm512_set1_ps(m))));
      _mm512_store_ps(prob, e);
      p[0] = m;
      p[1] = p[1] * corr + _mm512_reduce_add_ps(e);
      const __m512 cv = _mm512_set1_ps(corr);
      int c = 0;
      for (; c + 128 <= dv; c += 128) weighted_sum<8>(p + 2 + c, cv, prob, vrow, c, n);
      for (; c < dv; c += 16) weighted_sum<1>(p + 2 + c, cv, prob, vrow, c, n);
    }
  }
}

void merge_slices(const DecodeAttention& a, const float* part, int first, int slices, int seq, int head) {
  const int group = a.num_heads / a.num_kv_heads, dv = a.v_head_dim;
  const int kvh = head / group, g = head % group;
  const auto at = [&](int i) { return part + (int64_t(first + kvh * slices + i) * group + g) * partial_floats(a); };
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < slices; ++i) m = std::max(m, at(i)[0]);
  float weight[64];
  float total = 0.0f;
  for (int i = 0; i < slices; ++i) total += at(i)[1] * (weight[i] = std::exp(at(i)[0] - m));
  const int64_t o = (int64_t(seq) * a.num_heads + head) * dv;
  for (int c = 0; c < dv; ++c) {
    float sum = 0.0f;
    for (int i = 0; i < slices; ++i) sum += at(i)[2 + c] * weight[i];
    const float v = sum / total;
    if (a.f32) static_cast<float*>(a.out)[o + c] = v;
    else static_cast<uint16_t*>(a.out)[o + c] = f32_to_bf16(v);
  }
}

}  // namespace

void decode_attention(ThreadPool& pool, const DecodeAttention& a, Isa isa) {
  const int group = a.num_heads / a.num_kv_heads;
  // Slices per sequence: at most 64 (merge_slices' weights) and kSliceTokens each below that.
  std::vector<int> first(a.num_seqs), slices(a.num_seqs);
  std::vector<Slice> work;
  for (int s = 0; s < a.num_seqs; ++s) {
    const int len = a.context_lens[s];
    const int per = std::max(kSliceTokens, (len + 63) / 64);
    slices[s] = (len + per - 1) / per;
    first[s] = static_cast<int>(work.size());
    for (int h = 0; h < a.num_kv_heads; ++h)
      for (int i = 0; i < slices[s]; ++i) work.push_back({s, h, i * per, std::min(len, (i + 1) * per)});
  }
  thread_local std::vector<float> part;
  part.resize(work.size() * group * (2 + a.v_head_dim));
  const bool wide = (isa == Isa::kAvx512Bf16 || isa == Isa::kAmx) && a.head_dim % 16 == 0 && a.v_head_dim % 16 == 0;
  float* parts = part.data();
  pool.run(static_cast<int>(work.size()), [&](int i, int) {
    float* p = parts + int64_t(i) * group * (2 + a.v_head_dim);
    if (wide) attend_slice_avx512(a, work[i], p);
    else attend_slice_generic(a, work[i], p);
  });
  pool.run(a.num_seqs * a.num_heads, [&](int i, int) {
    const int s = i / a.num_heads;
    merge_slices(a, parts, first[s], slices[s], s, i % a.num_heads);
  });
}

void MoeRunner::attention(const DecodeAttention& a, Isa isa) {
  check_isa(isa);
  std::lock_guard<std::mutex> lock(mutex_);
  decode_attention(pool_, a, isa);
}

}  // namespace hybridd
