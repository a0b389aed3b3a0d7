// One pass over a step's logits before sampling: each row's greedy token and whether any token can be drawn from
// it at all, the checks torch's isnan / isposinf / isneginf / argmax made in five passes.
#pragma once

#include <cstdint>

namespace hybridd {

enum class Isa : int;

// For each of `rows` rows of `vocab` logits (fp32, or bf16 when bf16), `stride` values apart: broken[r] = 1 when
// the row holds a NaN or +inf or nothing above -inf (no token can be drawn), else 0 and greedy[r] = the first index
// of the row's largest value (torch.argmax's choice); greedy[r] = -1 for a broken row.
void logits_scan(Isa isa, const void* logits, bool bf16, int64_t rows, int64_t vocab, int64_t stride,
                 int64_t* greedy, uint8_t* broken);

}  // namespace hybridd
