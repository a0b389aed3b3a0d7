// The per-layer data path between an engine and the expert process, on shared memory.
//
// A slot is [int64 ctrl words | error text | x | ids | weights | out] at the offsets SlotOffsets gives
// (hybrid/experts/process/slots.py lays them out). The client copies a call in, publishes REQUEST_SEQ and wakes the
// server; the server runs the call and publishes DONE_SEQ. Each side spins on the word it waits for for a
// few microseconds before sleeping on it with a futex (a shared one: the word lives in a shared mapping),
// so back-to-back calls never pay a sleep/wake-up pair; a side counts itself in the word's sleeper count
// while it sleeps, and the other side makes the wake-up system call only when that count is not zero.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "moe.h"
#include "shm_sync.h"

namespace hybridd {

enum CtrlWord : int {
  kRequestSeq = 0, kDoneSeq, kLayer, kTokens, kTopk, kDtype, kStatus, kErrorLen, kRequestSleepers, kDoneSleepers
};
constexpr int kEchoLayer = -1;

struct SlotOffsets {
  int64_t error = 0, x = 0, ids = 0, weights = 0, out = 0;
  int64_t error_bytes = 0;
  int hidden = 0, max_tokens = 0, max_topk = 0;
};

// A call the expert process could not finish: it died, was stopped, missed its timeout, or reported an error.
class ExpertCallError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One slot as the engine drives it: submit a call, then wait for its result. Both are kernels a KernelProgram can
// record: the call's sequence number lives here, not with the caller, and the wait checks the server's liveness
// itself (every poll_us), so a replayed step fails with ExpertCallError instead of hanging on a dead process.
class SlotCall {
 public:
  SlotCall(uint8_t* slot, SlotOffsets offsets, int server_pid, int64_t timeout_us, int spin_us, int64_t poll_us)
      : slot_(slot), o_(offsets), pid_(server_pid), timeout_us_(timeout_us), spin_us_(spin_us), poll_us_(poll_us) {}
  void submit(int layer, int tokens, int topk, bool f32, const void* x, const void* ids, bool ids64,
              const float* weights);
  // Copies out_bytes of the submitted call's result to out.
  void wait(void* out, int64_t out_bytes);
  // The slots are about to be unmapped: every later call raises instead of touching them (a program recorded
  // over this slot may outlive its client).
  void close() { slot_ = nullptr; }

 private:
  void check_open() const;
  void settle();  // until the call in flight is done, or ExpertCallError

  uint8_t* slot_;
  SlotOffsets o_;
  int pid_;
  int64_t timeout_us_;
  int spin_us_;
  int64_t poll_us_;
  int64_t seq_ = 0;  // of the call in flight, 0 for none
};

// Server side: serves one slot on the calling thread until stop().
class SlotServer {
 public:
  SlotServer(uint8_t* slot, SlotOffsets offsets, MoeRunner* runner, std::map<int, ExpertLayer> layers, Isa isa,
             int spin_us)
      : slot_(slot), o_(offsets), runner_(runner), layers_(std::move(layers)), isa_(isa), spin_us_(spin_us) {}
  void serve();
  void stop();
  int64_t calls() const { return calls_.load(); }
  double busy_s() const { return busy_ns_.load() * 1e-9; }

 private:
  void call();
  void fail(const std::string& message);

  uint8_t* slot_;
  SlotOffsets o_;
  MoeRunner* runner_;
  std::map<int, ExpertLayer> layers_;
  Isa isa_;
  int spin_us_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> calls_{0}, busy_ns_{0};
};

}  // namespace hybridd
