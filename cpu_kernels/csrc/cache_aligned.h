// Vectors whose storage starts on a 64-byte boundary: the AMX kernels load and store 16 rows of 64 bytes in
// place, and each row must be one cache line, not two.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace hybridd {

template <typename T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const CacheAligned&) const { return true; }
  bool operator!=(const CacheAligned&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, CacheAligned<T>>;

}  // namespace hybridd
