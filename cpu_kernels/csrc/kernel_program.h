// A decode step's kernel calls recorded once, with their arguments, and replayed in order: the CPU's counterpart
// of a CUDA graph. Replaying runs no Python between the kernels, so a step costs what its kernels cost; every
// address a call recorded (weights, caches, the step's static inputs and its intermediates) must stay valid
// whenever the program runs: inputs rewritten in place, intermediates kept by the program or placed in an arena
// that only programs which never run at once share (cpu_kernels/program.py, cpu_kernels/arena.py).
#pragma once

#include <chrono>
#include <functional>
#include <utility>
#include <vector>

namespace hybridd {

class KernelProgram {
 public:
  using Op = std::function<void()>;
  void add(Op op) { ops_.push_back(std::move(op)); }
  // The recorded calls in order; a call that throws stops the run there.
  void run() const {
    for (const Op& op : ops_) op();
  }
  // The same, returning each call's seconds (an instrument: benchmarks split a step by kernel).
  std::vector<double> run_timed() const {
    std::vector<double> seconds;
    seconds.reserve(ops_.size());
    for (const Op& op : ops_) {
      const auto start = std::chrono::steady_clock::now();
      op();
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return seconds;
  }
  size_t size() const { return ops_.size(); }

 private:
  std::vector<Op> ops_;
};

}  // namespace hybridd
