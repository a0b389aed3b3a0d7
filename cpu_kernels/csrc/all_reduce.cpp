#include "all_reduce.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "shm_sync.h"

namespace hybridd {
namespace {

constexpr int64_t kFlagLine = 64;

std::atomic<int64_t>* flag(const ShmGroup& g, int rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(g.base + rank * kFlagLine);
}
std::atomic<int64_t>* sleepers(const ShmGroup& g, int rank) { return flag(g, rank) + 1; }

std::atomic<int64_t>* pid_word(const ShmGroup& g, int rank) { return flag(g, rank) + 2; }

constexpr int64_t kWatchUs = 50000;  // how often a watched wait checks that its rank still exists

bool wait_rank(const ShmGroup& g, int rank, int64_t seq, int64_t timeout_us) {
  const auto reached = [seq](int64_t v) { return v >= seq; };
  if (!g.watch) return wait_word(flag(g, rank), sleepers(g, rank), reached, g.spin_us, timeout_us, nullptr);
  // In slices, spinning in the first only (an idle follower waits here for hours between steps).
  for (int64_t left = timeout_us, spin = g.spin_us;; left -= kWatchUs, spin = 0) {
    if (wait_word(flag(g, rank), sleepers(g, rank), reached, int(spin), std::clamp<int64_t>(left, 0, kWatchUs),
                  nullptr))
      return true;
    const int pid = shm_pid(g, rank);
    if (pid > 0 && proc_state(pid) == ProcState::kGone)
      throw CollectiveError("rank " + std::to_string(g.rank) + " of a parallel run: rank " + std::to_string(rank) +
                            " (pid " + std::to_string(pid) + ") is gone");
    if (left <= kWatchUs) return false;
  }
}

bool wait_all(const ShmGroup& g, int64_t seq, int64_t timeout_us) {
  for (int r = 0; r < g.world; ++r)
    if (!wait_rank(g, r, seq, timeout_us)) return false;
  return true;
}

float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN kept quiet).
uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

}  // namespace

void shm_publish_pid(const ShmGroup& g) {
  struct stat ns{};
  pid_word(g, g.rank)[1].store(stat("/proc/self/ns/pid", &ns) == 0 ? int64_t(ns.st_ino) : 0,
                               std::memory_order_relaxed);
  pid_word(g, g.rank)->store(getpid(), std::memory_order_release);
}

int shm_pid(const ShmGroup& g, int rank) { return int(pid_word(g, rank)->load(std::memory_order_acquire)); }

int64_t shm_pid_namespace(const ShmGroup& g, int rank) {
  return pid_word(g, rank)[1].load(std::memory_order_acquire);
}

int64_t shm_buffer(const ShmGroup& g, int64_t seq, int rank) {
  return g.world * kFlagLine + ((seq & 1) * g.world + rank) * g.capacity;
}

bool shm_all_reduce(const ShmGroup& g, int64_t seq, void* data, int64_t numel, bool bf16, int64_t timeout_us) {
  const int64_t bytes = numel * (bf16 ? 2 : 4);
  if (!wait_all(g, seq - 1, timeout_us)) return false;
  std::memcpy(g.base + shm_buffer(g, seq, g.rank), data, size_t(bytes));
  publish(flag(g, g.rank), sleepers(g, g.rank), seq);
  if (!wait_all(g, seq, timeout_us)) return false;
  if (bf16) {
    uint16_t* out = static_cast<uint16_t*>(data);
    constexpr int64_t kChunk = 1024;
    float acc[kChunk];
    for (int64_t i0 = 0; i0 < numel; i0 += kChunk) {
      const int64_t n = std::min(kChunk, numel - i0);
      std::fill(acc, acc + n, 0.0f);
      for (int r = 0; r < g.world; ++r) {
        const uint16_t* part = reinterpret_cast<const uint16_t*>(g.base + shm_buffer(g, seq, r)) + i0;
        for (int64_t i = 0; i < n; ++i) acc[i] += bf16_to_f32(part[i]);
      }
      for (int64_t i = 0; i < n; ++i) out[i0 + i] = f32_to_bf16(acc[i]);
    }
    return true;
  }
  float* out = static_cast<float*>(data);
  const float* first = reinterpret_cast<const float*>(g.base + shm_buffer(g, seq, 0));
  std::memcpy(out, first, size_t(bytes));
  for (int r = 1; r < g.world; ++r) {
    const float* part = reinterpret_cast<const float*>(g.base + shm_buffer(g, seq, r));
    for (int64_t i = 0; i < numel; ++i) out[i] += part[i];
  }
  return true;
}

bool shm_broadcast_send(const ShmGroup& g, int64_t seq, const void* bytes, int64_t length, int64_t timeout_us) {
  if (!wait_all(g, seq - 1, timeout_us)) return false;
  uint8_t* buf = g.base + shm_buffer(g, seq, g.rank);
  std::memcpy(buf, &length, 8);
  std::memcpy(buf + 8, bytes, size_t(length));
  publish(flag(g, g.rank), sleepers(g, g.rank), seq);
  return true;
}

bool shm_broadcast_wait(const ShmGroup& g, int64_t seq, int root, int64_t timeout_us) {
  publish(flag(g, g.rank), sleepers(g, g.rank), seq);
  return wait_rank(g, root, seq, timeout_us);
}

void ShmCollectives::all_reduce(void* data, int64_t numel, bool bf16) {
  if (g_.base == nullptr) throw CollectiveError("this rank's communicator is closed (its mapping is gone)");
  const int64_t size = bf16 ? 2 : 4, step = g_.capacity / size;
  for (int64_t start = 0; start < numel; start += step) {
    const int64_t seq = next_seq();
    if (!shm_all_reduce(g_, seq, static_cast<uint8_t*>(data) + start * size, std::min(step, numel - start), bf16,
                        timeout_us_))
      throw CollectiveError("tensor-parallel rank " + std::to_string(g_.rank) + ": a peer did not reach all-reduce " +
                            std::to_string(seq) + " within " + std::to_string(timeout_us_ / 1000000) + " s");
  }
}

}  // namespace hybridd
