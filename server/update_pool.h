// UpdatePool: a fixed set of threads that run tasks in order of submission. The shard checks and
// applies large pushes' gradients on it, off the transport's threads.
#ifndef RUBATO_SERVER_UPDATE_POOL_H_
#define RUBATO_SERVER_UPDATE_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace rubato {

class UpdatePool {
 public:
  // threads >= 1.
  explicit UpdatePool(int threads);
  // Runs what is queued, then stops.
  ~UpdatePool();
  UpdatePool(const UpdatePool&) = delete;
  UpdatePool& operator=(const UpdatePool&) = delete;

  void Post(std::function<void()> task);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // Last: started once the rest is ready.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_UPDATE_POOL_H_
