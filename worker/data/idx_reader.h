// IDX file reading: the big-endian tensor format of MNIST and Fashion-MNIST
// (http://yann.lecun.com/exdb/mnist/), gzip-compressed or raw.
//
// An IDX file is a 4-byte magic (0x00 0x00 <type> <ndims>), ndims big-endian uint32 dimensions,
// then the elements in row-major order. Only unsigned-byte files (type 0x08) of rank 3 (images) and
// rank 1 (labels) are read here.
#ifndef RUBATO_WORKER_DATA_IDX_READER_H_
#define RUBATO_WORKER_DATA_IDX_READER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rubato {

// Magic numbers of the two IDX files that Rubato reads.
inline constexpr uint32_t kIdxImagesMagic = 0x00000803;  // ubyte, 3 dimensions
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // ubyte, 1 dimension

// Limits on header dimensions; anything larger is taken as a corrupt header rather than allocated.
inline constexpr int64_t kIdxMaxImageSide = int64_t{1} << 16;  // rows and cols
inline constexpr int64_t kIdxMaxCount = int64_t{1} << 28;      // images or labels

// A stack of 8-bit grayscale images.
struct IdxImages {
  int64_t count = 0;
  int rows = 0;
  int cols = 0;
  std::vector<uint8_t> pixels;  // (count, rows, cols) row-major, 0..255
};

// Reads an images file (magic 0x00000803), gzip-compressed or raw.
//
// Errors: NotFound if `path` does not exist; InvalidArgument for a wrong magic (e.g. a labels file)
// or absurd dimensions (rows or cols of 0 or above 1<<16, count above 1<<28); DataLoss if the file
// holds fewer bytes than its header promises, holds bytes after the data, or is corrupt gzip.
// Every message names `path`.
absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path);

// Reads a labels file (magic 0x00000801), gzip-compressed or raw: one byte per example.
// Errors as for ReadIdxImages (count above 1<<28 is InvalidArgument).
absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path);

}  // namespace rubato

#endif  // RUBATO_WORKER_DATA_IDX_READER_H_
