#include "server/checkpoint_writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"
#include "common/log.h"
#include "server/checkpoint.h"

namespace rubato {

CheckpointWriter::CheckpointWriter(
    std::string dir, int keep, std::function<ShardCheckpoint(const CapturedCheckpoint&)> to_proto)
    : dir_(std::move(dir)), keep_(keep), to_proto_(std::move(to_proto)) {
  thread_ = std::thread([this] { Loop(); });
}

CheckpointWriter::~CheckpointWriter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void CheckpointWriter::Submit(std::shared_ptr<const CapturedCheckpoint> capture) {
  absl::MutexLock lock(&mu_);
  if (waiting_ != nullptr && !started_) {
    // The first capture (a fresh job's step 0) is kept over newer ones, even when this thread has
    // not been scheduled since: it is the checkpoint every shard has, that a roll-back can always
    // go back to while it is kept (a newer one each skipped on different shards would not be).
    ++counts_.skipped;
    RUBATO_LOG(WARNING) << "checkpoint of step " << capture->step << " skipped: the first one, of "
                        << "step " << waiting_->step << ", is not written yet";
    return;
  }
  if (waiting_ != nullptr) {
    ++counts_.skipped;
    RUBATO_LOG(WARNING) << "checkpoint of step " << waiting_->step
                        << " skipped: the previous one is still being written and step "
                        << capture->step << " is newer (checkpoints come faster than the disk "
                        << "takes them; raise --checkpoint_every_steps)";
  }
  waiting_ = std::move(capture);
}

bool CheckpointWriter::Idle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ == nullptr && !writing_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

CheckpointWriter::Counts CheckpointWriter::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void CheckpointWriter::Loop() {
  // Below the threads that apply updates: on a busy machine training goes first, and the
  // checkpoint takes the cores' spare time (Linux: nice applies to this thread alone).
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10) != 0) {
    RUBATO_LOG(WARNING) << "cannot lower the checkpoint writer's priority: "
                        << std::strerror(errno);
  }
  for (;;) {
    std::shared_ptr<const CapturedCheckpoint> capture;
    {
      absl::MutexLock lock(&mu_);
      auto work = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return waiting_ != nullptr || stopping_;
      };
      mu_.Await(absl::Condition(&work));
      if (waiting_ == nullptr) return;  // Stopping, and nothing left to write.
      capture = std::move(waiting_);
      writing_ = true;
      started_ = true;
    }
    const absl::Time start = absl::Now();
    const ShardCheckpoint proto = to_proto_(*capture);
    const absl::Status status = WriteCheckpoint(dir_, proto, keep_);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    const int64_t bytes = static_cast<int64_t>(proto.ByteSizeLong());
    capture.reset();  // Lets the next update write the weights in place again.
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (status.ok()) {
      ++counts_.written;
      counts_.last_step = proto.step();
      counts_.last_seconds = seconds;
      counts_.last_bytes = bytes;
      RUBATO_LOG(INFO) << "checkpoint of step " << proto.step() << " written (" << (bytes >> 10)
                       << " KiB in " << static_cast<int64_t>(seconds * 1e3) << " ms)";
    } else {
      ++counts_.failed;
      counts_.last_error = status;
      RUBATO_LOG(ERROR) << "checkpoint of step " << proto.step()
                        << " not written: " << status.message()
                        << " (training goes on; the earlier checkpoints are kept)";
    }
  }
}

}  // namespace rubato
