// Tests for ReadIdxImages / ReadIdxLabels on small IDX files written to a temp directory.
#include "worker/data/idx_reader.h"

#include <zlib.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

using Bytes = std::vector<uint8_t>;

void AppendBigEndian32(uint32_t v, Bytes* out) {
  out->push_back(static_cast<uint8_t>(v >> 24));
  out->push_back(static_cast<uint8_t>(v >> 16));
  out->push_back(static_cast<uint8_t>(v >> 8));
  out->push_back(static_cast<uint8_t>(v));
}

// An images file: header (count, rows, cols) then pixel i = (i * 7) % 256.
Bytes ImagesFile(uint32_t count, uint32_t rows, uint32_t cols) {
  Bytes out;
  AppendBigEndian32(kIdxImagesMagic, &out);
  AppendBigEndian32(count, &out);
  AppendBigEndian32(rows, &out);
  AppendBigEndian32(cols, &out);
  for (uint64_t i = 0; i < uint64_t{count} * rows * cols; ++i) out.push_back((i * 7) % 256);
  return out;
}

Bytes LabelsFile(const Bytes& labels) {
  Bytes out;
  AppendBigEndian32(kIdxLabelsMagic, &out);
  AppendBigEndian32(static_cast<uint32_t>(labels.size()), &out);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

Bytes Truncated(Bytes bytes, size_t size) {
  bytes.resize(size);
  return bytes;
}

std::string TempPath(const std::string& name) { return ::testing::TempDir() + "/" + name; }

std::string WriteRaw(const std::string& name, const Bytes& bytes) {
  const std::string path = TempPath(name);
  FILE* f = std::fopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr) << path;
  if (f == nullptr) return path;
  EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
  return path;
}

std::string WriteGzip(const std::string& name, const Bytes& bytes) {
  const std::string path = TempPath(name);
  gzFile f = gzopen(path.c_str(), "wb");
  EXPECT_NE(f, nullptr) << path;
  if (f == nullptr) return path;
  if (!bytes.empty()) {
    EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  EXPECT_EQ(gzclose(f), Z_OK);
  return path;
}

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& path) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(path), std::string::npos) << status;
}

class IdxReaderTest : public ::testing::TestWithParam<bool> {
 protected:
  // Writes `bytes` gzip-compressed or raw, per the test parameter.
  std::string Write(const std::string& name, const Bytes& bytes) {
    return GetParam() ? WriteGzip(name + ".gz", bytes) : WriteRaw(name, bytes);
  }
};

TEST_P(IdxReaderTest, ImagesRoundTrip) {
  const Bytes file = ImagesFile(3, 4, 5);
  const std::string path = Write("images", file);
  absl::StatusOr<IdxImages> images = ReadIdxImages(path);
  ASSERT_TRUE(images.ok()) << images.status();
  EXPECT_EQ(images->count, 3);
  EXPECT_EQ(images->rows, 4);
  EXPECT_EQ(images->cols, 5);
  EXPECT_EQ(images->pixels, Bytes(file.begin() + 16, file.end()));
}

TEST_P(IdxReaderTest, EmptyImagesFile) {
  absl::StatusOr<IdxImages> images = ReadIdxImages(Write("no_images", ImagesFile(0, 28, 28)));
  ASSERT_TRUE(images.ok()) << images.status();
  EXPECT_EQ(images->count, 0);
  EXPECT_TRUE(images->pixels.empty());
}

TEST_P(IdxReaderTest, LabelsRoundTrip) {
  const Bytes labels = {0, 9, 3, 3, 7};
  absl::StatusOr<Bytes> read = ReadIdxLabels(Write("labels", LabelsFile(labels)));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, labels);
}

TEST_P(IdxReaderTest, LargerThanOneReadChunk) {
  // 2.4 MB of pixels: several 1 MiB reads.
  const Bytes file = ImagesFile(3000, 28, 28);
  absl::StatusOr<IdxImages> images = ReadIdxImages(Write("big_images", file));
  ASSERT_TRUE(images.ok()) << images.status();
  EXPECT_EQ(images->pixels.size(), 3000u * 28 * 28);
  EXPECT_EQ(images->pixels, Bytes(file.begin() + 16, file.end()));
}

TEST_P(IdxReaderTest, EmptyFileIsDataLoss) {
  const std::string path = Write("empty", {});
  ExpectError(ReadIdxImages(path).status(), absl::StatusCode::kDataLoss, path);
  ExpectError(ReadIdxLabels(path).status(), absl::StatusCode::kDataLoss, path);
}

