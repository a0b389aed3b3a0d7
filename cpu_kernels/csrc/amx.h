// AMX tile kernels (Sapphire Rapids, Emerald Rapids, Granite Rapids): many tokens of one expert against
// its packed weight tiles, for prefill and batched decode. Few-token blocks stay on the AVX-512 kernels,
// which already stream weights at the memory-bandwidth limit.
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

// Whether tile_span_amx computes this format for these activations: bf16 tiles, and fp8 tiles against bf16
// activations (fp32 ones, as hi + lo rows, need one scaled partial sum per fp8 block: tile_dotn_amx).
bool amx_spans(Format f, const Act& a, int block_k, int kp);

// out[j][i * 16 + r] = row r of tiles[j] . activation row rows[i] for any number of tiles with the same kp,
// column step by column step so that the activation rows are read once per step for all tiles. Every out[j]
// holds n rounded up to a multiple of 16 rows (the rows past n are written too); rows are consecutive.
void tile_span_amx(Format f, const Tile* tiles, int nt, int block_k, const Act& a, const int* rows, int n,
                   float* const* out);

// How many tile_dotn_amx and tile_span_amx calls this process made (tests check that the AMX path really ran).
int64_t amx_calls();

}  // namespace hybridd
