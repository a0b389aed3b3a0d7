// Tile dot products of the avx2 path: CPUs with AVX2 and FMA but no AVX-512 (Haswell to Alder Lake, Zen 1-3,
// so EPYC Rome and Milan).
#pragma once

#include "moe.h"

namespace hybridd {

// out[i * 16 + r] = row r of t . activation row rows[i], for i < n, every format.
void tile_dot_avx2(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                   float* out);

}  // namespace hybridd
