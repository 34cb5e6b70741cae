// Output tensors of the CPU kernels.
#pragma once

#include <ATen/ATen.h>

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
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (bytes >= kHugePageMinBytes) {
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t last = (begin + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return t;
}

}  // namespace cpu
}  // namespace detops
