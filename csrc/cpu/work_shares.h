// Parallel loops for the CPU RoI kernels whose items cost about the same but whose threads do
// not run at the same speed.
//
// at::parallel_for gives each thread one fixed, equal range, so a call lasts as long as its
// slowest thread; on a shared machine the cores can run the same work up to twice apart
// (another process on a core, its clock).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace detops {
namespace cpu {

// Chunks of about 1/16 of a thread's share of n items, at most max_chunk items: small enough
// that the threads finish within a chunk of each other, large enough that a chunk's items
// share what they read (a kernel's items in order read the same planes).
inline int64_t share_chunk(int64_t n, int64_t max_chunk) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::clamp<int64_t>(n / (threads * 16), 1, std::max<int64_t>(1, max_chunk));
}

// Runs fn(begin, end) over ranges that cover [0, n) once each, on the threads of one parallel
// region. Every thread owns an equal share of the items, in order, and takes it `chunk` items
// at a time from the front, so that consecutive items (which read the same data) run on one
// core. A thread done with its own share takes the next chunk of the share with the most
// items left, until none are left. fn must not depend on which thread runs a range; inside a
// parallel region, or with one thread, fn(0, n) runs on the calling thread.
//
// prologue(share, shares), where given, runs once for each share on the thread that owns it,
// before that thread takes its first chunk (for work the items then share, split among the
// threads without a parallel loop of its own). It does not run where fn(0, n) runs on the
// calling thread, so fn must not depend on it having run.
template <typename F, typename P>
void parallel_shares(int64_t n, int64_t chunk, const F& fn, const P& prologue) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(int64_t{0}, n);
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};  // the first item not yet taken; may pass `end`
    int64_t end = 0;
  };
  const std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next.store(n / threads * t + n % threads * t / threads, std::memory_order_relaxed);
    shares[t].end = n / threads * (t + 1) + n % threads * (t + 1) / threads;
  }
  // Runs the next chunk of share s; false when s has none left.
  const auto take = [&](Share& s) {
    const int64_t begin = s.next.fetch_add(chunk, std::memory_order_relaxed);
    if (begin >= s.end) return false;
    fn(begin, std::min(begin + chunk, s.end));
    return true;
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) prologue(t, threads);
    for (int64_t t = t0; t < t1; ++t) {
      while (take(shares[t])) {
      }
    }
    for (;;) {
      Share* most = nullptr;
      int64_t most_left = 0;
      for (int64_t v = 0; v < threads; ++v) {
        const int64_t left = shares[v].end - shares[v].next.load(std::memory_order_relaxed);
        if (left > most_left) {
          most_left = left;
          most = &shares[v];
        }
      }
      if (most == nullptr) return;
      take(*most);
    }
  });
}

template <typename F>
void parallel_shares(int64_t n, int64_t chunk, const F& fn) {
  parallel_shares(n, chunk, fn, [](int64_t, int64_t) {});
}

// One T per thread of a parallel_shares call, made by the first range that thread runs: the
// buffers of a kernel whose chunks last a few microseconds, too short to allocate and free
// buffers of their own each time. Construct it before the call, on the calling thread. get()
// returns nullptr on a thread whose number is past the slots (fn running on the calling thread
// inside another parallel region); get_or_own() then makes the range's T in `own` instead.
template <typename T>
class PerThread {
 public:
  PerThread() : slots_(std::max<int64_t>(1, at::get_num_threads())) {}

  template <typename Make>
  T* get(const Make& make) {
    const int64_t t = at::get_thread_num();
    if (t < 0 || t >= static_cast<int64_t>(slots_.size())) return nullptr;
    std::optional<T>& slot = slots_[t];
    if (!slot) slot.emplace(make());
    return &*slot;
  }

  template <typename Make>
  T& get_or_own(std::optional<T>& own, const Make& make) {
    T* mine = get(make);
    return mine != nullptr ? *mine : own.emplace(make());
  }

 private:
  std::vector<std::optional<T>> slots_;
};

}  // namespace cpu
}  // namespace detops
