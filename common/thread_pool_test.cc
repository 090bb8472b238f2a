#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

using Chunk = std::pair<int64_t, int64_t>;

// Runs one ParallelFor and returns its chunks, sorted, after checking that they cover [0, n)
// exactly once.
std::vector<Chunk> RunAndCollect(ThreadPool& pool, int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::mutex mu;
  std::vector<Chunk> chunks;
  pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(begin, end);
  });
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
  std::sort(chunks.begin(), chunks.end());
  int64_t next = 0;
  for (const Chunk& c : chunks) {
    EXPECT_EQ(c.first, next);
    EXPECT_LT(c.first, c.second);
    next = c.second;
  }
  if (n > 0) {
    EXPECT_EQ(next, n);
  }
  return chunks;
}

TEST(ThreadPoolTest, NumThreadsCountsTheCaller) {
  EXPECT_EQ(ThreadPool(1).num_threads(), 1);
  EXPECT_EQ(ThreadPool(4).num_threads(), 4);
}

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 8}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 2, 7, 100, 1000, 4097, 100003}) {
      for (int64_t grain : {1, 3, 64, 1000}) {
        SCOPED_TRACE(testing::Message() << threads << " threads, n " << n << ", grain " << grain);
        const std::vector<Chunk> chunks = RunAndCollect(pool, n, grain);
        // Every chunk honours the grain unless there is only one.
        if (chunks.size() > 1) {
          for (const Chunk& c : chunks) EXPECT_GE(c.second - c.first, grain);
        }
        EXPECT_LE(chunks.size(), static_cast<size_t>(4 * threads));
      }
    }
  }
}

TEST(ThreadPoolTest, EmptyRangeCallsNothing) {
  ThreadPool pool(4);
  int calls = 0;
  pool.ParallelFor(0, 1, [&](int64_t, int64_t) { ++calls; });
  pool.ParallelFor(-5, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPoolTest, RangeBelowGrainIsOneChunkOnTheCaller) {
  ThreadPool pool(4);
  std::vector<Chunk> chunks;
  std::thread::id where;
  pool.ParallelFor(10, 100, [&](int64_t begin, int64_t end) {
    chunks.emplace_back(begin, end);
    where = std::this_thread::get_id();
  });
  EXPECT_EQ(chunks, std::vector<Chunk>({{0, 10}}));
  EXPECT_EQ(where, std::this_thread::get_id());
}

TEST(ThreadPoolTest, OneThreadRunsEverythingOnTheCaller) {
  ThreadPool pool(1);
  std::vector<Chunk> chunks;
  std::set<std::thread::id> where;
  pool.ParallelFor(1 << 20, 1, [&](int64_t begin, int64_t end) {
    chunks.emplace_back(begin, end);
    where.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(chunks, std::vector<Chunk>({{0, 1 << 20}}));
  EXPECT_EQ(where, std::set<std::thread::id>({std::this_thread::get_id()}));
}

TEST(ThreadPoolTest, ChunksDependOnlyOnTheArguments) {
  ThreadPool pool(4);
  const std::vector<Chunk> first = RunAndCollect(pool, 100003, 1000);
  EXPECT_EQ(first.size(), 16u);  // min(100003 / 1000, 4 per thread * 4 threads)
  for (int i = 0; i < 50; ++i) EXPECT_EQ(RunAndCollect(pool, 100003, 1000), first);
  // Another pool of the same size cuts the same chunks.
  ThreadPool other(4);
  EXPECT_EQ(RunAndCollect(other, 100003, 1000), first);
}

TEST(ThreadPoolTest, ManyCallsInARow) {
  ThreadPool pool(4);
  std::vector<int64_t> data(5000, 0);
  for (int call = 0; call < 2000; ++call) {
    const int64_t n = 1 + call % 5000;
    pool.ParallelFor(n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) ++data[i];
    });
  }
  // Index i is in the range of every call with n > i.
  for (int64_t i = 0; i < 5000; ++i) {
    int64_t expected = 0;
    for (int call = 0; call < 2000; ++call) expected += (1 + call % 5000) > i;
    ASSERT_EQ(data[i], expected) << i;
  }
}

TEST(ThreadPoolTest, UsesThePoolThreads) {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> where;
  // Each chunk waits until it has seen a second thread or gives up; the test only needs some
  // other thread to run some chunk at least once over many tries, so it cannot flake on a
  // busy machine.
  for (int attempt = 0; attempt < 100 && where.size() < 2; ++attempt) {
    pool.ParallelFor(16, 1, [&](int64_t, int64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard<std::mutex> lock(mu);
      where.insert(std::this_thread::get_id());
    });
  }
  EXPECT_GE(where.size(), 2u);
}

TEST(ThreadPoolTest, CallersOnSeveralThreadsTakeTurns) {
  ThreadPool pool(3);
  std::vector<std::vector<int>> data(4, std::vector<int>(10000, 0));
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 200; ++rep) {
        pool.ParallelFor(10000, 100, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) ++data[c][i];
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (const std::vector<int>& d : data) {
    EXPECT_EQ(std::count(d.begin(), d.end(), 200), 10000);
  }
}

TEST(ThreadPoolTest, DestroyWithoutUse) {
  for (int i = 0; i < 20; ++i) ThreadPool pool(4);
}

}  // namespace
}  // namespace rubato
