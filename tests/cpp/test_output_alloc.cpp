// cpu::map_pages and cpu::empty_output (csrc/cpu/output_alloc.h): before a threaded kernel
// writes a large output all over, every page of it is mapped, and no page outside it is
// touched; an output whose tasks write ranges of their own is left to them. cpu::OutputCache
// (output_cache.h): off unless turned on; once on, a freed output's buffer is reused, and a
// process forked while another thread uses it can use it.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "cpu/output_alloc.h"
#include "thread_count.h"

namespace {

using detops_test::ThreadCount;

#if defined(__linux__)
constexpr uintptr_t kPage = 4096;

// A fresh anonymous mapping of `bytes` in 4 KiB pages only (no page is resident before it is
// first written), unmapped at the end of the test.
class FreshMapping {
 public:
  explicit FreshMapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
    // a 2 MiB page would make its neighbours resident with the page map_pages asks for
    if (base_ != nullptr) madvise(base_, bytes_, MADV_NOHUGEPAGE);
  }
  ~FreshMapping() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  uintptr_t base() const { return reinterpret_cast<uintptr_t>(base_); }

  // Whether each 4 KiB page of the mapping is resident.
  std::vector<bool> resident() const {
    std::vector<unsigned char> v(bytes_ / kPage);
    EXPECT_EQ(mincore(base_, bytes_, v.data()), 0);
    std::vector<bool> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = (v[i] & 1) != 0;
    return out;
  }

 private:
  size_t bytes_;
  unsigned char* base_;
};
#endif

TEST(MapPages, MapsEveryPageOfTheRangeAndNoOther) {
#if defined(__linux__)
  // ranges that start and end inside pages, on page and 2 MiB boundaries, shorter than a
  // 2 MiB page and spanning several, at 1 and 3 threads
  const uintptr_t huge = detops::cpu::kHugePage;
  const std::vector<std::pair<uintptr_t, uintptr_t>> ranges = {
      {16, 16 + 3 * huge + 100}, {kPage + 64, 5 * kPage}, {huge - 8, 2 * huge + 8},
      {huge, 3 * huge}, {3 * kPage, 3 * kPage + 1}, {100, huge + 5 * kPage + 7}};
  for (int threads : {1, 3}) {
    ThreadCount count(threads);
    for (const auto& [from, to] : ranges) {
      FreshMapping m(6 * huge);
      ASSERT_NE(m.base(), 0u);
      // offsets from a 2 MiB boundary inside the mapping, so that the range has whole 2 MiB
      // pages where it spans them
      const uintptr_t origin = (m.base() + huge - 1) & ~(huge - 1);
      const uintptr_t begin = origin + from, end = origin + to;
      detops::cpu::map_pages(begin, end);
      const std::vector<bool> resident = m.resident();
      for (size_t i = 0; i < resident.size(); ++i) {
        const uintptr_t page = m.base() + i * kPage;
        const bool inside = page + kPage > begin && page < end;
        ASSERT_EQ(resident[i], inside) << "threads " << threads << ", range [" << from << ", " << to
                                       << ") from a 2 MiB boundary, page " << i;
      }
    }
  }
#else
  GTEST_SKIP() << "mincore is Linux's";
#endif
}

TEST(EmptyOutput, ALargeOutputIsMappedBeforeAThreadedKernel) {
#if defined(__linux__)
  ThreadCount count(3);
  // 12 MiB of float: past kHugePageMinBytes
  const at::Tensor t = detops::cpu::empty_output({3, 1 << 20}, at::TensorOptions().dtype(at::kFloat));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.numel()) * sizeof(float);
  const uintptr_t lo = begin & ~(kPage - 1);
  std::vector<unsigned char> v((end - lo + kPage - 1) / kPage);
  ASSERT_EQ(mincore(reinterpret_cast<void*>(lo), end - lo, v.data()), 0);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_TRUE(v[i] & 1) << "page " << i << " of " << v.size();
#else
  GTEST_SKIP() << "mincore is Linux's";
#endif
}

// The output cache emptied and set to `bytes` for a test, then set back.
class CacheLimit {
 public:
  explicit CacheLimit(size_t bytes) : previous_(detops::cpu::OutputCache::get().set_limit(0)) {
    detops::cpu::OutputCache::get().set_limit(bytes);
  }
  ~CacheLimit() {
    detops::cpu::OutputCache::get().set_limit(0);
    detops::cpu::OutputCache::get().set_limit(previous_);
  }

 private:
  size_t previous_;
};

