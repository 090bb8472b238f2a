// Files that are written whole or not at all, and whose damage is detected on reading: shard
// checkpoints (server/checkpoint.h) and exported models (worker/model/model_file.h).
//
// Layout:
//   bytes  0-7   an 8-byte magic naming the kind of file
//   bytes  8-15  the payload's length (uint64, little-endian)
//   bytes 16-47  SHA-256 of the payload
//   bytes 48-    the payload
// Written under a temporary name in the same directory, fsync'd, renamed into place, and the
// directory fsync'd: a reader sees the old file, the new one or none, never part of one.
#ifndef RUBATO_COMMON_FRAMED_FILE_H_
#define RUBATO_COMMON_FRAMED_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rubato {

// `magic` must be 8 bytes. UNAVAILABLE naming the file and the system's reason (e.g. "No space
// left on device") if it cannot be written; the temporary file is then removed and `path` is left
// as it was.
absl::Status WriteFramedFile(const std::string& path, absl::string_view magic,
                             absl::string_view payload);

// The payload. DATA_LOSS naming the file and what is wrong (another kind of file or none of ours,
// truncated, a checksum mismatch); NOT_FOUND or UNAVAILABLE for a file that cannot be read.
absl::StatusOr<std::string> ReadFramedFile(const std::string& path, absl::string_view magic);

}  // namespace rubato

#endif  // RUBATO_COMMON_FRAMED_FILE_H_
