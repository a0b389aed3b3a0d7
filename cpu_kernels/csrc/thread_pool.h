// A persistent pool of worker threads pinned to cores. run() hands out task indices dynamically; the
// calling thread works too. Idle workers spin briefly (phases of one MoE call follow each other within
// microseconds), yielding to other runnable threads, then sleep on a futex so they do not steal cores
// from torch or other processes between calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace hybridd {

class ThreadPool {
 public:
  // cpus[i] is the core of thread i (-1: not pinned); thread 0 is whichever thread calls run(), pinned to
  // cpus[0] from its first call on (processes it starts inherit that: see cpu_kernels.thread_pool).
  explicit ThreadPool(std::vector<int> cpus, int spin_us = 50);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(cpus_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }
  // Runs fn(task, thread) for task in [0, ntasks); returns when all are done.
  void run(int ntasks, const std::function<void(int, int)>& fn);

 private:
  void worker(int tid);
  void drain(int tid);

  std::vector<int> cpus_;
  int spin_us_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int ntasks_ = 0;
  alignas(64) std::atomic<int> next_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace hybridd
