// ThreadPool: a fixed set of threads for data-parallel loops over large tensors.
#ifndef RUBATO_COMMON_THREAD_POOL_H_
#define RUBATO_COMMON_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace rubato {

class ThreadPool {
 public:
  // num_threads >= 1; the calling thread counts as one, so num_threads - 1 threads are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;

  // Calls fn(begin, end) over [0, n) cut into chunks of at least `grain` elements, on the pool's
  // threads and the caller's, and returns when all chunks are done. Not reentrant: fn must not
  // call ParallelFor on the same pool. The chunks depend only on n, grain and num_threads() (at
  // most 4 per thread, sizes differing by at most one; a single fn(0, n) when n < 2 * grain or
  // num_threads() == 1), never on timing; n <= 0 calls nothing. Calls from several threads take
  // turns.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs chunks of the current job until none is left.
  void RunChunks(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks);

  // Constant after construction.
  const int num_threads_;
  std::vector<std::thread> threads_;

  // Held for a whole ParallelFor, so that callers on different threads take turns.
  absl::Mutex call_mu_;

  absl::Mutex mu_;
  absl::CondVar work_cv_;  // Signalled when a job is posted or on shutdown.
  absl::CondVar idle_cv_;  // Signalled when the last active worker leaves a job.
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // Bumped for each posted job.
  // The current job; set only while active_ == 0.
  const std::function<void(int64_t, int64_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t chunks_ ABSL_GUARDED_BY(mu_) = 0;
  int active_ ABSL_GUARDED_BY(mu_) = 0;  // Workers inside the current job.
  // Next unclaimed chunk of the current job; reset only while active_ == 0.
  std::atomic<int64_t> next_chunk_{0};
};

}  // namespace rubato

#endif  // RUBATO_COMMON_THREAD_POOL_H_
