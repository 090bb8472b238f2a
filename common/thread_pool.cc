#include "common/thread_pool.h"

#include <algorithm>
#include <cstdlib>

namespace rubato {
namespace {

// A few chunks per thread, so that a thread that wakes late or is descheduled costs less than a
// whole share; chunk boundaries still depend only on (n, grain, num_threads).
constexpr int64_t kChunksPerThread = 4;

}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(std::max(num_threads, 1)) {
  threads_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

int ThreadPool::num_threads() const { return num_threads_; }

void ThreadPool::RunChunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n,
                           int64_t chunks) {
  for (;;) {
    const int64_t k = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (k >= chunks) return;
    // Chunk k is [k*n/c, (k+1)*n/c): sizes differ by at most one, and each is >= grain because
    // c <= n / grain. n * chunks cannot overflow for any tensor that fits in memory.
    fn(k * n / chunks, (k + 1) * n / chunks);
  }
}

void ThreadPool::WorkerLoop() {
  int64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunks;
    {
      absl::MutexLock lock(&mu_);
      while (!shutdown_ && generation_ == seen) work_cv_.Wait(&mu_);
      if (shutdown_) return;
      // A worker that slept through whole jobs joins the newest one, or none if it is over.
      seen = generation_;
      if (fn_ == nullptr) continue;
      fn = fn_;
      n = n_;
      chunks = chunks_;
      ++active_;
    }
    RunChunks(*fn, n, chunks);
    absl::MutexLock lock(&mu_);
    if (--active_ == 0) idle_cv_.SignalAll();
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks =
      std::min<int64_t>(std::max<int64_t>(n / grain, 1), kChunksPerThread * num_threads_);
  if (chunks == 1 || num_threads_ == 1) {
    fn(0, n);
    return;
  }
  absl::MutexLock call_lock(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    // The previous call returned only once active_ was 0, so no worker still reads the old job.
    fn_ = &fn;
    n_ = n;
    chunks_ = chunks;
    next_chunk_.store(0, std::memory_order_relaxed);
    ++generation_;
    work_cv_.SignalAll();
  }
  RunChunks(fn, n, chunks);
  // Every chunk is claimed; the ones still running belong to active workers. Waiting for
  // active_ == 0 (not just for the chunks) also keeps late workers from reading the next job's
  // counter with this job's fn.
  absl::MutexLock lock(&mu_);
  while (active_ > 0) idle_cv_.Wait(&mu_);
  fn_ = nullptr;
}

}  // namespace rubato
