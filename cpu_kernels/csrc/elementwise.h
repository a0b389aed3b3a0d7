// Elementwise ops of a decode step that sit between the weight-streaming kernels: the residual add, the dense
// MLP's silu(gate) * up, the widening of bf16 routing weights, DeepSeek's router sigmoid and strided row copies.
// Each rounds as torch's ops do, so a step of kernels computes what the torch ops it replaces compute.
#pragma once

#include <cstdint>

namespace hybridd {

enum class Isa : int;

// out = a + b over n elements, the fp32 sum rounded to the dtype (torch's bf16 add).
struct Add {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  int64_t n = 0;
  bool f32 = false;  // every tensor is fp32 (else bf16)
};

// out[r] = dtype(dtype(silu(g[r])) * u[r]) for rows r of `cols` values (torch: F.silu(g) * u); g and u rows may
// be strided (columns of one matrix), out is contiguous.
struct SiluMul {
  const void* g = nullptr;
  const void* u = nullptr;
  int64_t g_stride = 0, u_stride = 0;  // elements between rows
  void* out = nullptr;
  int64_t rows = 0, cols = 0;
  bool f32 = false;
};

// out = 1 / (1 + exp(-x)) for n fp32 values (DeepSeek's router scores); the exp is the kernels' vector exp.
struct Sigmoid {
  const float* x = nullptr;
  float* out = nullptr;
  int64_t n = 0;
};

// Row i of `rows` rows of row_bytes bytes from src + i * src_stride to dst + i * dst_stride (strides in bytes).
struct CopyRows {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t src_stride = 0, dst_stride = 0, rows = 0, row_bytes = 0;
};

// Row i of `rows` rows of row_bytes bytes from table row index[i] (of num_rows, row_stride bytes apart) to
// dst + i * dst_stride: an embedding lookup, or a decode step's rotary rows from a table of positions.
struct GatherRows {
  const void* table = nullptr;
  int64_t num_rows = 0, row_stride = 0;
  const int64_t* index = nullptr;
  void* dst = nullptr;
  int64_t dst_stride = 0, rows = 0, row_bytes = 0;
};

// out = fp32(x) for n bf16 values (exact).
struct Widen {
  const uint16_t* x = nullptr;
  float* out = nullptr;
  int64_t n = 0;
};

void add_range(const Add& a, int64_t i0, int64_t i1);
void silu_mul_rows(const SiluMul& s, int64_t r0, int64_t r1, Isa isa);
// The kernels' row conversion (row_ops.h to_f32) over chunks of at most kChunk values.
void widen_range(const Widen& w, int64_t i0, int64_t i1, Isa isa);
void sigmoid_range(const Sigmoid& s, int64_t i0, int64_t i1, Isa isa);
// On the calling thread: a few rows per decode step.
void copy_rows(const CopyRows& c);
// Throws std::invalid_argument, before writing anything, for an index outside [0, num_rows).
void gather_rows(const GatherRows& g);

}  // namespace hybridd
