// at::set_num_threads for one test, restored after it: the GoogleTest tests of the CPU
// kernels' thread helpers.
#pragma once

#include <ATen/Parallel.h>

namespace detops_test {

class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~ThreadCount() { at::set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace detops_test
