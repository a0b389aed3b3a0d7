// Tile dot products of the avx2 path: CPUs with AVX2 and FMA but no AVX-512 (Haswell to Alder Lake, Zen 1-3,
// so EPYC Rome and Milan).
#pragma once

#include "moe.h"
#include "wide_rows.h"

namespace hybridd {

// How many of n activation rows of format f to widen at a time: their widened copies stay in L2 while every
// tile of a range meets them (all n where the format widens nothing).
int avx2_row_block(Format f, int64_t kp, int n);

// Rows rows[0..n) of a in the form tile_dot_avx2 reads them (fp8, bf16: fp32; int8: int16; int4: none).
void widen_rows_avx2(Format f, const Act& a, const int* rows, int n, WideRows& wide);

// out[i * 16 + r] = row r of t . activation row rows[i], for i < n, every format; wide holds those rows from
// widen_rows_avx2.
void tile_dot_avx2(Format f, const Tile& t, int block_k, int group, const Act& a, const int* rows, int n,
                   const WideRows& wide, float* out);

}  // namespace hybridd
