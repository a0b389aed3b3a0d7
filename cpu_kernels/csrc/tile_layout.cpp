// Row-major matrix -> tile lines (see tile_layout.h). A tile's 16 rows are first copied zero-padded into a
// block buffer, so the shuffle below never special-cases an edge.
#include "tile_layout.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "moe.h"

namespace hybridd {

namespace {

void shuffle_dwords(const uint8_t* block, int64_t padded_bytes, uint8_t* dst) {
  for (int64_t q = 0; q < padded_bytes / 4; ++q) {
    uint32_t line[kRows];
    for (int r = 0; r < kRows; ++r) std::memcpy(&line[r], block + r * padded_bytes + 4 * q, 4);
    std::memcpy(dst + q * 64, line, 64);
  }
}

void shuffle_fp8_pairs(const uint8_t* block, int64_t padded_bytes, uint8_t* dst) {
  for (int64_t c = 0; c < padded_bytes / 4; ++c) {
    uint16_t line[32];
    for (int lane = 0; lane < 4; ++lane)
      for (int h = 0; h < 2; ++h)
        for (int ri = 0; ri < 4; ++ri)
          std::memcpy(&line[8 * lane + 4 * h + ri], block + (4 * lane + ri) * padded_bytes + 4 * c + 2 * h, 2);
    std::memcpy(dst + c * 64, line, 64);
  }
}

}  // namespace

void pack_tile_lines(TileLayout layout, const uint8_t* src, int64_t src_stride, int64_t n, int64_t row_bytes,
                     int64_t padded_bytes, uint8_t* dst) {
  if (n < 0 || row_bytes < 0 || padded_bytes < row_bytes || padded_bytes % 4)
    throw std::invalid_argument("pack_tile_lines: bad sizes");
  std::vector<uint8_t> block(size_t(kRows) * padded_bytes);
  const int64_t tiles = (n + kRows - 1) / kRows;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int r = 0; r < kRows; ++r) {
      uint8_t* row = block.data() + r * padded_bytes;
      const int64_t i = t * kRows + r;
      const int64_t copied = i < n ? row_bytes : 0;
      if (copied) std::memcpy(row, src + i * src_stride, copied);
      std::memset(row + copied, 0, padded_bytes - copied);
    }
    uint8_t* out = dst + t * kRows * padded_bytes;
    if (layout == TileLayout::kDwords) shuffle_dwords(block.data(), padded_bytes, out);
    else shuffle_fp8_pairs(block.data(), padded_bytes, out);
  }
}

void fp8_pair_flags(const uint8_t* lines, int64_t tiles, int64_t kp, uint8_t* flags) {
  if (tiles < 0 || kp < 0 || kp % 8) throw std::invalid_argument("fp8_pair_flags: bad sizes");
  const int64_t pairs = kp / 8, bytes = fp8_flag_bytes(kp);
  std::memset(flags, 0, size_t(tiles * bytes));
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* q = lines + (t * pairs + p) * 128;
      bool any = false;
      for (int i = 0; i < 128; ++i) any |= fp8_code_needs_tables(q[i]);
      if (any) flags[t * bytes + p / 8] |= uint8_t(1 << (p % 8));
    }
}

}  // namespace hybridd
