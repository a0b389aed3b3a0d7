// Rotary position embedding (rope.h). Built for baseline x86-64 with no FMA in reach, so the compiler cannot
// contract a product and a sum into one rounding: every step rounds as torch's separate ops do.
#include "rope.h"

#include <algorithm>

#include "moe.h"
#include "simd_math.h"

namespace hybridd {
namespace {

template <typename T>
float load(const T* p, int64_t i) {
  if constexpr (sizeof(T) == 4) return p[i];
  else return bf16_to_f32(p[i]);
}

// v stored in T and read back.
template <typename T>
float round_to(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else return bf16_to_f32(f32_to_bf16(v));
}

template <typename T>
void store(T* p, int64_t i, float v) {
  if constexpr (sizeof(T) == 4) p[i] = v;
  else p[i] = f32_to_bf16(v);
}

template <typename T>
void rotate(const Rope& r, int64_t t0, int64_t t1) {
  const int64_t d = r.dim, half = d / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const T* cos = static_cast<const T*>(r.cos) + t * d;
    const T* sin = static_cast<const T*>(r.sin) + t * d;
    for (int64_t h = 0; h < r.heads; ++h) {
      const T* x = static_cast<const T*>(r.x) + t * r.token_stride + h * r.head_stride;
      T* out = static_cast<T*>(r.out) + (t * r.heads + h) * d;
      for (int64_t j = 0; j < half; ++j) {
        const float c = load(cos, j), s = load(sin, j);
        // a: the element rotated into position j (torch's x1 / first half), b: into position j + half.
        const float a = load(x, r.interleave ? 2 * j : j), b = load(x, r.interleave ? 2 * j + 1 : j + half);
        const float c2 = r.interleave ? c : load(cos, j + half), s2 = r.interleave ? s : load(sin, j + half);
        store(out, j, round_to<T>(a * c) - round_to<T>(b * s));
        store(out, j + half, round_to<T>(b * c2) + round_to<T>(a * s2));
      }
    }
  }
}

}  // namespace

void rope_rows(const Rope& r, int64_t t0, int64_t t1) {
  if (r.f32) rotate<float>(r, t0, t1);
  else rotate<uint16_t>(r, t0, t1);
}

void MoeRunner::rope(const Rope& r) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int tasks = static_cast<int>(std::min<int64_t>(r.tokens, 4 * num_threads()));
  run(tasks, r.tokens * r.heads * r.dim,
      [&](int t, int) { rope_rows(r, r.tokens * t / tasks, r.tokens * (t + 1) / tasks); });
}

}  // namespace hybridd
