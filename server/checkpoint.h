// Checkpoint files of a parameter-server shard: written atomically, checksummed, the newest few
// kept, and read back with every kind of damage detected and named.
//
// One file per checkpoint, <dir>/shard-<id>-step-<step as 12 digits>.ckpt, a framed file
// (common/framed_file.h: magic "RBCKPT1\n", length, SHA-256) holding a serialized ShardCheckpoint
// (proto/checkpoint.proto). It is written under a temporary name, fsync'd and renamed into place:
// a reader (or a restarted shard) sees a whole checkpoint or none, and a failed write (a full
// disk) leaves the earlier checkpoints as they were. After each write, all
// but the newest `keep` of the shard's checkpoints are removed.
#ifndef RUBATO_SERVER_CHECKPOINT_H_
#define RUBATO_SERVER_CHECKPOINT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/checkpoint.pb.h"

namespace rubato {

std::string CheckpointPath(const std::string& dir, int shard_id, int64_t step);

struct CheckpointFile {
  std::string path;
  int64_t step = 0;
};

// The shard's checkpoint files in `dir`, newest step first (names only; nothing is read).
// NOT_FOUND if `dir` does not exist.
absl::StatusOr<std::vector<CheckpointFile>> ListCheckpoints(const std::string& dir, int shard_id);

// The step of the shard's newest checkpoint file in `dir` at or before `step` (names only: a
// roll-back names a step, and reading it checks it); -1 if there is none, or no directory.
absl::StatusOr<int64_t> NewestCheckpointStepAtMost(const std::string& dir, int shard_id,
                                                   int64_t step);

// Writes `checkpoint` (its shard_id and step name the file) as above and keeps the newest `keep`
// (>= 1). An error names the file and the system's reason (e.g. "No space left on device"); the
// temporary file is then removed and nothing else changed.
absl::Status WriteCheckpoint(const std::string& dir, const ShardCheckpoint& checkpoint, int keep);

// DATA_LOSS naming what is wrong: not a checkpoint, truncated, a checksum mismatch, a payload that
// does not parse; NOT_FOUND or another error for a file that cannot be read.
absl::StatusOr<ShardCheckpoint> ReadCheckpoint(const std::string& path);

struct LoadedCheckpoint {
  ShardCheckpoint checkpoint;
  std::string path;
  // Newer files that were passed over, each "path: why".
  std::vector<std::string> skipped;
};

// The newest checkpoint of shard `shard_id` in `dir` that reads back whole (with `step`, the one
// at that step), passing over damaged ones; nullopt if there is none (or no directory). A file
// whose contents name another shard or step counts as damaged. DATA_LOSS listing every file and
// why if there are checkpoints but none reads back: starting afresh would silently lose the job.
absl::StatusOr<std::optional<LoadedCheckpoint>> LoadNewestCheckpoint(
    const std::string& dir, int shard_id, std::optional<int64_t> step = std::nullopt);

// Removes the temporary files of the shard's writes that never completed (a process killed while
// writing leaves "<file>.tmp-<pid>"); returns how many. Call it at start, before writing.
absl::StatusOr<int> RemoveStaleTemporaries(const std::string& dir, int shard_id);

// A roll-back the shard agreed to under bsp or backup (ParameterShard::Rollback), recorded as
// <dir>/shard-<id>.rollback (a framed file, magic "RBROLLB\n": the step and the recovery id, 8
// bytes each, little-endian) before the server exits, so that the restarted server restores that
// step as that recovery, whatever else is in the directory.
struct RollbackMarker {
  int64_t step = 0;
  uint64_t recovery_id = 0;
};
std::string RollbackMarkerPath(const std::string& dir, int shard_id);
// Atomic, as WriteCheckpoint.
absl::Status WriteRollbackMarker(const std::string& dir, int shard_id,
                                 const RollbackMarker& marker);
// nullopt when there is none; DATA_LOSS naming the file when it is damaged.
absl::StatusOr<std::optional<RollbackMarker>> ReadRollbackMarker(const std::string& dir,
                                                                 int shard_id);
// After the restore: removes the shard's checkpoints of steps after `step` (those steps were
// abandoned: restoring one later would put the shard ahead of the job again), then the marker.
absl::Status FinishRollback(const std::string& dir, int shard_id, int64_t step);

}  // namespace rubato

#endif  // RUBATO_SERVER_CHECKPOINT_H_
