#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/framed_file.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

constexpr absl::string_view kMagic("RBCKPT1\n", 8);
constexpr absl::string_view kRollbackMagic("RBROLLB\n", 8);

std::string Errno(absl::string_view what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

// The step in "shard-<id>-step-<step>.ckpt", or nullopt for any other name.
std::optional<int64_t> StepOf(absl::string_view name, int shard_id) {
  const std::string prefix = absl::StrCat("shard-", shard_id, "-step-");
  if (!absl::StartsWith(name, prefix) || !absl::EndsWith(name, ".ckpt")) return std::nullopt;
  name.remove_prefix(prefix.size());
  name.remove_suffix(5);
  int64_t step = 0;
  if (name.size() != 12 || !absl::SimpleAtoi(name, &step) || step < 0) return std::nullopt;
  return step;
}

}  // namespace

std::string CheckpointPath(const std::string& dir, int shard_id, int64_t step) {
  return absl::StrFormat("%s/shard-%d-step-%012d.ckpt", dir, shard_id, step);
}

absl::StatusOr<std::vector<CheckpointFile>> ListCheckpoints(const std::string& dir, int shard_id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    const std::string message = Errno("cannot list checkpoint directory", dir);
    return errno == ENOENT ? absl::NotFoundError(message) : absl::UnavailableError(message);
  }
  std::vector<CheckpointFile> files;
  while (const dirent* e = ::readdir(d)) {
    if (std::optional<int64_t> step = StepOf(e->d_name, shard_id)) {
      files.push_back({absl::StrCat(dir, "/", e->d_name), *step});
    }
  }
  ::closedir(d);
  std::sort(files.begin(), files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.step > b.step; });
  return files;
}

absl::Status WriteCheckpoint(const std::string& dir, const ShardCheckpoint& checkpoint, int keep) {
  if (keep < 1) return absl::InvalidArgumentError("keep must be >= 1");
  std::string payload;
  if (!checkpoint.SerializeToString(&payload)) {
    return absl::InternalError("checkpoint does not serialize (over 2 GiB?)");
  }
  const std::string path = CheckpointPath(dir, checkpoint.shard_id(), checkpoint.step());
  if (absl::Status s = WriteFramedFile(path, kMagic, payload); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint: ", s.message()));
  }
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, checkpoint.shard_id());
  if (!files.ok()) return files.status();
  for (size_t i = static_cast<size_t>(keep); i < files->size(); ++i) {
    ::unlink((*files)[i].path.c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardCheckpoint> ReadCheckpoint(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string payload, ReadFramedFile(path, kMagic));
  ShardCheckpoint checkpoint;
  if (!checkpoint.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat(path, ": the payload does not parse"));
  }
  return checkpoint;
}

absl::StatusOr<std::optional<LoadedCheckpoint>> LoadNewestCheckpoint(const std::string& dir,
                                                                     int shard_id,
                                                                     std::optional<int64_t> step) {
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, shard_id);
  if (absl::IsNotFound(files.status())) return std::nullopt;
  if (!files.ok()) return files.status();
  LoadedCheckpoint loaded;
  for (const CheckpointFile& f : *files) {
    if (step.has_value() && f.step != *step) continue;
    absl::StatusOr<ShardCheckpoint> c = ReadCheckpoint(f.path);
    if (c.ok() && (c->shard_id() != shard_id || c->step() != f.step)) {
      c = absl::DataLossError(absl::StrCat("it holds shard ", c->shard_id(), " at step ", c->step(),
                                           ", not what its name says"));
    }
    if (!c.ok()) {
      loaded.skipped.push_back(absl::StrCat(f.path, ": ", c.status().message()));
      continue;
    }
    loaded.checkpoint = std::move(*c);
    loaded.path = f.path;
    return loaded;
  }
  if (!loaded.skipped.empty()) {
    // Every candidate was damaged: say so rather than starting from scratch silently.
    return absl::DataLossError(absl::StrCat("no readable checkpoint of shard ", shard_id, " in ",
                                            dir, ": ", absl::StrJoin(loaded.skipped, "; ")));
  }
  return std::nullopt;
}

absl::StatusOr<int64_t> NewestCheckpointStepAtMost(const std::string& dir, int shard_id,
                                                   int64_t step) {
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, shard_id);
  if (absl::IsNotFound(files.status())) return -1;
  if (!files.ok()) return files.status();
  for (const CheckpointFile& f : *files) {  // Newest first.
    if (f.step <= step) return f.step;
  }
  return -1;
}

absl::StatusOr<int> RemoveStaleTemporaries(const std::string& dir, int shard_id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return 0;
    return absl::UnavailableError(Errno("cannot list checkpoint directory", dir));
  }
  std::vector<std::string> stale;
  const std::string checkpoints = absl::StrCat("shard-", shard_id, "-step-");
  const std::string marker = absl::StrCat("shard-", shard_id, ".rollback.tmp-");
  while (const dirent* e = ::readdir(d)) {
    const absl::string_view name(e->d_name);
    if ((absl::StartsWith(name, checkpoints) && absl::StrContains(name, ".ckpt.tmp-")) ||
        absl::StartsWith(name, marker)) {
      stale.push_back(absl::StrCat(dir, "/", name));
    }
  }
  ::closedir(d);
  for (const std::string& path : stale) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return absl::UnavailableError(Errno("cannot remove the unfinished write", path));
    }
  }
  return static_cast<int>(stale.size());
}

std::string RollbackMarkerPath(const std::string& dir, int shard_id) {
  return absl::StrCat(dir, "/shard-", shard_id, ".rollback");
}

absl::Status WriteRollbackMarker(const std::string& dir, int shard_id,
                                 const RollbackMarker& marker) {
  char payload[16];
  std::memcpy(payload, &marker.step, 8);
  std::memcpy(payload + 8, &marker.recovery_id, 8);
  return WriteFramedFile(RollbackMarkerPath(dir, shard_id), kRollbackMagic,
                         absl::string_view(payload, sizeof(payload)));
}

absl::StatusOr<std::optional<RollbackMarker>> ReadRollbackMarker(const std::string& dir,
                                                                 int shard_id) {
  const std::string path = RollbackMarkerPath(dir, shard_id);
  absl::StatusOr<std::string> payload = ReadFramedFile(path, kRollbackMagic);
  if (absl::IsNotFound(payload.status())) return std::nullopt;
  if (!payload.ok()) return payload.status();
  RollbackMarker marker;
  if (payload->size() != 16) {
    return absl::DataLossError(
        absl::StrCat(path, ": a roll-back record of ", payload->size(), " bytes, not 16"));
  }
  std::memcpy(&marker.step, payload->data(), 8);
  std::memcpy(&marker.recovery_id, payload->data() + 8, 8);
  if (marker.step < 0 || marker.recovery_id == 0) {
    return absl::DataLossError(absl::StrCat(path, ": step ", marker.step, ", recovery id ",
                                            marker.recovery_id, " is not a roll-back"));
  }
  return marker;
}

absl::Status FinishRollback(const std::string& dir, int shard_id, int64_t step) {
  ASSIGN_OR_RETURN(const std::vector<CheckpointFile> files, ListCheckpoints(dir, shard_id));
  for (const CheckpointFile& f : files) {
    if (f.step > step && ::unlink(f.path.c_str()) != 0 && errno != ENOENT) {
      return absl::UnavailableError(Errno("cannot remove the abandoned checkpoint", f.path));
    }
  }
  const std::string marker = RollbackMarkerPath(dir, shard_id);
  if (::unlink(marker.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(Errno("cannot remove", marker));
  }
  return absl::OkStatus();
}

}  // namespace rubato
