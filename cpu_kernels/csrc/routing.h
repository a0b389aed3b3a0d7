// Top-k expert routing after the router's linear. Selections repeat torch.topk's own (the same comparator
// through nth_element + sort), so experts that tie are chosen and ordered as the reference models choose them.
//
// Softmax top-k (Qwen3-MoE, Mixtral): probabilities = softmax(logits) in fp32, the k largest with their expert
// ids, optionally renormalized to sum to one, then rounded to the logits' dtype.
//
// Grouped top-k (DeepSeek-V3's noaux_tc), over sigmoid scores: choice = score + bias; the topk_group groups
// with the largest sums of their two best choices stay; the k best choices among their experts are picked
// (in torch.topk(sorted=False)'s order) and weighted by their scores, optionally divided by their sum
// + 1e-20, times the scaling factor; all fp32, the same operations as the torch code in the same order.
#pragma once

#include <cstdint>

namespace hybridd {

struct SoftmaxTopK {
  const void* logits = nullptr;  // [tokens, experts]
  bool f32 = false;              // logits and weights fp32 (else bf16)
  int64_t tokens = 0, experts = 0;
  int k = 0;  // 1 <= k <= experts
  bool renormalize = false;
  int32_t* ids = nullptr;  // [tokens, k], by falling probability
  void* weights = nullptr;  // [tokens, k] in the logits' dtype
};

// Routes tokens [t0, t1).
void softmax_topk_rows(const SoftmaxTopK& r, int64_t t0, int64_t t1);

struct GroupedTopK {
  const float* scores = nullptr;  // [tokens, experts], sigmoid of the router logits
  const float* bias = nullptr;    // [experts], e_score_correction_bias
  int64_t tokens = 0, experts = 0;
  int k = 0, groups = 0, keep_groups = 0;  // experts % groups == 0, 2 <= experts / groups, k <= kept experts
  bool renormalize = false;
  float scaling = 1.0f;
  int32_t* ids = nullptr;  // [tokens, k]
  float* weights = nullptr;  // [tokens, k]
};

void grouped_topk_rows(const GroupedTopK& r, int64_t t0, int64_t t1);

}  // namespace hybridd
