#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <immintrin.h>

namespace hybridd {

namespace {
void pin_thread(pthread_t thread, int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(thread, sizeof(set), &set);
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
  // Pinned by the constructor, not by the worker itself: once it returns, every thread of the pool has its core.
  for (int t = 1; t < size(); ++t) {
    threads_.emplace_back([this, t] { worker(t); });
    pin_thread(threads_.back().native_handle(), cpus_[t]);
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(2);
  generation_.notify_all();
  for (auto& th : threads_) th.join();
}

void ThreadPool::drain(int tid) {
  int done = 0;
  for (int k = 0; k < num_nodes_; ++k) {
    Share& share = shares_[(nodes_[tid] + k) % num_nodes_];
    for (int task = share.next.fetch_add(1); task < share.end; task = share.next.fetch_add(1)) {
      (*fn_)(task, tid);
      ++done;
    }
  }
  if (done) completed_.fetch_add(done, std::memory_order_release);
}

void ThreadPool::worker(int tid) {
  uint32_t seen = 0;  // the generation at construction: a run or stop may come before this thread starts
  for (;;) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
    int polls = 0;
    uint32_t gen;
    // An odd generation is a run being set up: wait for it to be published.
    while ((gen = generation_.load(std::memory_order_acquire)) == seen || (gen & 1)) {
      _mm_pause();
      // Past the first polls, offer the core to any runnable thread (torch, another hybridd process).
      if (++polls > 256) sched_yield();
      if (!(gen & 1) && polls % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
        sleepers_.fetch_add(1);
        generation_.wait(seen);
        sleepers_.fetch_sub(1);
      }
    }
    seen = gen;
    if (stop_.load()) return;
    // Entering is announced before the generation is checked again, and run() announces a new setup before
    // it checks for workers inside: so a worker never drains shares that are being rewritten.
    busy_.fetch_add(1);
    if (generation_.load() == seen) drain(tid);
    busy_.fetch_sub(1, std::memory_order_release);
  }
}

void ThreadPool::run(int ntasks, const std::function<void(int, int)>& fn) {
  if (ntasks <= 0) return;
  // The caller is thread 0: keep it on its own core, or a wake-up can land it on a worker's core and
  // leave another core idle (seen with two processes handing calls back and forth). Pinned once per
  // thread: re-pinning around every call costs a migration per call.
  thread_local int pinned_to = -2;
  if (pinned_to != cpus_[0]) {
    pin_thread(pthread_self(), cpus_[0]);
    pinned_to = cpus_[0];
  }
  if (size() == 1 || ntasks == 1) {
    for (int t = 0; t < ntasks; ++t) fn(t, 0);
    return;
  }
  // A worker still inside the previous run has found its shares empty: wait for it to leave before they are
  // rewritten. Workers are not waited for otherwise: one that is descheduled (its core lent to another
  // thread or process) leaves its tasks to the threads that are running.
  const uint32_t gen = generation_.load(std::memory_order_relaxed);
  generation_.store(gen + 1);
  while (busy_.load() > 0) _mm_pause();
  fn_ = &fn;
  for (int n = 0; n < num_nodes_; ++n) {
    shares_[n].next.store(int(int64_t(ntasks) * n / num_nodes_));
    shares_[n].end = int(int64_t(ntasks) * (n + 1) / num_nodes_);
  }
  completed_.store(0, std::memory_order_relaxed);
  generation_.store(gen + 2, std::memory_order_release);
  if (sleepers_.load() > 0) generation_.notify_all();
  drain(0);
  while (completed_.load(std::memory_order_acquire) < ntasks) _mm_pause();
}

}  // namespace hybridd
