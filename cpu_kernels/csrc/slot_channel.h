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

// Client side. Copies one call into the slot at `slot` and rings; returns the call's sequence number. ids are
// int64 (as torch's top-k gives them) when ids64, else int32.
int64_t slot_submit(uint8_t* slot, const SlotOffsets& o, int layer, int tokens, int topk, bool f32, const void* x,
                    const void* ids, bool ids64, const float* weights);
// Waits until DONE_SEQ reaches seq: spins spin_us, then sleeps, for at most timeout_us in all. True when done,
// after copying out_bytes of the result to `out` when given.
bool slot_wait(uint8_t* slot, const SlotOffsets& o, int64_t seq, int spin_us, int64_t timeout_us, void* out,
               int64_t out_bytes);

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
