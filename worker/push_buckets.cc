#include "worker/push_buckets.h"

#include <algorithm>
#include <utility>

namespace rubato {

PushBuckets::PushBuckets(std::vector<int64_t> tensor_bytes, int64_t min_bytes)
    : tensor_bytes_(std::move(tensor_bytes)), min_bytes_(min_bytes) {}

std::vector<PushBuckets::Range> PushBuckets::Add(size_t first, size_t count) {
  std::vector<Range> out;
  if (count == 0) return out;
  const bool before = first + count == bucket_.first;
  const bool after = first == bucket_.first + bucket_.count;
  if (bucket_.count > 0 && !before && !after) {
    // Not adjacent: the bucket so far goes first, so that every push is one range.
    out = Close();
  }
  if (bucket_.count == 0 || before) bucket_.first = first;
  bucket_.count += count;
  for (size_t i = first; i < first + count && i < tensor_bytes_.size(); ++i) {
    bucket_bytes_ += tensor_bytes_[i];
  }
  const int64_t full = first_ ? std::min(min_bytes_, kFirstPushBucketBytes) : min_bytes_;
  if (bucket_bytes_ >= full) {
    for (const Range& r : Close()) out.push_back(r);
  }
  return out;
}

std::vector<PushBuckets::Range> PushBuckets::Flush() {
  std::vector<Range> out = Close();
  first_ = true;
  return out;
}

std::vector<PushBuckets::Range> PushBuckets::Close() {
  std::vector<Range> out;
  first_ = false;
  if (bucket_.count > 0) out.push_back(bucket_);
  bucket_ = Range();
  bucket_bytes_ = 0;
  return out;
}

}  // namespace rubato
