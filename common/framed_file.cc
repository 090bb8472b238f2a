#include "common/framed_file.h"

#include <fcntl.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the header's length is little-endian");

namespace rubato {
namespace {

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
      return absl::UnavailableError(Errno("cannot write", path));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFramedFile(const std::string& path, absl::string_view magic,
                             absl::string_view payload) {
  if (magic.size() != 8) return absl::InvalidArgumentError("the magic must be 8 bytes");
  char header[kHeaderBytes];
  std::memcpy(header, magic.data(), 8);
  const uint64_t length = payload.size();
  std::memcpy(header + 8, &length, 8);
  SHA256(reinterpret_cast<const unsigned char*>(payload.data()), payload.size(),
         reinterpret_cast<unsigned char*>(header + 16));
  const std::string tmp = absl::StrCat(path, ".tmp-", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(Errno("cannot create", tmp));
  absl::Status status = WriteAll(fd, header, sizeof(header), tmp);
  if (status.ok()) status = WriteAll(fd, payload.data(), payload.size(), tmp);
  if (status.ok() && ::fsync(fd) != 0) status = absl::UnavailableError(Errno("cannot fsync", tmp));
  if (::close(fd) != 0 && status.ok()) status = absl::UnavailableError(Errno("cannot close", tmp));
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = absl::UnavailableError(Errno("cannot rename into place at", path));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  // The rename is durable once the directory is.
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFramedFile(const std::string& path, absl::string_view magic) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string message = Errno("cannot open", path);
    return errno == ENOENT ? absl::NotFoundError(message) : absl::UnavailableError(message);
  }
  // Reads exactly `size` bytes into `out`; false at an early end of file (an error in *status).
  absl::Status status;
  auto read_all = [&](char* out, size_t size) {
    while (size > 0) {
      const ssize_t n = ::read(fd, out, size);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) status = absl::UnavailableError(Errno("cannot read", path));
      if (n <= 0) return false;
      out += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::UnavailableError(Errno("cannot stat", path));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char header[kHeaderBytes];
  std::string payload;
  if (size < kHeaderBytes) {
    status = absl::DataLossError(
        absl::StrCat(path, ": truncated (", size, " bytes, less than its header)"));
  } else if (read_all(header, kHeaderBytes)) {
    uint64_t length;
    std::memcpy(&length, header + 8, 8);
    if (std::memcmp(header, magic.data(), 8) != 0) {
      status =
          absl::DataLossError(absl::StrCat(path, ": bad magic (not a Rubato file of this kind)"));
    } else if (length != size - kHeaderBytes) {
      status = absl::DataLossError(absl::StrCat(path, ": truncated or padded (header says ", length,
                                                " bytes of payload, the file has ",
                                                size - kHeaderBytes, ")"));
    } else {
      // Read straight into the payload (the length is bounded by the file's size).
      payload.resize(length);
      if (!read_all(payload.data(), length) && status.ok()) {
        status = absl::DataLossError(absl::StrCat(path, ": shrank while being read"));
      }
    }
  } else if (status.ok()) {
    status = absl::DataLossError(absl::StrCat(path, ": shrank while being read"));
  }
  ::close(fd);
  if (!status.ok()) return status;
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(payload.data()), payload.size(), digest);
  if (std::memcmp(digest, header + 16, SHA256_DIGEST_LENGTH) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch (the file is corrupt)"));
  }
  return payload;
}

}  // namespace rubato
