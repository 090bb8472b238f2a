// CheckpointWriter: writes a shard's checkpoints on a thread of its own, so that training stalls
// only for the capture (server/parameter_shard.h CapturedCheckpoint), never for serialization,
// hashing, disk writes or fsync (server/checkpoint.h).
//
// One checkpoint is written at a time and at most one waits: a newer capture replaces a waiting
// older one (counted as skipped and logged), so a slow disk costs checkpoints, not memory; but
// never the first, which every shard of a fresh job then has (step 0) for a roll-back to reach. A write
// that fails (a full disk) is logged as an error naming the file and the reason, and counted;
// training goes on and the earlier checkpoints stay. The writer's thread runs at nice 10, below
// the threads that apply updates, so that on a busy machine it takes the cores' spare time.
#ifndef RUBATO_SERVER_CHECKPOINT_WRITER_H_
#define RUBATO_SERVER_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/checkpoint.pb.h"
#include "server/parameter_shard.h"

namespace rubato {

class CheckpointWriter {
 public:
  struct Counts {
    int64_t written = 0;
    int64_t failed = 0;
    int64_t skipped = 0;      // Replaced by a newer capture before they were written.
    int64_t last_step = -1;   // Of the newest one written.
    double last_seconds = 0;  // Its serialization, hashing and write, fsync included.
    int64_t last_bytes = 0;
    absl::Status last_error;
  };

  // `to_proto` (ParameterShard::CheckpointProto) runs on the writer's thread.
  CheckpointWriter(std::string dir, int keep,
                   std::function<ShardCheckpoint(const CapturedCheckpoint&)> to_proto);
  // Finishes the checkpoint being written and the one waiting, then stops.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Quick: queues the capture (ShardOptions::on_checkpoint).
  void Submit(std::shared_ptr<const CapturedCheckpoint> capture);
  // Waits until nothing is queued or being written, at most `timeout`; false on timeout.
  bool Idle(absl::Duration timeout);
  Counts counts() const;

 private:
  void Loop();

  const std::string dir_;
  const int keep_;
  const std::function<ShardCheckpoint(const CapturedCheckpoint&)> to_proto_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const CapturedCheckpoint> waiting_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;  // The first capture has been taken to write.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // Last: started once the rest is ready.
};

}  // namespace rubato

#endif  // RUBATO_SERVER_CHECKPOINT_WRITER_H_
