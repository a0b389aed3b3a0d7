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

// out[j][i * 16 + r] = row r of tiles[j] . activation row rows[i], for nt (1, 2 or 4) tiles with the same kp;
// what the AVX-512 path computes, with AMX's summation order. rows are consecutive (rows[i] = rows[0] + i);
// `scratch` holds nt * kp * 16 bf16.
void tile_dotn_amx(Format f, const Tile* tiles, int nt, int block_k, int group, const Act& a, const int* rows, int n,
                   float* const* out, uint16_t* scratch);

// How many tile_dotn_amx calls this process made (tests check that the AMX path really ran).
int64_t amx_calls();

}  // namespace hybridd
