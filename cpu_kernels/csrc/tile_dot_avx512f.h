// Tile dot products of the avx512 path: CPUs with AVX-512 F/BW/VL/DQ but without VNNI (Skylake-SP), and the
// bf16 / fp8 ones of the avx512_vnni path (VNNI without BF16: Cascade Lake, Ice Lake), whose int formats run
// tile_dot_vnni.
#pragma once

#include "moe.h"

namespace hybridd {

// out[i * 16 + r] = row r of t . activation row rows[i], for i < n, every format.
void tile_dot_avx512f(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                      float* out);

}  // namespace hybridd
