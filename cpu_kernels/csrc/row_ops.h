// Row conversions around the dot kernels: activations widened, split into bf16 pairs or quantized before them,
// results gathered, combined and rounded after them. Vectorized on the AVX-512 and avx2 paths (the rest of the
// library is compiled for baseline x86-64, where these loops cost as much as the dot products they follow);
// every path gives the same bits as the portable loops, but silu_mul_row (a vector exp: simd_math.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe.h"

namespace hybridd {

// dst[0..n) = fp32 values of src (bf16, or fp32 when f32).
void to_f32(Isa isa, const void* src, bool f32, int n, float* dst);

// hi = bf16(v) and, when lo is given, lo = bf16(v - hi): the pair that carries fp32 accuracy.
void split_bf16(Isa isa, const float* v, int n, uint16_t* hi, uint16_t* lo);

// dst = (hi (+ lo when given)) * scale, as fp32 or rounded to bf16.
void put(Isa isa, const float* hi, const float* lo, int n, float scale, bool f32, void* dst);

// Row t < rows of a tile's results y ([rows][R][16], R == 2: hi + lo summed), its first `cols` values, to
// dst + t * stride (fp32, or rounded to bf16).
void put_tile(Isa isa, const float* y, int R, int rows, int cols, bool f32, void* dst, size_t stride);

// acc[0..n) += w * y, for y held 16 values per tile, consecutive tiles `stride` floats apart; y = hi + lo
// when lo is given.
void axpy_tiles(Isa isa, float w, const float* hi, const float* lo, size_t stride, int n, float* acc);

// out[0..16) = silu(g) * u for one tile row of 16 values.
void silu_mul_row(Isa isa, const float* g, const float* u, float* out);
// out[0..16) = 1 / (1 + exp(-x)) for 16 values.
void sigmoid_row(Isa isa, const float* x, float* out);

// Symmetric per-row int8 quantization of v[0..k), zero-padded to kp: the int8 format stores q + 128 (its u8
// operand), int4 stores q and the sums of q over each group of `group` columns.
void quantize_row(Isa isa, const float* v, int k, int kp, Format f, int group, int8_t* q, float* scale,
                  int32_t* gsum);

}  // namespace hybridd
