// Rotary position embedding as the reference models compute it, each product and sum rounded to the dtype as
// torch's elementwise ops round them (so bf16 and fp32 results are bit-identical to the torch code):
//   half-split (Qwen, Llama): out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[h:] | x[:h]];
//   interleaved (DeepSeek): out = [x_even * cos - x_odd * sin | x_odd * cos + x_even * sin] (cos, sin: first half).
#pragma once

#include <cstdint>

namespace hybridd {

struct Rope {
  const void* x = nullptr;  // element (t, h, j) at x + t * token_stride + h * head_stride + j
  int64_t token_stride = 0, head_stride = 0;
  void* out = nullptr;  // [tokens, heads, dim], contiguous
  const void* cos = nullptr;  // [tokens, dim], contiguous
  const void* sin = nullptr;
  int64_t tokens = 0, heads = 0, dim = 0;  // dim even
  bool interleave = false;
  bool f32 = false;  // every tensor is fp32 (else bf16)
};

enum class Isa : int;

// Rotates the rows of tokens [t0, t1): 16 pairs at a time on the AVX-512 paths, one at a time elsewhere, the same
// bits either way.
void rope_rows(const Rope& r, int64_t t0, int64_t t1, Isa isa);

}  // namespace hybridd
