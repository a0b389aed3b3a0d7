// AMX tile kernels (Sapphire Rapids, Emerald Rapids, Granite Rapids): many tokens of one expert against
// its packed weight tiles, for prefill and batched decode. Few-token blocks stay on the AVX-512 kernels,
// which already stream weights at the memory-bandwidth limit. (An fp8 kernel for 1-3 rows on the tile unit,
// A and C tiles of that many rows, each k step converted one step ahead of its products, ran 1.5x the AVX-512
// loop's rate from L1 on Emerald Rapids, but 0.90-0.97x of it over expert weights streamed from memory.)
#pragma once

#include "moe.h"

namespace hybridd {

// The CPU has AMX-TILE/BF16/INT8 and Linux granted this process the tile state (asked once, process-wide).
bool amx_usable();

// Whether tile_dotn_amx computes this format with these fp8 block / int4 group sizes and padded K.
bool amx_handles(Format f, int block_k, int group, int kp);

// out[j][i * 16 + r] = row r of tiles[j] . activation row rows[i], for nt (1, 2 or 4) tiles with the same kp
// (the formats and activations tile_span_amx does not take); what the AVX-512 path computes, with AMX's summation order. rows are consecutive (rows[i] = rows[0] + i);
// `scratch` holds nt * kp * 16 bf16.
void tile_dotn_amx(Format f, const Tile* tiles, int nt, int block_k, int group, const Act& a, const int* rows, int n,
                   float* const* out, uint16_t* scratch);

// Whether tile_span_amx computes this format for bf16 activation rows (hi + lo pairs of fp32 ones when
// exact): bf16 tiles, and fp8 tiles against plain bf16 rows (fp32 ones need one scaled partial sum per fp8
// block: tile_dotn_amx).
bool amx_spans(Format f, bool exact, int block_k, int kp);

// out[j][i * 16 + r] = row r of tiles[j] . activation row rows[i] for any number of tiles with the same kp,
// column step by column step so that the activation rows are read once per step for all tiles. Every out[j]
// holds n rounded up to a multiple of 16 rows (the rows past n are written too); rows are consecutive, and
// a.amx_packed: the n rows are 16-row blocks of A operands from row rows[0] of a.bf (pack_amx_block).
void tile_span_amx(Format f, const Tile* tiles, int nt, int block_k, const Act& a, const int* rows, int n,
                   float* const* out);

// Where column c of row r sits (in bf16 from the first row) in rows packed as tile_span_amx's A operands:
// per 16-row block, per 32 columns, the block's 16 rows of those columns (kp % 32 == 0). Columns c .. c + 15
// of a row are consecutive for c % 16 == 0.
inline int64_t amx_operand_index(int kp, int r, int c) {
  return (int64_t(r / kRows) * (kp / 32) + c / 32) * (kRows * 32) + (r % kRows) * 32 + c % 32;
}

// Rows src[0 .. n) (n <= 16, kp bf16 each) as one block of A operands at dst (16 * kp bf16), rows past n zero.
// One contiguous kilobyte per operand: rows read in place sit a row stride apart, which for 4 KB strides
// (kp = 2048) maps all 16 onto one cache set.
void pack_amx_block(const uint16_t* const* src, int n, int kp, uint16_t* dst);

// How many tile_dotn_amx and tile_span_amx calls this process made (tests check that the AMX path really ran).
int64_t amx_calls();

}  // namespace hybridd
