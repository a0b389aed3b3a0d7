// Waiting on and publishing int64 words in shared memory between processes: spin first, then sleep on the word
// with a futex (a shared one: the word lives in a shared mapping). A waiter counts itself in a sleeper word while it
// sleeps, and a publisher makes the wake-up system call only when that count is not zero.
#pragma once

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <iterator>
#include <string>

namespace hybridd {

enum class ProcState { kRunning, kStopped, kGone };

// The state letter /proc/<pid>/stat gives after the command name (which may itself hold spaces and parentheses):
// a zombie counts as gone, as a process that no longer exists does. What a waiter checks between sleeps, so that a
// peer process that died fails the wait at once instead of at its timeout.
inline ProcState proc_state(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // npos too when the file could not be read: no such process
  if (close == std::string::npos || close + 2 >= stat.size()) return ProcState::kGone;
  switch (stat[close + 2]) {
    case 'Z': case 'X': case 'x': return ProcState::kGone;
    case 'T': case 't': return ProcState::kStopped;
    default: return ProcState::kRunning;
  }
}

// The futex is the low half of a little-endian int64 sequence word: it changes whenever the word does.
inline uint32_t* futex_of(std::atomic<int64_t>* w) { return reinterpret_cast<uint32_t*>(w); }

inline void futex_wake(std::atomic<int64_t>* w) {
  syscall(SYS_futex, futex_of(w), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Publishes a new value of *w and wakes whoever sleeps on it. The fence orders the store before the read of the
// sleeper count: a waiter that is not counted yet will find the new value when its futex call checks the word.
inline void publish(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, int64_t value) {
  w->store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleepers->load(std::memory_order_relaxed) > 0) futex_wake(w);
}

// Sleeps while *w still holds `seen` (low 32 bits), at most `us` microseconds, counted in *sleepers.
inline void futex_sleep(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, int64_t seen, int64_t us) {
  timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, futex_of(w), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
  sleepers->fetch_sub(1, std::memory_order_relaxed);
}

// Waits until pred(value of *w) holds: spin first, then futex sleeps. False when timeout_us passes first.
template <class Pred>
inline bool wait_word(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, Pred pred, int spin_us,
                      int64_t timeout_us, const std::atomic<bool>* stop) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto spin_end = start + std::chrono::microseconds(spin_us);
  const auto end = start + std::chrono::microseconds(timeout_us);
  for (int polls = 0;; ++polls) {
    const int64_t v = w->load(std::memory_order_acquire);
    if (pred(v)) return true;
    if (stop && stop->load(std::memory_order_acquire)) return false;
    const auto now = Clock::now();
    if (now >= end) return false;
    if (now < spin_end) {
      // Past the first polls, let whatever else is runnable on this core go first: when both sides share a
      // core, the side spinning here would otherwise hold the core the other side needs to answer.
      if (polls > 64) sched_yield();
      else __builtin_ia32_pause();
      continue;
    }
    const int64_t left = std::chrono::duration_cast<std::chrono::microseconds>(end - now).count();
    futex_sleep(w, sleepers, v, std::min<int64_t>(left, 100000));
  }
}

}  // namespace hybridd
