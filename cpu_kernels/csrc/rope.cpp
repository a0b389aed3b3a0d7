// Rotary position embedding (rope.h). Built with -ffp-contract=off (setup.py), so the compiler does not
// contract a product and a sum into one rounding: every step rounds as torch's separate ops do.
#include "rope.h"

#include "moe.h"
#include "simd_math.h"

namespace hybridd {
namespace {

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
        const float c = element_f32(cos[j]), s = element_f32(sin[j]);
        // a: the element rotated into position j (torch's x1 / first half), b: into position j + half.
        const float a = element_f32(x[r.interleave ? 2 * j : j]);
        const float b = element_f32(x[r.interleave ? 2 * j + 1 : j + half]);
        const float c2 = r.interleave ? c : element_f32(cos[j + half]);
        const float s2 = r.interleave ? s : element_f32(sin[j + half]);
        out[j] = element_from_f32<T>(stored_as<T>(a * c) - stored_as<T>(b * s));
        out[j + half] = element_from_f32<T>(stored_as<T>(b * c2) + stored_as<T>(a * s2));
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
  run_rows(r.tokens, r.heads * r.dim, [&](int64_t t0, int64_t t1) { rope_rows(r, t0, t1); });
}

}  // namespace hybridd
