// The split of a tile dot product's activation rows into blocks the kernels are instantiated for.
#pragma once

#include <algorithm>
#include <type_traits>

namespace hybridd {

constexpr int kTokenBlock = 8;

// body(std::integral_constant<int, TB>(), b) for each block of TB <= kTokenBlock rows from row b, b < n.
template <typename Body>
inline void for_token_blocks(int n, Body&& body) {
  for (int b = 0; b < n; b += kTokenBlock) {
    switch (std::min(kTokenBlock, n - b)) {
      case 8: body(std::integral_constant<int, 8>(), b); break;
      case 7: body(std::integral_constant<int, 7>(), b); break;
      case 6: body(std::integral_constant<int, 6>(), b); break;
      case 5: body(std::integral_constant<int, 5>(), b); break;
      case 4: body(std::integral_constant<int, 4>(), b); break;
      case 3: body(std::integral_constant<int, 3>(), b); break;
      case 2: body(std::integral_constant<int, 2>(), b); break;
      default: body(std::integral_constant<int, 1>(), b); break;
    }
  }
}

}  // namespace hybridd
