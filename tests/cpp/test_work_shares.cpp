// cpu::parallel_shares (csrc/cpu/work_shares.h), the loop of the CPU RoI kernels: every item
// runs exactly once, whatever the thread count and chunk, and threads done with their own share
// take over the rest of a stalled one; a prologue runs once per share, on its owner, before
// that thread's chunks. cpu::PerThread gives each thread of such a loop a T of its own.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "cpu/work_shares.h"
#include "thread_count.h"

namespace {

using detops_test::ThreadCount;

// Whether at::parallel_for runs on several threads here (this executable built with OpenMP).
bool parallel_for_uses_threads() {
  std::atomic<unsigned> seen{0};
  at::parallel_for(0, 4, 1, [&](int64_t, int64_t) {
    seen.fetch_or(1u << (at::get_thread_num() % 32));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  return (seen.load() & (seen.load() - 1)) != 0;
}

TEST(ParallelShares, RunsEveryItemOnce) {
  for (int threads : {1, 3, 4}) {
    ThreadCount count(threads);
    for (int64_t n : {0, 1, 5, 64, 1000, 1001}) {
      for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}, int64_t{5000}}) {
        const std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[n > 0 ? n : 1]());
        std::atomic<bool> bad_range{false};
        detops::cpu::parallel_shares(n, chunk, [&](int64_t begin, int64_t end) {
          if (!(0 <= begin && begin < end && end <= n)) bad_range = true;
          for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
        });
        EXPECT_FALSE(bad_range.load()) << "threads " << threads << " n " << n << " chunk " << chunk;
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i].load(), 1) << "item " << i << " threads " << threads << " n " << n << " chunk " << chunk;
        }
      }
    }
  }
}

TEST(ParallelShares, OtherThreadsTakeOverAStalledShare) {
  ThreadCount count(4);
  if (!parallel_for_uses_threads()) GTEST_SKIP() << "at::parallel_for runs on one thread in this build";
  // Four shares of 100 items in chunks of 5. Every chunk of the first share takes 2 ms, so
  // its owner runs at most a few of them while the other threads finish their shares.
  constexpr int64_t n = 400, share = 100;
  const std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[n]());
  const std::unique_ptr<std::atomic<int>[]> ran_on(new std::atomic<int>[n]());
  detops::cpu::parallel_shares(n, 5, [&](int64_t begin, int64_t end) {
    if (begin < share) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (int64_t i = begin; i < end; ++i) {
      hits[i].fetch_add(1);
      ran_on[i].store(at::get_thread_num());
    }
  });
  std::set<int> threads_of_first_share;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(hits[i].load(), 1) << "item " << i;
    if (i < share) threads_of_first_share.insert(ran_on[i].load());
  }
  EXPECT_GE(threads_of_first_share.size(), 2u);
}

TEST(ParallelShares, PrologueRunsOncePerShareBeforeItsOwnersChunks) {
  for (int threads : {1, 3, 4}) {
    ThreadCount count(threads);
    for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{1000}}) {
      for (int64_t chunk : {int64_t{1}, int64_t{7}}) {
        // shares in use: the thread count, or fewer where there are fewer chunks
        const int64_t shares = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
        std::mutex mutex;
        std::map<int64_t, int> prologues;            // share -> runs of its prologue
        std::set<std::thread::id> prologue_threads;  // threads that ran a prologue
        int64_t shares_passed = -1, chunks_without_prologue = 0;
        detops::cpu::parallel_shares(
            n, chunk,
            [&](int64_t, int64_t) {
              const std::lock_guard<std::mutex> lock(mutex);
              if (!prologue_threads.count(std::this_thread::get_id())) ++chunks_without_prologue;
            },
            [&](int64_t share, int64_t of) {
              const std::lock_guard<std::mutex> lock(mutex);
              ++prologues[share];
              prologue_threads.insert(std::this_thread::get_id());
              shares_passed = of;
            });
        const std::string where = "threads " + std::to_string(threads) + " n " + std::to_string(n) +
            " chunk " + std::to_string(chunk);
        if (shares <= 1) {  // fn(0, n) on the calling thread, and no prologue
          EXPECT_TRUE(prologues.empty()) << where;
          continue;
        }
        EXPECT_EQ(shares_passed, shares) << where;
        EXPECT_EQ(chunks_without_prologue, 0) << where;
        ASSERT_EQ(static_cast<int64_t>(prologues.size()), shares) << where;
        for (const auto& [share, runs] : prologues) {
          EXPECT_TRUE(0 <= share && share < shares) << where << " share " << share;
          EXPECT_EQ(runs, 1) << where << " share " << share;
        }
      }
    }
  }
}

TEST(ParallelShares, InsideAParallelRegionRunsOnTheCallingThread) {
  ThreadCount count(4);
  if (!parallel_for_uses_threads()) GTEST_SKIP() << "at::parallel_for opens no parallel region in this build";
  std::atomic<int> calls{0}, items{0};
  at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      detops::cpu::parallel_shares(100, 3, [&](int64_t b, int64_t e) {
        calls.fetch_add(1);
        items.fetch_add(static_cast<int>(e - b));
      });
    }
  });
  EXPECT_EQ(calls.load(), 2);
  EXPECT_EQ(items.load(), 200);
}

TEST(PerThread, EachThreadGetsItsOwnValueMadeOnce) {
  for (int threads : {1, 3, 4}) {
    ThreadCount count(threads);
    struct Counter {
      std::thread::id owner;
      int64_t items = 0;
    };
    std::atomic<int> made{0};
    std::atomic<bool> shared{false};
    detops::cpu::PerThread<Counter> counters;
    std::mutex mutex;
    std::set<Counter*> seen;
    detops::cpu::parallel_shares(1000, 3, [&](int64_t begin, int64_t end) {
      Counter* c = counters.get([&] {
        made.fetch_add(1);
        return Counter{std::this_thread::get_id(), 0};
      });
      ASSERT_NE(c, nullptr);
      if (c->owner != std::this_thread::get_id()) shared = true;
      c->items += end - begin;
      const std::lock_guard<std::mutex> lock(mutex);
      seen.insert(c);
    });
    int64_t items = 0;
    for (Counter* c : seen) items += c->items;
    EXPECT_EQ(items, 1000) << "threads " << threads;
    EXPECT_FALSE(shared.load()) << "threads " << threads;
    EXPECT_EQ(made.load(), static_cast<int>(seen.size())) << "threads " << threads;
    EXPECT_LE(made.load(), threads) << "threads " << threads;
  }
}

TEST(PerThread, AThreadPastTheSlotsGetsNone) {
  std::unique_ptr<detops::cpu::PerThread<int>> one;
  {
    ThreadCount count(1);
    one = std::make_unique<detops::cpu::PerThread<int>>();  // one slot
  }
  ThreadCount count(4);
  if (!parallel_for_uses_threads()) GTEST_SKIP() << "at::parallel_for runs on one thread in this build";
  std::atomic<int> none{0}, some{0};
  at::parallel_for(0, 4, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int* v = one->get([] { return 7; });
      if (v == nullptr) {
        EXPECT_NE(at::get_thread_num(), 0);
        none.fetch_add(1);
      } else {
        EXPECT_EQ(at::get_thread_num(), 0);
        EXPECT_EQ(*v, 7);
        some.fetch_add(1);
      }
    }
  });
  EXPECT_GT(none.load(), 0);
  EXPECT_GT(some.load(), 0);
}

}  // namespace
