// Tile dot products of the int formats on CPUs with AVX-512 VNNI (the avx512_vnni, avx512_bf16 and amx paths).
#pragma once

#include "moe.h"

namespace hybridd {

// out[i * 16 + r] = row r of t . activation row rows[i], for i < n; f is kINT8 or kINT4.
void tile_dot_vnni(Format f, const Tile& t, int group, const Act& a, const int* rows, int n, float* out);

}  // namespace hybridd
