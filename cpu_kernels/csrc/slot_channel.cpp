#include "slot_channel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace hybridd {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t>* word(uint8_t* slot, CtrlWord w) {
  return reinterpret_cast<std::atomic<int64_t>*>(slot) + w;
}

// The futex is the low half of a little-endian int64 sequence word: it changes whenever the word does.
uint32_t* futex_of(std::atomic<int64_t>* w) { return reinterpret_cast<uint32_t*>(w); }

void futex_wake(std::atomic<int64_t>* w) {
  syscall(SYS_futex, futex_of(w), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Publishes a new value of *w and wakes whoever sleeps on it. The fence orders the store before the read of the
// sleeper count: a waiter that is not counted yet will find the new value when its futex call checks the word.
void publish(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, int64_t value) {
  w->store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleepers->load(std::memory_order_relaxed) > 0) futex_wake(w);
}

// Sleeps while *w still holds `seen` (low 32 bits), at most `us` microseconds, counted in *sleepers.
void futex_sleep(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, int64_t seen, int64_t us) {
  timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, futex_of(w), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
  sleepers->fetch_sub(1, std::memory_order_relaxed);
}

// Waits until pred(value of *w) holds: spin first, then futex sleeps. False when timeout_us passes first.
template <class Pred>
bool wait_word(std::atomic<int64_t>* w, std::atomic<int64_t>* sleepers, Pred pred, int spin_us, int64_t timeout_us,
               const std::atomic<bool>* stop) {
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
      // Past the first polls, let whatever else is runnable on this core go first: when both ends of a slot
      // share a core, the side spinning here would otherwise hold the core the other side needs to answer.
      if (polls > 64) sched_yield();
      else __builtin_ia32_pause();
      continue;
    }
    const int64_t left = std::chrono::duration_cast<std::chrono::microseconds>(end - now).count();
    futex_sleep(w, sleepers, v, std::min<int64_t>(left, 100000));
  }
}

}  // namespace

int64_t slot_submit(uint8_t* slot, const SlotOffsets& o, int layer, int tokens, int topk, bool f32, const void* x,
                    const void* ids, bool ids64, const float* weights) {
  if (tokens < 1 || tokens > o.max_tokens || topk < 1 || topk > o.max_topk)
    throw std::invalid_argument("call of " + std::to_string(tokens) + " tokens x top-" + std::to_string(topk) +
                                " does not fit slots of " + std::to_string(o.max_tokens) + " x top-" +
                                std::to_string(o.max_topk));
  std::memcpy(slot + o.x, x, size_t(tokens) * o.hidden * (f32 ? 4 : 2));
  if (ids64) {
    int32_t* dst = reinterpret_cast<int32_t*>(slot + o.ids);
    const int64_t* src = static_cast<const int64_t*>(ids);
    // An id outside int32 becomes INT32_MIN, which the kernel refuses like any other out-of-range id.
    for (int i = 0; i < tokens * topk; ++i)
      dst[i] = src[i] < INT32_MIN || src[i] > INT32_MAX ? INT32_MIN : static_cast<int32_t>(src[i]);
  } else {
    std::memcpy(slot + o.ids, ids, size_t(tokens) * topk * 4);
  }
  std::memcpy(slot + o.weights, weights, size_t(tokens) * topk * 4);
  word(slot, kLayer)->store(layer, std::memory_order_relaxed);
  word(slot, kTokens)->store(tokens, std::memory_order_relaxed);
  word(slot, kTopk)->store(topk, std::memory_order_relaxed);
  word(slot, kDtype)->store(f32 ? 1 : 0, std::memory_order_relaxed);
  auto* req = word(slot, kRequestSeq);
  const int64_t seq = req->load(std::memory_order_relaxed) + 1;
  publish(req, word(slot, kRequestSleepers), seq);
  return seq;
}

bool slot_wait(uint8_t* slot, const SlotOffsets& o, int64_t seq, int spin_us, int64_t timeout_us, void* out,
               int64_t out_bytes) {
  if (!wait_word(word(slot, kDoneSeq), word(slot, kDoneSleepers), [seq](int64_t v) { return v == seq; }, spin_us,
                 timeout_us, nullptr))
    return false;
  if (out) std::memcpy(out, slot + o.out, size_t(out_bytes));
  return true;
}

void SlotServer::serve() {
  auto* req = word(slot_, kRequestSeq);
  auto* done = word(slot_, kDoneSeq);
  while (!stop_.load(std::memory_order_acquire)) {
    const int64_t last = done->load(std::memory_order_relaxed);
    if (!wait_word(req, word(slot_, kRequestSleepers), [last](int64_t v) { return v != last; }, spin_us_, 1000000,
                   &stop_))
      continue;
    const auto start = Clock::now();
    try {
      call();
      word(slot_, kStatus)->store(0, std::memory_order_relaxed);
    } catch (const std::exception& e) {
      fail(e.what());
    }
    publish(done, word(slot_, kDoneSleepers), req->load(std::memory_order_relaxed));
    calls_.fetch_add(1);
    busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }
}

void SlotServer::stop() {
  stop_.store(true, std::memory_order_release);
  futex_wake(word(slot_, kRequestSeq));
}

void SlotServer::call() {
  const int layer = int(word(slot_, kLayer)->load(std::memory_order_relaxed));
  const int tokens = int(word(slot_, kTokens)->load(std::memory_order_relaxed));
  const int topk = int(word(slot_, kTopk)->load(std::memory_order_relaxed));
  const bool f32 = word(slot_, kDtype)->load(std::memory_order_relaxed) == 1;
  if (tokens < 1 || tokens > o_.max_tokens || topk < 1 || topk > o_.max_topk)
    throw std::invalid_argument("bad call header: " + std::to_string(tokens) + " tokens x top-" + std::to_string(topk));
  if (layer == kEchoLayer) {
    std::memcpy(slot_ + o_.out, slot_ + o_.x, size_t(tokens) * o_.hidden * (f32 ? 4 : 2));
    return;
  }
  const auto it = layers_.find(layer);
  if (it == layers_.end()) throw std::invalid_argument("layer " + std::to_string(layer) + " has no experts in this pack");
  runner_->forward(it->second, slot_ + o_.x, f32, tokens, topk, reinterpret_cast<const int32_t*>(slot_ + o_.ids),
                   reinterpret_cast<const float*>(slot_ + o_.weights), 1.0f, slot_ + o_.out, isa_);
}

void SlotServer::fail(const std::string& message) {
  const size_t n = std::min<size_t>(message.size(), size_t(o_.error_bytes));
  std::memcpy(slot_ + o_.error, message.data(), n);
  word(slot_, kErrorLen)->store(int64_t(n), std::memory_order_relaxed);
  word(slot_, kStatus)->store(1, std::memory_order_relaxed);
}

}  // namespace hybridd
