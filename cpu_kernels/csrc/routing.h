// Softmax top-k routing (Qwen3-MoE, Mixtral): probabilities = softmax(logits) in fp32, the k largest with
// their expert ids, optionally renormalized to sum to one, then rounded to the logits' dtype. The selection
// repeats torch.topk's own (the same comparator through nth_element + sort), so experts that tie are chosen
// and ordered as the reference models choose them.
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

}  // namespace hybridd
