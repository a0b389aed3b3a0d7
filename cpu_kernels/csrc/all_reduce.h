// Collectives between the ranks of one machine over one shared mapping, with lock-free flags (no locks, no
// system calls unless a rank sleeps waiting).
//
// The mapping is [world flag lines of 64 bytes: seq, sleepers, pid, pid namespace | 2 x world data buffers of
// `capacity` bytes].
// Every rank runs the same sequence of operations, numbered 1, 2, ...; operation k uses the buffers of parity
// k % 2. A rank publishes k in its flag once it has written its part of operation k (or, with nothing to write,
// on entering it), which also says it has finished reading operation k - 1. So before writing for operation k a
// rank waits until every flag reaches k - 1: nobody still reads the buffers of operation k - 2.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace hybridd {

struct ShmGroup {
  uint8_t* base = nullptr;
  int world = 0;
  int rank = 0;
  int64_t capacity = 0;
  int spin_us = 0;
  // Check, between sleeps of a wait, that the rank waited for still exists (by the pid in its flag line): a rank
  // that died fails the collective at once. Only where every rank's pid is visible from every other.
  bool watch = false;
};

// Writes this process's pid and its pid namespace (the inode of /proc/self/ns/pid) into the rank's flag line;
// shm_pid / shm_pid_namespace read a rank's (0 until it has written them). A pid is only meaningful to a rank in
// the same namespace.
void shm_publish_pid(const ShmGroup& g);
int shm_pid(const ShmGroup& g, int rank);
int64_t shm_pid_namespace(const ShmGroup& g, int rank);

// Sums `numel` elements of `data` (float32 when !bf16, else bfloat16, summed in float32 and rounded once) over
// the ranks into `data` on every rank, adding in rank order so that every rank gets the same bits. False when a
// peer does not arrive within timeout_us.
bool shm_all_reduce(const ShmGroup& g, int64_t seq, void* data, int64_t numel, bool bf16, int64_t timeout_us);

// Root: writes [int64 length | bytes] for operation `seq` and publishes it (after waiting, at most timeout_us,
// for every rank to be done with operation seq - 2's buffers).
bool shm_broadcast_send(const ShmGroup& g, int64_t seq, const void* bytes, int64_t length, int64_t timeout_us);
// Other ranks: publishes `seq` (entered), then waits at most timeout_us for the root's; the payload is then at
// shm_buffer(g, seq, root). May be called again after a timeout.
bool shm_broadcast_wait(const ShmGroup& g, int64_t seq, int root, int64_t timeout_us);
// Offset of `rank`'s buffer for operation `seq` from the mapping's base.
int64_t shm_buffer(const ShmGroup& g, int64_t seq, int rank);

// A collective a peer never reached (it died or hung): the ranks run the same operations, so it is not coming.
// Raised by every function here for a watched rank that is gone.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One rank's side of a group's operations in order: the operation counter lives here, so the all-reduce is a kernel
// a KernelProgram can record (a replay numbers its operations as an eager call would, and ranks may mix the two),
// and the broadcasts around the step take their numbers from it too.
class ShmCollectives {
 public:
  ShmCollectives(ShmGroup g, int64_t timeout_us) : g_(g), timeout_us_(timeout_us) {}
  // shm_all_reduce in pieces of at most a buffer; CollectiveError when a peer does not arrive within the timeout.
  void all_reduce(void* data, int64_t numel, bool bf16);
  // The mapping is about to go: every later all_reduce raises instead of touching it (a program recorded over
  // this group may outlive its communicator).
  void close() { g_.base = nullptr; }
  int64_t next_seq() { return ++seq_; }
  int64_t seq() const { return seq_; }

 private:
  ShmGroup g_;
  int64_t timeout_us_;
  int64_t seq_ = 0;
};

}  // namespace hybridd
