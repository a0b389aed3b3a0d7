// Elementwise ops (elementwise.h). Plain loops over fixed lanes that the compiler vectorizes; silu takes the
// MoE kernels' vector exp (row_ops.h), so its bits follow the instruction set as theirs do.
#include "elementwise.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moe.h"
#include "row_ops.h"
#include "simd_math.h"

namespace hybridd {
namespace {

// Elements per task of the flat ops: small steps run inline (MoeRunner::run), large ones split.
constexpr int64_t kChunk = 4096;

template <typename T>
void add_typed(const Add& a, int64_t i0, int64_t i1) {
  const T* x = static_cast<const T*>(a.a);
  const T* y = static_cast<const T*>(a.b);
  T* out = static_cast<T*>(a.out);
  for (int64_t i = i0; i < i1; ++i) out[i] = element_from_f32<T>(element_f32(x[i]) + element_f32(y[i]));
}

template <typename T>
void silu_mul_typed(const SiluMul& s, int64_t r0, int64_t r1, Isa isa) {
  float g[kRows], ones[kRows], silu[kRows];
  std::fill(ones, ones + kRows, 1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const T* gr = static_cast<const T*>(s.g) + r * s.g_stride;
    const T* ur = static_cast<const T*>(s.u) + r * s.u_stride;
    T* out = static_cast<T*>(s.out) + r * s.cols;
    for (int64_t c0 = 0; c0 < s.cols; c0 += kRows) {
      const int len = static_cast<int>(std::min<int64_t>(kRows, s.cols - c0));
      for (int c = 0; c < kRows; ++c) g[c] = c < len ? element_f32(gr[c0 + c]) : 0.0f;
      silu_mul_row(isa, g, ones, silu);
      for (int c = 0; c < len; ++c)
        out[c0 + c] = element_from_f32<T>(stored_as<T>(silu[c]) * element_f32(ur[c0 + c]));
    }
  }
}

}  // namespace

void add_range(const Add& a, int64_t i0, int64_t i1) {
  if (a.f32) add_typed<float>(a, i0, i1);
  else add_typed<uint16_t>(a, i0, i1);
}

void silu_mul_rows(const SiluMul& s, int64_t r0, int64_t r1, Isa isa) {
  if (s.f32) silu_mul_typed<float>(s, r0, r1, isa);
  else silu_mul_typed<uint16_t>(s, r0, r1, isa);
}

void widen_range(const Widen& w, int64_t i0, int64_t i1, Isa isa) {
  to_f32(isa, w.x + i0, false, static_cast<int>(i1 - i0), w.out + i0);
}

void sigmoid_range(const Sigmoid& s, int64_t i0, int64_t i1, Isa isa) {
  float x[kRows], y[kRows];
  for (int64_t c0 = i0; c0 < i1; c0 += kRows) {
    const int len = static_cast<int>(std::min<int64_t>(kRows, i1 - c0));
    for (int c = 0; c < kRows; ++c) x[c] = c < len ? s.x[c0 + c] : 0.0f;
    sigmoid_row(isa, x, y);
    std::copy(y, y + len, s.out + c0);
  }
}

void MoeRunner::add(const Add& a) {
  run_rows((a.n + kChunk - 1) / kChunk, kChunk, [&](int64_t c0, int64_t c1) {
    add_range(a, c0 * kChunk, std::min(a.n, c1 * kChunk));
  });
}

void MoeRunner::silu_mul(const SiluMul& s, Isa isa) {
  run_rows(s.rows, s.cols, [&](int64_t r0, int64_t r1) { silu_mul_rows(s, r0, r1, isa); });
}

void MoeRunner::sigmoid(const Sigmoid& s, Isa isa) {
  run_rows((s.n + kChunk - 1) / kChunk, kChunk, [&](int64_t c0, int64_t c1) {
    sigmoid_range(s, c0 * kChunk, std::min(s.n, c1 * kChunk), isa);
  });
}

void copy_rows(const CopyRows& c) {
  for (int64_t i = 0; i < c.rows; ++i)
    std::memcpy(static_cast<uint8_t*>(c.dst) + i * c.dst_stride, static_cast<const uint8_t*>(c.src) + i * c.src_stride,
                c.row_bytes);
}

void gather_rows(const GatherRows& g) {
  for (int64_t i = 0; i < g.rows; ++i)
    if (g.index[i] < 0 || g.index[i] >= g.num_rows)
      throw std::invalid_argument("row index " + std::to_string(g.index[i]) + " at " + std::to_string(i) +
                                  " is outside the table's " + std::to_string(g.num_rows) + " rows");
  for (int64_t i = 0; i < g.rows; ++i)
    std::memcpy(static_cast<uint8_t*>(g.dst) + i * g.dst_stride,
                static_cast<const uint8_t*>(g.table) + g.index[i] * g.row_stride, g.row_bytes);
}

void MoeRunner::widen(const Widen& w, Isa isa) {
  run_rows((w.n + kChunk - 1) / kChunk, kChunk, [&](int64_t c0, int64_t c1) {
    widen_range(w, c0 * kChunk, std::min(w.n, c1 * kChunk), isa);
  });
}

}  // namespace hybridd
