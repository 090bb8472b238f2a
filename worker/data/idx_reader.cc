// IDX reading through zlib's gz* API, which reads gzip and raw files alike.
#include "worker/data/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

// gzread takes an unsigned int length; read in bounded chunks, and grow the payload as bytes
// arrive so that a truncated file with a large header never allocates what the header promises.
constexpr int64_t kReadChunkBytes = int64_t{1} << 20;
constexpr int64_t kInitialReserveBytes = int64_t{1} << 26;

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};
using GzFilePtr = std::unique_ptr<gzFile_s, GzCloser>;

absl::StatusOr<GzFilePtr> OpenIdx(const std::string& path) {
  errno = 0;
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    const int error = errno;
    if (error == 0) {
      return absl::ResourceExhaustedError(absl::StrCat(path, ": gzopen failed (out of memory)"));
    }
    return absl::ErrnoToStatus(error, absl::StrCat(path, ": cannot open IDX file"));
  }
  return GzFilePtr(file);
}

// Reads up to `n` bytes into `buf`; returns how many were read (fewer only at end of file).
absl::StatusOr<int64_t> ReadUpTo(gzFile file, const std::string& path, uint8_t* buf, int64_t n) {
  int64_t got = 0;
  while (got < n) {
    const unsigned chunk = static_cast<unsigned>(std::min(n - got, kReadChunkBytes));
    const int r = gzread(file, buf + got, chunk);
    if (r < 0) {
      int errnum = Z_OK;
      const char* message = gzerror(file, &errnum);
      if (errnum == Z_ERRNO) {
        return absl::ErrnoToStatus(errno, absl::StrCat(path, ": read failed"));
      }
      return absl::DataLossError(absl::StrCat(path, ": corrupt gzip data: ", message));
    }
    if (r == 0) break;
    got += r;
  }
  return got;
}

// " (gzip stream ends early)" when zlib saw a truncated gzip member, else "".
std::string GzipTruncationNote(gzFile file) {
  int errnum = Z_OK;
  gzerror(file, &errnum);
  return errnum == Z_BUF_ERROR ? " (gzip stream ends early)" : "";
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Reads the magic and the dimensions that `expected_magic` declares (its low byte).
absl::StatusOr<std::vector<int64_t>> ReadHeader(gzFile file, const std::string& path,
                                                uint32_t expected_magic) {
  const int ndims = static_cast<int>(expected_magic & 0xff);
  const int64_t header_bytes = 4 + 4 * int64_t{ndims};
  uint8_t header[4 + 4 * 255];  // magic, then ndims big-endian uint32

  ASSIGN_OR_RETURN(int64_t got, ReadUpTo(file, path, header, 4));
  if (got < 4) {
    return absl::DataLossError(absl::StrCat(path, ": truncated IDX header: expected ", header_bytes,
                                            " bytes, got ", got, GzipTruncationNote(file)));
  }
  const uint32_t magic = BigEndian32(header);
  if (magic != expected_magic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad IDX magic 0x%08x, expected 0x%08x (%s)", path, magic,
                        expected_magic, expected_magic == kIdxImagesMagic ? "images" : "labels"));
  }
  ASSIGN_OR_RETURN(got, ReadUpTo(file, path, header + 4, header_bytes - 4));
  if (got < header_bytes - 4) {
    return absl::DataLossError(absl::StrCat(path, ": truncated IDX header: expected ", header_bytes,
                                            " bytes, got ", 4 + got, GzipTruncationNote(file)));
  }
  std::vector<int64_t> dims(ndims);
  for (int i = 0; i < ndims; ++i) dims[i] = BigEndian32(header + 4 + 4 * i);
  return dims;
}

// Reads exactly `payload_bytes` after a header of `header_bytes`, then insists on end of file.
absl::StatusOr<std::vector<uint8_t>> ReadPayload(gzFile file, const std::string& path,
                                                 int64_t header_bytes, int64_t payload_bytes) {
  std::vector<uint8_t> data;
  data.reserve(static_cast<size_t>(std::min(payload_bytes, kInitialReserveBytes)));
  int64_t got = 0;
  while (got < payload_bytes) {
    const int64_t chunk = std::min(payload_bytes - got, kReadChunkBytes);
    data.resize(static_cast<size_t>(got + chunk));
    ASSIGN_OR_RETURN(const int64_t n, ReadUpTo(file, path, data.data() + got, chunk));
    got += n;
    if (n < chunk) break;
  }
  if (got < payload_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated IDX file: expected ",
                                            header_bytes + payload_bytes, " bytes (", header_bytes,
                                            " header + ", payload_bytes, " data), got ",
                                            header_bytes + got, GzipTruncationNote(file)));
  }

  int64_t trailing = 0;
  uint8_t sink[4096];
  while (true) {
    ASSIGN_OR_RETURN(const int64_t n, ReadUpTo(file, path, sink, sizeof(sink)));
    if (n == 0) break;
    trailing += n;
  }
  if (trailing > 0) {
    return absl::DataLossError(absl::StrCat(
        path, ": IDX file has ", trailing, " trailing bytes: expected ",
        header_bytes + payload_bytes, " bytes, got ", header_bytes + payload_bytes + trailing));
  }
  return data;
}

absl::Status CheckDim(const std::string& path, const char* name, int64_t value, int64_t min,
                      int64_t max) {
  if (value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": implausible IDX ", name, " ", value,
                                                   " (allowed ", min, "..", max, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path) {
  ASSIGN_OR_RETURN(GzFilePtr file, OpenIdx(path));
  ASSIGN_OR_RETURN(const std::vector<int64_t> dims, ReadHeader(file.get(), path, kIdxImagesMagic));
  RETURN_IF_ERROR(CheckDim(path, "image count", dims[0], 0, kIdxMaxCount));
  RETURN_IF_ERROR(CheckDim(path, "rows", dims[1], 1, kIdxMaxImageSide));
  RETURN_IF_ERROR(CheckDim(path, "cols", dims[2], 1, kIdxMaxImageSide));

  IdxImages images;
  images.count = dims[0];
  images.rows = static_cast<int>(dims[1]);
  images.cols = static_cast<int>(dims[2]);
  ASSIGN_OR_RETURN(images.pixels,
                   ReadPayload(file.get(), path, 16, images.count * images.rows * images.cols));
  return images;
}

absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path) {
  ASSIGN_OR_RETURN(GzFilePtr file, OpenIdx(path));
  ASSIGN_OR_RETURN(const std::vector<int64_t> dims, ReadHeader(file.get(), path, kIdxLabelsMagic));
  RETURN_IF_ERROR(CheckDim(path, "label count", dims[0], 0, kIdxMaxCount));
  return ReadPayload(file.get(), path, 8, dims[0]);
}

}  // namespace rubato