TEST(EmptyOutput, AnOutputWrittenByTasksInRangesOfTheirOwnIsLeftToThem) {
#if defined(__linux__)
  ThreadCount count(3);
  CacheLimit none(0);  // a fresh buffer, not one an earlier test freed
  // 40 MiB, past the 32 MiB from which glibc always maps an allocation anew (a smaller one may
  // reuse memory a test before wrote)
  const at::Tensor t = detops::cpu::empty_output(
      {10, 1 << 20}, at::TensorOptions().dtype(at::kFloat), detops::cpu::FirstWrites::kOwnRanges);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.numel()) * sizeof(float);
  // the 2 MiB pages inside the buffer: none mapped (the allocator may have written the first
  // 4 KiB page, outside them)
  const uintptr_t lo = (begin + detops::cpu::kHugePage - 1) & ~(detops::cpu::kHugePage - 1);
  const uintptr_t hi = end & ~(detops::cpu::kHugePage - 1);
  ASSERT_LT(lo, hi);
  std::vector<unsigned char> v((hi - lo) / kPage);
  ASSERT_EQ(mincore(reinterpret_cast<void*>(lo), hi - lo, v.data()), 0);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_FALSE(v[i] & 1) << "page " << i << " of " << v.size();
#else
  GTEST_SKIP() << "mincore is Linux's";
#endif
}

TEST(OutputCache, OffUnlessTurnedOn) {
  const char* env = std::getenv("DETOPS_CPU_OUTPUT_CACHE_MB");
  if (env != nullptr && std::strtoull(env, nullptr, 10) > 0) {
    GTEST_SKIP() << "DETOPS_CPU_OUTPUT_CACHE_MB turns the cache on in this process";
  }
  detops::cpu::OutputCache& cache = detops::cpu::OutputCache::get();
  EXPECT_EQ(cache.limit(), size_t{0});
  at::Tensor t = detops::cpu::empty_output({3, 1 << 20}, at::TensorOptions().dtype(at::kFloat));
  EXPECT_NE(t.storage().allocator(), &cache);  // torch's allocator
  t.reset();
  EXPECT_EQ(cache.kept_bytes(), size_t{0});
  {
    CacheLimit on(size_t{64} << 20);  // turned on at run time
    at::Tensor u = detops::cpu::empty_output({3, 1 << 20}, at::TensorOptions().dtype(at::kFloat));
    EXPECT_EQ(u.storage().allocator(), &cache);
  }
  EXPECT_EQ(cache.limit(), size_t{0});
}

TEST(OutputCache, AFreedOutputIsKeptAndItsMappedBufferReused) {
  CacheLimit limit(size_t{64} << 20);
  const at::TensorOptions floats = at::TensorOptions().dtype(at::kFloat);
  at::Tensor t = detops::cpu::empty_output({3, 1 << 20}, floats);  // 12 MiB
  EXPECT_FALSE(detops::cpu::OutputCache::last_reused());
  t.fill_(1.0f);
  void* const ptr = t.data_ptr();
  t.reset();
  EXPECT_GE(detops::cpu::OutputCache::get().kept_bytes(), size_t{12} << 20);
  at::Tensor u = detops::cpu::empty_output({3, 1 << 20}, floats);
  EXPECT_TRUE(detops::cpu::OutputCache::last_reused());
  EXPECT_EQ(u.data_ptr(), ptr);
  EXPECT_EQ(detops::cpu::OutputCache::get().kept_bytes(), size_t{0});
  // channels_last strides through the cache's allocator
  at::Tensor cl = detops::cpu::empty_output({2, 64, 100, 80}, floats.memory_format(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(cl.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(cl.is_contiguous());
}

TEST(OutputCache, AProcessForkedWhileAnotherThreadUsesItCanUseIt) {
#if defined(__linux__)
  // A thread takes and frees the cache's buffers without pause (holding its lock much of the
  // time) while this one forks; each child takes and frees a buffer and exits. A child forked
  // while the lock was held would wait for it forever, since the thread that held it does not
  // exist in the child: the cache takes its lock around a fork and releases it on both sides.
  CacheLimit limit(size_t{64} << 20);
  std::atomic<bool> stop{false};
  std::thread user([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      c10::DataPtr a = detops::cpu::OutputCache::get().allocate(size_t{1} << 20);
      c10::DataPtr b = detops::cpu::OutputCache::get().allocate(size_t{2} << 20);
    }
  });
  int stuck = 0, failed = 0;
  for (int i = 0; i < 200 && stuck == 0; ++i) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      {
        c10::DataPtr a = detops::cpu::OutputCache::get().allocate(size_t{1} << 20);
      }
      _exit(0);
    }
    int status = 0;
    bool ended = false;
    for (int wait_ms = 0; wait_ms < 5000 && !ended; ++wait_ms) {
      ended = waitpid(pid, &status, WNOHANG) == pid;
      if (!ended) usleep(1000);
    }
    if (!ended) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ++stuck;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failed;
    }
  }
  stop = true;
  user.join();
  EXPECT_EQ(stuck, 0) << "a forked child waited 5 s on the cache";
  EXPECT_EQ(failed, 0);
#else
  GTEST_SKIP() << "fork and waitpid are POSIX's";
#endif
}

}  // namespace
