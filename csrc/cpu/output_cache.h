// Buffers of the CPU kernels' large outputs, kept for reuse after the tensors that held them
// are freed. Off by default: DETOPS_CPU_OUTPUT_CACHE_MB=N (N > 0, read once) keeps up to N MiB,
// and _C._set_cpu_output_cache(bytes) sets the limit at run time (0 turns it off again).
//
// torch's CPU allocator hands each tensor to malloc and each freed tensor back to it. With
// glibc, a buffer of a few MiB comes from the top of the heap, and freeing buffers there can
// return the top of the heap to the OS (once more than the trim threshold lies free): the next
// call's outputs then fault on fresh pages, each zeroed by the OS, and the threads of one
// process fault one after another. Whether that happens depends on the machine and on what
// else the process freed before, and where it does not, the cache changes nothing; hence
// opt-in.
//
// The cache keeps up to kCacheMaxBlocks freed buffers of kCacheMinBytes or more, at most
// limit() bytes in all, and gives an output the smallest kept buffer that holds it with at most
// an eighth to spare. A buffer freed past the limit pushes out the longest kept ones; one
// larger than the limit is freed at once. The buffers come from torch's own c10::alloc_cpu, so
// a tensor made here is like one of at::empty's: aligned alike, resizable, and freed from any
// thread. A kept buffer's pages are mapped already, so empty_output neither advises huge pages
// for it nor maps it again; under deterministic algorithms its outputs skip torch's NaN fill of
// uninitialized memory, since the kernels write every element.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

#include "../common/checks.h"

namespace detops {
namespace cpu {

// Outputs smaller than this take torch's allocator.
constexpr size_t kCacheMinBytes = size_t{1} << 20;
// Buffers kept at most.
constexpr size_t kCacheMaxBlocks = 16;

class OutputCache final : public c10::Allocator {
 public:
  // The process's cache. It is never destroyed: tensors may be freed while the process exits.
  static OutputCache& get() {
    static OutputCache* cache = create();
    return *cache;
  }

  c10::DataPtr allocate(size_t n) override {
    Block* block = take(n);
    reused_ = block != nullptr;
    if (block == nullptr) {
      const size_t size = round_up(n);
      void* ptr = nullptr;
      try {
        ptr = c10::alloc_cpu(size);
      } catch (const c10::Error&) {
        drop(take_all());  // out of memory: give back the kept buffers and try once more
        ptr = c10::alloc_cpu(size);
      }
      block = new Block{ptr, size};
    }
    return {block->ptr, block, &OutputCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Whether this thread's last allocate() gave a kept buffer (its pages already mapped).
  static bool last_reused() { return reused_; }

  // Sets the bytes kept at most, giving back the buffers past it; returns the previous limit.
  size_t set_limit(size_t bytes) {
    std::vector<Block*> out;
    size_t previous;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      previous = limit_;
      limit_ = bytes;
      evict(0, out);
    }
    drop(out);
    return previous;
  }

  size_t limit() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }

  // Bytes kept now.
  size_t kept_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_;
  }

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  static constexpr size_t kGrain = 64 << 10;  // sizes rounded up to this, so near sizes share buffers

  explicit OutputCache(size_t limit) : limit_(limit) {}

  // The cache, made once, with its lock taken around every fork() of the process: a child
  // forked while another thread held the lock (in limit, take, release or set_limit) would
  // otherwise wait for it forever, that thread not existing in the child (a DataLoader's
  // workers are forked while other threads free tensors). As glibc does for malloc's own locks.
  static OutputCache* create() {
    OutputCache* cache = new OutputCache(limit_from_env());
    instance_ = cache;
#if defined(__unix__) || defined(__APPLE__)
    pthread_atfork(&lock_for_fork, &unlock_after_fork, &unlock_after_fork);
#endif
    return cache;
  }

  static void lock_for_fork() { instance_->mutex_.lock(); }
  static void unlock_after_fork() { instance_->mutex_.unlock(); }

  static size_t round_up(size_t n) { return (n + kGrain - 1) / kGrain * kGrain; }

  static size_t limit_from_env() {
    const char* text = std::getenv("DETOPS_CPU_OUTPUT_CACHE_MB");
    if (text == nullptr || *text == '\0') return 0;  // off
    char* end = nullptr;
    errno = 0;
    const unsigned long long mib = std::strtoull(text, &end, 10);
    DETOPS_CHECK(
        *end == '\0' && errno == 0 && text[0] != '-' && mib <= (SIZE_MAX >> 20),
        "detops: DETOPS_CPU_OUTPUT_CACHE_MB must be a whole number of MiB (0 keeps no buffers), got '",
        std::string(text), "'");
    return static_cast<size_t>(mib) << 20;
  }

  // The smallest kept buffer of n bytes or more with at most an eighth to spare, taken out.
  Block* take(size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = blocks_.size();
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const size_t size = blocks_[i]->size;
      if (size >= n && size - n <= n / 8 + kGrain && (best == blocks_.size() || size < blocks_[best]->size)) {
        best = i;
      }
    }
    if (best == blocks_.size()) return nullptr;
    Block* block = blocks_[best];
    blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(best));
    kept_ -= block->size;
    return block;
  }

  std::vector<Block*> take_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Block*> out;
    out.swap(blocks_);
    kept_ = 0;
    return out;
  }

  // Moves the longest kept buffers to `out` until `incoming` more bytes and one more buffer fit
  // (incoming 0: until the kept ones fit). Holds mutex_.
  void evict(size_t incoming, std::vector<Block*>& out) {
    size_t first = 0;
    const size_t room = incoming > 0 ? kCacheMaxBlocks - 1 : kCacheMaxBlocks;
    while (first < blocks_.size() && (kept_ + incoming > limit_ || blocks_.size() - first > room)) {
      kept_ -= blocks_[first]->size;
      out.push_back(blocks_[first++]);
    }
    blocks_.erase(blocks_.begin(), blocks_.begin() + static_cast<std::ptrdiff_t>(first));
  }

  static void drop(const std::vector<Block*>& blocks) {
    for (Block* block : blocks) {
      c10::free_cpu(block->ptr);
      delete block;
    }
  }

  // A tensor's buffer, freed: kept where it fits under the limit, given back otherwise (and
  // where it is smaller than kCacheMinBytes: a storage resized to less through this allocator).
  static void release(void* ctx) {
    OutputCache& cache = get();
    Block* block = static_cast<Block*>(ctx);
    std::vector<Block*> out;
    {
      std::lock_guard<std::mutex> lock(cache.mutex_);
      if (block->size >= kCacheMinBytes && block->size <= cache.limit_) {
        cache.evict(block->size, out);
        cache.blocks_.push_back(block);
        cache.kept_ += block->size;
        block = nullptr;
      }
    }
    drop(out);
    if (block != nullptr) drop({block});
  }

  mutable std::mutex mutex_;
  size_t limit_;
  size_t kept_ = 0;
  std::vector<Block*> blocks_;  // kept buffers, longest kept first
  static inline thread_local bool reused_ = false;
  static inline OutputCache* instance_ = nullptr;  // what create() made, for the fork handlers
};

}  // namespace cpu
}  // namespace detops
