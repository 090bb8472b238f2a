#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/sha.h>
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

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the header's length is little-endian");

namespace rubato {
namespace {

constexpr char kMagic[8] = {'R', 'B', 'C', 'K', 'P', 'T', '1', '\n'};
constexpr size_t kHeaderBytes = 8 + 8 + SHA256_DIGEST_LENGTH;

std::string Errno(absl::string_view what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

absl::Status WriteAll(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return absl::UnavailableError(Errno("cannot write checkpoint", path));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
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
  char header[kHeaderBytes];
  std::memcpy(header, kMagic, 8);
  const uint64_t length = payload.size();
  std::memcpy(header + 8, &length, 8);
  SHA256(reinterpret_cast<const unsigned char*>(payload.data()), payload.size(),
         reinterpret_cast<unsigned char*>(header + 16));

  const std::string path = CheckpointPath(dir, checkpoint.shard_id(), checkpoint.step());
  const std::string tmp = absl::StrCat(path, ".tmp-", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(Errno("cannot create checkpoint", tmp));
  absl::Status status = WriteAll(fd, header, sizeof(header), tmp);
  if (status.ok()) status = WriteAll(fd, payload.data(), payload.size(), tmp);
  if (status.ok() && ::fsync(fd) != 0) {
    status = absl::UnavailableError(Errno("cannot fsync checkpoint", tmp));
  }
  if (::close(fd) != 0 && status.ok()) {
    status = absl::UnavailableError(Errno("cannot close checkpoint", tmp));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(Errno("cannot rename checkpoint into place at", path));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  // The rename is durable once the directory is.
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  absl::StatusOr<std::vector<CheckpointFile>> files = ListCheckpoints(dir, checkpoint.shard_id());
  if (!files.ok()) return files.status();
  for (size_t i = static_cast<size_t>(keep); i < files->size(); ++i) {
    ::unlink((*files)[i].path.c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardCheckpoint> ReadCheckpoint(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string message = Errno("cannot open checkpoint", path);
    return errno == ENOENT ? absl::NotFoundError(message) : absl::UnavailableError(message);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::UnavailableError(Errno("cannot stat checkpoint", path));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::string bytes;
  absl::Status status;
  if (size < kHeaderBytes) {
    status = absl::DataLossError(
        absl::StrCat(path, ": truncated (", size, " bytes, less than its header)"));
  } else {
    bytes.resize(size);
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::read(fd, bytes.data() + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        status = absl::UnavailableError(Errno("cannot read checkpoint", path));
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a Rubato checkpoint (bad magic)"));
  }
  uint64_t length;
  std::memcpy(&length, bytes.data() + 8, 8);
  if (length != size - kHeaderBytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated or padded (header says ", length,
                                            " bytes of payload, the file has ", size - kHeaderBytes,
                                            ")"));
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data() + kHeaderBytes), length, digest);
  if (std::memcmp(digest, bytes.data() + 16, SHA256_DIGEST_LENGTH) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch (the file is corrupt)"));
  }
  ShardCheckpoint checkpoint;
  if (!checkpoint.ParseFromArray(bytes.data() + kHeaderBytes, static_cast<int>(length))) {
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

}  // namespace rubato
