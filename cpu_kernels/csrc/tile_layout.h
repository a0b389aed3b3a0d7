// Packing a row-major matrix into the kernels' tile lines (layouts in moe.h): the byte shuffle that
// cpu_kernels/pack.py's torch permutations define, done in one pass for checkpoints of hundreds of GB.
#pragma once

#include <cstdint>

namespace hybridd {

// kDwords: line q of a tile = 4 bytes (bytes 4q..4q+3 of the row) of each of its 16 rows: bf16 (one k pair)
// and int8 (four k). kFp8Pairs: line c = k 4c..4c+3 of 16 rows, the two-byte k pair h of row 4 * lane + ri
// at byte 16 * lane + 8 * h + 2 * ri.
enum class TileLayout : int { kDwords = 0, kFp8Pairs = 1 };

// src: n rows of `row_bytes` bytes, `src_stride` bytes apart. dst: ceil(n / 16) tiles of `padded_bytes` per
// row (rows past n and bytes past row_bytes are zeros); padded_bytes is a multiple of 4 (kFp8Pairs: of 64
// per 16 rows, i.e. 4 bytes).
void pack_tile_lines(TileLayout layout, const uint8_t* src, int64_t src_stride, int64_t n, int64_t row_bytes,
                     int64_t padded_bytes, uint8_t* dst);

// The line pair flags (moe.h) of `tiles` fp8 tiles of kp columns (a multiple of 8): flags [tiles][ceil(kp/64)].
void fp8_pair_flags(const uint8_t* lines, int64_t tiles, int64_t kp, uint8_t* flags);

}  // namespace hybridd
