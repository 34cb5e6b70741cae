// Output tensors of the CPU kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include "output_cache.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace detops {
namespace cpu {

// Outputs of at least this many bytes ask for transparent huge pages (see empty_output).
constexpr int64_t kHugePageMinBytes = int64_t{8} << 20;
// A transparent huge page.
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

#if defined(__linux__)
// madvise's MADV_POPULATE_WRITE, which headers older than Linux 5.14 lack.
constexpr int kPopulateWrite = 23;
#endif

// An uninitialized output whose every element the kernel writes. A large allocation is fresh
// memory (glibc maps allocations of 32 MiB and more anew each time), so each 4 KiB page the
// kernel first writes is a page fault that zeroes it (a noticeable part of a forward's time
// on one core), and faults taken by many threads at once contend in the OS. Buffers of
// kHugePageMinBytes or more therefore ask for 2 MiB transparent huge pages over their
// 2 MiB-aligned interior, as torch's THP_MEM_ALLOC_ENABLE does for every allocation. It is a
// hint: where the system has transparent huge pages off, or the memory is already in use,
// nothing changes.
//
// With several threads, such a buffer's pages are then mapped in parallel before the kernel
// runs (map_pages), unless the kernel's tasks first write ranges of their own (FirstWrites).
// The forwards' threads write all over their output (a thread's items are RoIs of every part
// of it), so their first writes would fault on the same pages at once and queue behind each
// other in the OS.
//
// map_pages maps [begin, end) for writing, splitting it into tasks that each fault pages of
// one kind: every whole 2 MiB page of the interior alone, and the 4 KiB pages at either end in
// pieces of 256 KiB (up to 2 MiB at each end: most of the faults of a large output, which
// ranges of equal shares would leave to two threads). A task asks the OS to map its
// range (MADV_POPULATE_WRITE, Linux 5.14 and later), which faults the pages in one system call
// and leaves their contents alone; where the OS does not have it, the task writes a zero byte
// to each page, which the kernel then overwrites.
inline void map_pages(uintptr_t begin, uintptr_t end) {
  constexpr uintptr_t kPage = 4096, kPiece = uintptr_t{256} << 10;
  const uintptr_t lo = begin & ~(kPage - 1);
  const uintptr_t hi = (end + kPage - 1) & ~(kPage - 1);
  uintptr_t huge_lo = (begin + kHugePage - 1) & ~(kHugePage - 1);
  uintptr_t huge_hi = end & ~(kHugePage - 1);
  if (huge_hi <= huge_lo) huge_lo = huge_hi = hi;  // no whole 2 MiB page
  std::vector<std::pair<uintptr_t, uintptr_t>> tasks;  // [first byte, end) of each task
  for (uintptr_t a = lo; a < huge_lo; a += kPiece) {
    tasks.emplace_back(a, std::min(a + kPiece, huge_lo));
  }
  for (uintptr_t a = huge_lo; a < huge_hi; a += kHugePage) tasks.emplace_back(a, a + kHugePage);
  for (uintptr_t a = huge_hi; a < hi; a += kPiece) tasks.emplace_back(a, std::min(a + kPiece, hi));
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const auto [a0, a1] = tasks[t];
#if defined(__linux__)
      if (madvise(reinterpret_cast<void*>(a0), a1 - a0, kPopulateWrite) == 0) continue;
#endif
      for (uintptr_t a = a0; a < a1; a += kPage) {
        *reinterpret_cast<volatile unsigned char*>(std::max(a, begin)) = 0;
      }
    }
  });
}

// Where a kernel's threads first write its output: kAnywhere, every thread all over it (the
// forwards), so its pages are mapped first; kOwnRanges, each task a range of its own (the
// backwards zero their planes' rows before adding into them), so a task's first writes fault
// on pages no other thread writes, while the other threads work, and mapping the pages first
// would only add a step before the kernel.
enum class FirstWrites { kAnywhere, kOwnRanges };

// With the OutputCache turned on (output_cache.h; off by default), an output of
// kCacheMinBytes or more takes its buffer from it; a kept buffer is mapped already.
inline at::Tensor empty_output(
    at::IntArrayRef sizes, const at::TensorOptions& options,
    FirstWrites first_writes = FirstWrites::kAnywhere) {
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(options.dtype().itemsize());
  OutputCache& cache = OutputCache::get();
  at::Tensor t;
  bool reused = false;
  if (bytes >= static_cast<int64_t>(kCacheMinBytes) && cache.limit() > 0) {
    t = at::detail::empty_generic(
        sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype().toScalarType(),
        options.memory_format_opt());
    reused = OutputCache::last_reused();
  } else {
    t = at::empty(sizes, options);
  }
  if (bytes < kHugePageMinBytes || reused) return t;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = end & ~(kHugePage - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  if (first_writes == FirstWrites::kAnywhere && at::get_num_threads() > 1 &&
      !at::in_parallel_region()) {
    map_pages(begin, end);
  }
  return t;
}

}  // namespace cpu
}  // namespace detops
