// Output tensors of the CPU kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace detops {
namespace cpu {

// Outputs of at least this many bytes ask for transparent huge pages (see empty_output).
constexpr int64_t kHugePageMinBytes = int64_t{8} << 20;

// An uninitialized output whose every element the kernel writes. A large allocation is fresh
// memory (glibc maps allocations of 32 MiB and more anew each time), so each 4 KiB page the
// kernel first writes is a page fault that zeroes it: a 51 MB roi_align output takes 12.5 k
// faults, about a sixth of the forward's time on one core, and faults taken by many threads
// at once contend in the OS. Buffers of kHugePageMinBytes or more therefore ask for 2 MiB
// transparent huge pages over their 2 MiB-aligned interior, as torch's THP_MEM_ALLOC_ENABLE
// does for every allocation. It is a hint: where the system has transparent huge pages off,
// or the memory is already in use, nothing changes.
//
// With several threads, such a buffer is then touched once per 4 KiB page, in parallel ranges
// of 2 MiB or more, before the kernel runs. The kernels' threads write all over their output (a
// thread's items are RoIs of every part of it), so their first writes fault on the same pages
// at once and queue behind each other in the OS: a 16-thread roi_align forward whose output
// was touched this way spent 13.6 instead of 16.8 ms in its kernel (BENCHMARKS.md, "CPU
// thread scaling"). The touch writes a zero byte per page of an output the kernel overwrites.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (bytes < kHugePageMinBytes) return t;
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  if (at::get_num_threads() > 1 && !at::in_parallel_region()) {
    constexpr uintptr_t kPage = 4096;
    const uintptr_t first_page = begin & ~(kPage - 1);
    const int64_t pages = static_cast<int64_t>((end - 1 - first_page) / kPage) + 1;
    at::parallel_for(0, pages, static_cast<int64_t>(kHuge / kPage), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uintptr_t a = std::max(begin, first_page + static_cast<uintptr_t>(p) * kPage);
        *reinterpret_cast<volatile unsigned char*>(a) = 0;
      }
    });
  }
  return t;
}

}  // namespace cpu
}  // namespace detops
