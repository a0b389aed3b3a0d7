// One pass over a step's logits before sampling: each row's greedy token, whether any token can be drawn from it at
// all (the checks torch's isnan / isposinf / isneginf / argmax made in five passes), and for the rows under a
// grammar the grammar's mask applied in place, in the same read.
#pragma once

#include <cstdint>

namespace hybridd {

enum class Isa : int;

// What a row's scan found.
enum ScanStatus : uint8_t {
  kScanOk = 0,         // greedy[r] is the first index of the row's largest (allowed) value, torch.argmax's choice
  kScanBroken = 1,     // the row as given holds a NaN or +inf, or nothing above -inf: no token can be drawn
  kScanMaskedOut = 2,  // the row is numbers, but its mask leaves nothing above -inf
};

// For each of `rows` rows of `vocab` logits (fp32, or bf16 when bf16), `stride` values apart: status[r] and
// greedy[r] (-1 unless kScanOk). mask_of_row null: no row is masked. Otherwise row r with mask_of_row[r] = i >= 0
// first keeps token t when bit t % 32 of bits[i * words + t / 32] is set and gets -inf in place
// otherwise (also for t >= 32 * words); its status is kScanBroken by the values before the mask.
void logits_scan(Isa isa, void* logits, bool bf16, int64_t rows, int64_t vocab, int64_t stride,
                 const int64_t* mask_of_row, const uint32_t* bits, int64_t words, int64_t* greedy, uint8_t* status);

}  // namespace hybridd