TEST_P(IdxReaderTest, TruncatedHeaderIsDataLoss) {
  const std::string path = Write("short_header", Truncated(ImagesFile(2, 3, 3), 10));
  const absl::Status status = ReadIdxImages(path).status();
  ExpectError(status, absl::StatusCode::kDataLoss, path);
  EXPECT_NE(status.message().find("expected 16 bytes, got 10"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, TruncatedPayloadIsDataLoss) {
  // Header promises 16 + 2*3*3 = 34 bytes; the file has 30.
  const std::string path = Write("short_images", Truncated(ImagesFile(2, 3, 3), 30));
  const absl::Status status = ReadIdxImages(path).status();
  ExpectError(status, absl::StatusCode::kDataLoss, path);
  EXPECT_NE(status.message().find("expected 34 bytes"), std::string::npos) << status;
  EXPECT_NE(status.message().find("got 30"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, TruncatedLabelsIsDataLoss) {
  const std::string path = Write("short_labels", Truncated(LabelsFile({1, 2, 3, 4}), 10));
  const absl::Status status = ReadIdxLabels(path).status();
  ExpectError(status, absl::StatusCode::kDataLoss, path);
  EXPECT_NE(status.message().find("expected 12 bytes"), std::string::npos) << status;
  EXPECT_NE(status.message().find("got 10"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, TrailingBytesAreDataLoss) {
  Bytes file = LabelsFile({1, 2, 3});
  file.push_back(0);
  file.push_back(0);
  const std::string path = Write("long_labels", file);
  const absl::Status status = ReadIdxLabels(path).status();
  ExpectError(status, absl::StatusCode::kDataLoss, path);
  EXPECT_NE(status.message().find("2 trailing bytes"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, WrongMagicIsInvalidArgument) {
  Bytes file = ImagesFile(1, 2, 2);
  file[2] = 0x0d;  // float elements
  const std::string path = Write("float_images", file);
  const absl::Status status = ReadIdxImages(path).status();
  ExpectError(status, absl::StatusCode::kInvalidArgument, path);
  EXPECT_NE(status.message().find("0x00000d03"), std::string::npos) << status;
  EXPECT_NE(status.message().find("0x00000803"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, LabelsFileGivenAsImages) {
  const std::string path = Write("labels_as_images", LabelsFile({1, 2, 3}));
  const absl::Status status = ReadIdxImages(path).status();
  ExpectError(status, absl::StatusCode::kInvalidArgument, path);
  EXPECT_NE(status.message().find("0x00000801"), std::string::npos) << status;
}

TEST_P(IdxReaderTest, ImagesFileGivenAsLabels) {
  const std::string path = Write("images_as_labels", ImagesFile(1, 2, 2));
  ExpectError(ReadIdxLabels(path).status(), absl::StatusCode::kInvalidArgument, path);
}

TEST_P(IdxReaderTest, AbsurdDimensionsAreInvalidArgument) {
  struct Case {
    uint32_t count, rows, cols;
  };
  for (const Case& c : {Case{1, 0, 28}, Case{1, 28, 0}, Case{1, (1 << 16) + 1, 28},
                        Case{(1u << 28) + 1, 28, 28}, Case{0xffffffffu, 1, 1}}) {
    Bytes header;
    AppendBigEndian32(kIdxImagesMagic, &header);
    AppendBigEndian32(c.count, &header);
    AppendBigEndian32(c.rows, &header);
    AppendBigEndian32(c.cols, &header);
    const std::string path =
        Write(absl::StrCat("absurd_", c.count, "_", c.rows, "_", c.cols), header);
    ExpectError(ReadIdxImages(path).status(), absl::StatusCode::kInvalidArgument, path);
  }
}

TEST_P(IdxReaderTest, LargeHeaderOnSmallFileIsDataLossWithoutAllocating) {
  // A plausible but huge header (2^28 images of 64x64) on a tiny file must fail cleanly.
  Bytes file;
  AppendBigEndian32(kIdxImagesMagic, &file);
  AppendBigEndian32(1u << 28, &file);
  AppendBigEndian32(64, &file);
  AppendBigEndian32(64, &file);
  file.resize(file.size() + 100, 1);
  const std::string path = Write("huge_header", file);
  ExpectError(ReadIdxImages(path).status(), absl::StatusCode::kDataLoss, path);
}

INSTANTIATE_TEST_SUITE_P(GzipAndRaw, IdxReaderTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Gzip" : "Raw";
                         });

TEST(IdxReaderFileTest, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.gz");
  ExpectError(ReadIdxImages(path).status(), absl::StatusCode::kNotFound, path);
  ExpectError(ReadIdxLabels(path).status(), absl::StatusCode::kNotFound, path);
}

TEST(IdxReaderFileTest, TruncatedGzipStreamIsDataLoss) {
  // Cut a gzip file mid-stream: zlib returns what it could inflate, then the reader reports loss.
  const std::string full = WriteGzip("cut.gz", ImagesFile(50, 28, 28));
  FILE* f = std::fopen(full.c_str(), "rb");
  ASSERT_NE(f, nullptr);
  Bytes compressed(1 << 20);
  compressed.resize(std::fread(compressed.data(), 1, compressed.size(), f));
  std::fclose(f);
  ASSERT_GT(compressed.size(), 100u);
  const std::string path = WriteRaw("cut_in_half.gz", Truncated(compressed, compressed.size() / 2));
  ExpectError(ReadIdxImages(path).status(), absl::StatusCode::kDataLoss, path);
}

}  // namespace
}  // namespace rubato
