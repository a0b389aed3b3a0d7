#include "slot_channel.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hybridd {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int64_t>* word(uint8_t* slot, CtrlWord w) {
  return reinterpret_cast<std::atomic<int64_t>*>(slot) + w;
}

std::string seconds(int64_t us) {
  std::ostringstream s;
  s.precision(1);
  s << std::fixed << us * 1e-6 << "s";
  return s.str();
}

// Client side. Copies one call into the slot at `slot` and rings; returns the call's sequence number. ids are
// int64 (as torch's top-k gives them) when ids64, else int32.
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

// Waits until DONE_SEQ reaches seq: spins spin_us, then sleeps, for at most timeout_us in all. True when done.
bool slot_wait(uint8_t* slot, int64_t seq, int spin_us, int64_t timeout_us) {
  return wait_word(word(slot, kDoneSeq), word(slot, kDoneSleepers), [seq](int64_t v) { return v == seq; }, spin_us,
                   timeout_us, nullptr);
}

}  // namespace

void SlotCall::submit(int layer, int tokens, int topk, bool f32, const void* x, const void* ids, bool ids64,
                      const float* weights) {
  check_open();
  // A call nobody waited for (its step failed after submitting it, or its wait gave up on a stopped or slow
  // process) must finish before the slot is rewritten, or the server would read a half-written call.
  if (seq_ != 0) settle();
  seq_ = slot_submit(slot_, o_, layer, tokens, topk, f32, x, ids, ids64, weights);
}

void SlotCall::check_open() const {
  if (slot_ == nullptr) throw ExpertCallError("this expert client is closed (its slots are unmapped)");
}

void SlotCall::settle() {
  const auto deadline = Clock::now() + std::chrono::microseconds(timeout_us_);
  const std::string who = "the expert process (pid " + std::to_string(pid_) + ")";
  while (!slot_wait(slot_, seq_, spin_us_, poll_us_)) {
    const ProcState state = proc_state(pid_);
    const char* failure = state == ProcState::kGone      ? " died during a layer call"
                          : state == ProcState::kStopped ? " is stopped (SIGSTOP?) and cannot finish a layer call"
                          : Clock::now() > deadline      ? " did not finish a layer call within "
                                                         : nullptr;
    if (failure) {
      if (state == ProcState::kGone) seq_ = 0;  // else the call may still finish: the next submit waits for it
      throw ExpertCallError(who + failure + (state == ProcState::kRunning ? seconds(timeout_us_) : ""));
    }
  }
  seq_ = 0;
}

void SlotCall::wait(void* out, int64_t out_bytes) {
  check_open();
  if (seq_ == 0) throw std::logic_error("this expert slot has no call in flight");
  settle();
  if (word(slot_, kStatus)->load(std::memory_order_relaxed) != 0) {
    const int64_t n = std::min(word(slot_, kErrorLen)->load(std::memory_order_relaxed), o_.error_bytes);
    throw ExpertCallError("expert process: " + std::string(reinterpret_cast<const char*>(slot_ + o_.error),
                                                            size_t(std::max<int64_t>(n, 0))));
  }
  std::memcpy(out, slot_ + o_.out, size_t(out_bytes));
}

void SlotServer::serve() {
  auto* req = word(slot_, kRequestSeq);
  auto* done = word(slot_, kDoneSeq);
  while (!stop_.load(std::memory_order_acquire)) {
    const int64_t last = done->load(std::memory_order_relaxed);
    if (!wait_word(req, word(slot_, kRequestSleepers), [last](int64_t v) { return v != last; }, spin_us_, 1000000,
                   &stop_))
      continue;
    const int64_t seq = req->load(std::memory_order_acquire);  // the call served, whatever arrives meanwhile
    const auto start = Clock::now();
    try {
      call();
      word(slot_, kStatus)->store(0, std::memory_order_relaxed);
    } catch (const std::exception& e) {
      fail(e.what());
    }
    publish(done, word(slot_, kDoneSleepers), seq);
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
