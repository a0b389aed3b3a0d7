// Softmax and grouped top-k routing (routing.h).
#include "routing.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "moe.h"
#include "simd_math.h"

namespace hybridd {
namespace {

using Entry = std::pair<float, int64_t>;

// torch.topk(largest=True)'s order: NaN first, then by value. Which of several equal values comes first is
// whatever the standard algorithms below make of this comparator, exactly as in ATen's topk_impl_loop.
bool before(const Entry& a, const Entry& b) {
  return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
}

// The first k entries of `queue` become torch.topk(k)'s picks, in its order (sorted, or as left unsorted).
void select(std::vector<Entry>& queue, int64_t k, bool sorted) {
  const int64_t n = static_cast<int64_t>(queue.size());
  // ATen sorts partially when k * 64 <= n, else selects the k-th and (if sorted) sorts the k - 1 before it.
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
    if (sorted) std::sort(queue.begin(), queue.begin() + k - 1, before);
  }
}

template <typename T>
void softmax_topk_typed(const SoftmaxTopK& r, int64_t t0, int64_t t1) {
  const int64_t e = r.experts;
  thread_local std::vector<Entry> queue;
  thread_local std::vector<float> p;
  queue.resize(e);
  p.resize(e);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < e; ++j) p[j] = element_f32(static_cast<const T*>(r.logits)[t * e + j]);
    float mx = p[0];
    for (int64_t j = 1; j < e; ++j) mx = std::max(mx, p[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < e; ++j) sum += p[j] = std::exp(p[j] - mx);
    const float inv = 1.0f / sum;  // torch scales by the reciprocal, not by dividing
    for (int64_t j = 0; j < e; ++j) queue[j] = {p[j] * inv, j};
    select(queue, r.k, true);
    float total = 0.0f;
    for (int j = 0; j < r.k; ++j) total += queue[j].first;
    for (int j = 0; j < r.k; ++j) {
      const float w = r.renormalize ? queue[j].first / total : queue[j].first;
      r.ids[t * r.k + j] = static_cast<int32_t>(queue[j].second);
      static_cast<T*>(r.weights)[t * r.k + j] = element_from_f32<T>(w);
    }
  }
}

}  // namespace

void softmax_topk_rows(const SoftmaxTopK& r, int64_t t0, int64_t t1) {
  if (r.f32) softmax_topk_typed<float>(r, t0, t1);
  else softmax_topk_typed<uint16_t>(r, t0, t1);
}

void grouped_topk_rows(const GroupedTopK& r, int64_t t0, int64_t t1) {
  const int64_t e = r.experts, per_group = e / r.groups;
  thread_local std::vector<Entry> queue, group_queue;
  thread_local std::vector<float> choice;
  thread_local std::vector<char> kept;
  choice.resize(e);
  kept.resize(r.groups);
  group_queue.resize(r.groups);
  for (int64_t t = t0; t < t1; ++t) {
    const float* scores = r.scores + t * e;
    for (int64_t j = 0; j < e; ++j) choice[j] = scores[j] + r.bias[j];
    for (int g = 0; g < r.groups; ++g) {
      queue.resize(per_group);
      for (int64_t j = 0; j < per_group; ++j) queue[j] = {choice[g * per_group + j], j};
      select(queue, 2, true);
      group_queue[g] = {queue[0].first + queue[1].first, g};
    }
    select(group_queue, r.keep_groups, false);
    std::fill(kept.begin(), kept.end(), 0);
    for (int g = 0; g < r.keep_groups; ++g) kept[group_queue[g].second] = 1;
    queue.resize(e);
    for (int64_t j = 0; j < e; ++j) queue[j] = {kept[j / per_group] ? choice[j] : -INFINITY, j};
    select(queue, r.k, false);
    float total = 0.0f;
    for (int j = 0; j < r.k; ++j) total += scores[queue[j].second];
    for (int j = 0; j < r.k; ++j) {
      const float w = scores[queue[j].second];
      r.ids[t * r.k + j] = static_cast<int32_t>(queue[j].second);
      r.weights[t * r.k + j] = (r.renormalize ? w / (total + 1e-20f) : w) * r.scaling;
    }
  }
}

// A routed row (an exp or a comparison per expert, and a selection) weighs about 16 elements of a streaming op:
// prefill batches of 32+ tokens go to the pool, decode stays on the calling thread.
constexpr int64_t kElementsPerExpert = 16;

void MoeRunner::softmax_topk(const SoftmaxTopK& r) {
  run_rows(r.tokens, r.experts * kElementsPerExpert, [&](int64_t t0, int64_t t1) { softmax_topk_rows(r, t0, t1); });
}

void MoeRunner::grouped_topk(const GroupedTopK& r) {
  run_rows(r.tokens, r.experts * kElementsPerExpert, [&](int64_t t0, int64_t t1) { grouped_topk_rows(r, t0, t1); });
}

}  // namespace hybridd
