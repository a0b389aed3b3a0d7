// Grammar masks applied to next-token logits: a token whose bit is clear becomes -inf. The AVX-512 paths blend
// 16 logits per instruction under a 16-bit mask register taken straight from the bitmask; the others loop per
// token, skipping 32-token words that are all allowed or all forbidden (most words of a real grammar's mask).
#pragma once

#include <cstdint>

#include "moe.h"

namespace hybridd {

// For i < nrows: row rows[i] of logits (fp32, rows `stride` floats apart, `vocab` tokens) keeps token t when bit
// t % 32 of bits[i * words + t / 32] is set, and gets -inf otherwise (also for t >= 32 * words).
void mask_logits(Isa isa, float* logits, int64_t stride, int64_t vocab, const int64_t* rows, int64_t nrows,
                 const uint32_t* bits, int64_t words);

}  // namespace hybridd
