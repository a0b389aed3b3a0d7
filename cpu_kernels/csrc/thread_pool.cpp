#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <immintrin.h>

namespace hybridd {

namespace {
void pin_current_thread(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}
}  // namespace

ThreadPool::ThreadPool(std::vector<int> cpus, std::vector<int> nodes, int spin_us)
    : cpus_(std::move(cpus)), nodes_(std::move(nodes)), spin_us_(spin_us) {
  if (cpus_.empty()) cpus_.push_back(-1);
  nodes_.resize(cpus_.size(), 0);
  for (int n : nodes_) {
    if (n < 0) throw std::invalid_argument("NUMA node indices must be >= 0");
    num_nodes_ = std::max(num_nodes_, n + 1);
  }
  shares_ = std::make_unique<Share[]>(num_nodes_);
  for (int t = 1; t < size(); ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  generation_.notify_all();
  for (auto& th : threads_) th.join();
}

void ThreadPool::drain(int tid) {
  for (int k = 0; k < num_nodes_; ++k) {
    Share& share = shares_[(nodes_[tid] + k) % num_nodes_];
    for (int task = share.next.fetch_add(1); task < share.end; task = share.next.fetch_add(1)) (*fn_)(task, tid);
  }
}

void ThreadPool::worker(int tid) {
  pin_current_thread(cpus_[tid]);
  uint32_t seen = 0;  // the generation at construction: a run or stop may come before this thread starts
  for (;;) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      _mm_pause();
      // Past the first polls, offer the core to any runnable thread (torch, another hybridd process).
      if (++polls > 256) sched_yield();
      if (polls % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
        sleepers_.fetch_add(1);
        generation_.wait(seen);
        sleepers_.fetch_sub(1);
      }
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    drain(tid);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::run(int ntasks, const std::function<void(int, int)>& fn) {
  if (ntasks <= 0) return;
  // The caller is thread 0: keep it on its own core, or a wake-up can land it on a worker's core and
  // leave another core idle (seen with two processes handing calls back and forth). Pinned once per
  // thread: re-pinning around every call costs a migration per call.
  thread_local int pinned_to = -2;
  if (pinned_to != cpus_[0]) {
    pin_current_thread(cpus_[0]);
    pinned_to = cpus_[0];
  }
  if (size() == 1 || ntasks == 1) {
    for (int t = 0; t < ntasks; ++t) fn(t, 0);
    return;
  }
  fn_ = &fn;
  for (int n = 0; n < num_nodes_; ++n) {
    shares_[n].next.store(int(int64_t(ntasks) * n / num_nodes_));
    shares_[n].end = int(int64_t(ntasks) * (n + 1) / num_nodes_);
  }
  done_.store(0);
  generation_.fetch_add(1, std::memory_order_release);
  if (sleepers_.load() > 0) generation_.notify_all();
  drain(0);
  const int workers = size() - 1;
  while (done_.load(std::memory_order_acquire) < workers) _mm_pause();
}

}  // namespace hybridd
