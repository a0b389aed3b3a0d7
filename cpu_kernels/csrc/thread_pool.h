// A persistent pool of worker threads pinned to cores, one sub-pool per NUMA node. run() splits the task
// range into one contiguous share per node; a thread takes tasks of its own node's share first, then helps
// the other nodes. The calling thread works too, and returns once every task is done, without waiting for
// workers that never woke up. Idle workers spin for spin_us (yielding to other runnable threads), then sleep
// on a futex so they do not steal cores from other processes between calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

namespace hybridd {

class ThreadPool {
 public:
  // cpus[i] is the core of thread i (-1: not pinned), nodes[i] its NUMA node (0, 1, ...; empty: all node 0);
  // thread 0 is whichever thread calls run(), pinned to cpus[0] from its first call on (threads and processes
  // it starts inherit that: see cpu_kernels.thread_pool). spin_us: the idle workers' polling time (its default
  // is cpu_kernels.thread_pool.POOL_SPIN_US).
  ThreadPool(std::vector<int> cpus, std::vector<int> nodes, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(cpus_.size()); }
  int num_nodes() const { return num_nodes_; }
  const std::vector<int>& cpus() const { return cpus_; }
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  // Takes effect from each worker's next idle period.
  void set_spin_us(int us) { spin_us_.store(us, std::memory_order_relaxed); }
  // Runs fn(task, thread) for task in [0, ntasks); node n's share is [n * ntasks / N, (n + 1) * ntasks / N).
  // Returns when all are done.
  void run(int ntasks, const std::function<void(int, int)>& fn);

 private:
  void worker(int tid);
  void drain(int tid);

  struct alignas(64) Share {
    std::atomic<int> next{0};
    int end = 0;
  };

  std::vector<int> cpus_, nodes_;
  int num_nodes_ = 1;
  std::unique_ptr<Share[]> shares_;
  std::atomic<int> spin_us_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* fn_ = nullptr;
  alignas(64) std::atomic<int> completed_{0};  // tasks of the current run done
  alignas(64) std::atomic<int> busy_{0};       // workers inside drain()
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace hybridd
