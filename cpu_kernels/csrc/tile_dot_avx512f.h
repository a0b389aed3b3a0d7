// Tile dot products of the avx512 path: CPUs with AVX-512 F/BW/VL/DQ but without VNNI (Skylake-SP), and the
// bf16 / fp8 ones of the avx512_vnni path (VNNI without BF16: Cascade Lake, Ice Lake), whose int formats run
// tile_dot_vnni.
#pragma once

#include "moe.h"
#include "wide_rows.h"

namespace hybridd {

// How many of n activation rows of format f to widen at a time: their widened copies stay in L2 (1 MB on
// Skylake-SP and Cascade Lake, 1.25 MB on Ice Lake) next to the tile every token block goes over again.
int avx512f_row_block(Format f, int64_t kp, int n);

// Rows rows[0..n) of a in the form tile_dot_avx512f reads them (fp8, bf16: fp32; int8: int16; int4: none).
void widen_rows_avx512f(Format f, const Act& a, const int* rows, int n, WideRows& wide);

// out[i * 16 + r] = row r of t . activation row rows[i], for i < n, every format; wide holds those rows from
// widen_rows_avx512f.
void tile_dot_avx512f(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                      const WideRows& wide, float* out);

// tile_dot_avx512f for two tiles of the same column count, into out[0] and out[1] with the same bits: bf16 tiles
// share each activation broadcast.
void tile_dot2_avx512f(Format f, const Tile* t, int block_k, int group, const Act& a, const int* rows, int n,
                       const WideRows& wide, float* const* out);

}  // namespace hybridd
