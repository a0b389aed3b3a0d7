// Decode attention: one query token per sequence over a paged KV cache, for GQA (many KV heads) and MLA in
// latent space (one KV head whose V is the first Dv columns of K). Split-KV: each (sequence, KV head,
// context slice) is one task that keeps an online softmax; the slices are merged at the end.
#pragma once

#include <cstdint>

#include "moe.h"
#include "thread_pool.h"

namespace hybridd {

struct DecodeAttention {
  const void* q = nullptr;  // [num_seqs, num_heads, head_dim]
  void* out = nullptr;      // [num_seqs, num_heads, v_head_dim]
  bool f32 = false;         // q, caches and out are fp32 (else bf16)
  int num_seqs = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, v_head_dim = 0;
  // Element strides: token (block b, offset o) is at cache + (b * block_size + o) * token_stride.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_token_stride = 0, k_head_stride = 0, v_token_stride = 0, v_head_stride = 0;
  int block_size = 0;
  const int32_t* block_tables = nullptr;  // [num_seqs, table_width]
  int table_width = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs], each >= 1 and <= table_width * block_size
  float scale = 1.0f;
};

void decode_attention(ThreadPool& pool, const DecodeAttention& a, Isa isa);

}  // namespace hybridd
