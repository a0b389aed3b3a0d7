// Causal attention of query spans over a paged KV cache (decode: one query per sequence; prefill / extend:
// the span's last tokens), for GQA (many KV heads) and MLA in latent space (one KV head whose V is the first
// Dv columns of K). A task is (sequence, KV head, tile of queries, context slice) and keeps an online
// softmax per (query, head) row; decode spreads a long context over slices, merged at the end.
#pragma once

#include <cstdint>

#include "moe.h"
#include "thread_pool.h"

namespace hybridd {

struct PagedAttention {
  const void* q = nullptr;  // [num_queries, num_heads, head_dim], sequence s's rows after those of s - 1
  void* out = nullptr;      // [num_queries, num_heads, v_head_dim]
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
  // [num_seqs], 1 <= query_lens[s] <= context_lens[s]: query i of s sits at context_lens[s] - query_lens[s] + i
  const int32_t* query_lens = nullptr;
  float scale = 1.0f;
  int64_t num_queries = 0;  // rows of q: the query lengths' sum
  int64_t num_blocks = 0;   // blocks of the caches, which the block tables index
};

// Throws std::invalid_argument unless the lengths and the used block table entries are in range (above).
void check_paged_attention(const PagedAttention& a);

void paged_attention(ThreadPool& pool, const PagedAttention& a, Isa isa);

// A step's key (or value, or latent) rows into their cache slots: row i, at src + i * src_stride bytes, to
// cache + slots[i] * slot_stride (a slot's row may be part of a wider one: MLA's latent and rope key).
struct StoreRows {
  void* cache = nullptr;
  int64_t num_slots = 0;  // slots of the cache: blocks * block_size
  int64_t slot_stride = 0;  // bytes between slots
  const int64_t* slots = nullptr;
  const void* src = nullptr;
  int64_t src_stride = 0;  // bytes between source rows
  int64_t rows = 0, row_bytes = 0;
};

// Throws std::invalid_argument, before writing anything, for a slot outside [0, num_slots).
void store_rows(const StoreRows& s);

}  // namespace hybridd
