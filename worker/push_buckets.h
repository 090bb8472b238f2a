// PushBuckets: how a worker groups the gradients of its backward pass into pushes.
//
// The backward pass hands over each layer's gradients as soon as they are final, last layer
// first, as a range of tensor indices. Pushing every layer alone overlaps the most communication
// with the rest of the backward pass, but each push is a call and a pull of its own: for a model
// of many small layers the calls' fixed costs (thread hand-offs, framing) cost more than the
// overlap saves (with no compute between them, a 1 MB model of 8 tensors moved 0.8 GB/s pushed per
// tensor against 1.8 GB/s in one push). So consecutive layers can be gathered into one push until
// it holds at least `min_bytes` (rubato_worker --push_bucket_kb), as PyTorch's
// DistributedDataParallel gathers gradients into buckets (Li et al., "PyTorch Distributed", VLDB
// 2020); whatever is left when the pass ends goes in a last push. The worker's default is buckets
// of 4 MiB (kDefaultPushBucketKb; DDP's is 25 MB): the demo's 784-256-10 MLP, 0.8 MB in four
// tensors, then goes in one push, and ran 222-228 worker steps/s against 183-217 pushed per layer
// (3 interleaved runs each, same weights); a 784-1024-1024-10 MLP, compute-bound on a CPU, ran as
// fast either way. Layers past 4 MiB still go one by one, overlapped with the rest of the pass.
//
// The first bucket of each pass closes at 1 MiB (kFirstPushBucketBytes) if that is smaller, as
// DDP's does: the last layers' gradients then leave while the rest of the pass computes, instead
// of waiting for a whole bucket. For the CNN (1.8 MB) one 4 MiB bucket held the whole model, one
// push after the backward pass, and hid 0.12 of its communication on a CPU (0.01 on an H200):
// now dense2 and dense1 (1.6 MB) go first and conv2 and conv1 after. The demo's MLP (0.8 MB) is
// still one push.
#ifndef RUBATO_WORKER_PUSH_BUCKETS_H_
#define RUBATO_WORKER_PUSH_BUCKETS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rubato {

// rubato_worker --push_bucket_kb's default (see above).
constexpr int64_t kDefaultPushBucketKb = 4096;
// The first bucket's size in each backward pass, when min_bytes is larger (see above).
constexpr int64_t kFirstPushBucketBytes = int64_t{1} << 20;

class PushBuckets {
 public:
  // A range of tensor indices [first, first + count): one push.
  struct Range {
    size_t first = 0;
    size_t count = 0;
    bool operator==(const Range& o) const { return first == o.first && count == o.count; }
  };

  // `tensor_bytes`: each tensor's size, by index. min_bytes <= 0 pushes every layer alone; the
  // first bucket of a pass closes at min(min_bytes, kFirstPushBucketBytes).
  PushBuckets(std::vector<int64_t> tensor_bytes, int64_t min_bytes);

  // Layer tensors [first, first + count) are ready. Returns the pushes to start now, in order: the
  // bucket, once it holds min_bytes (the pass's first bucket: see above). A layer that is not next
  // to the bucket's tensors (the usual order is last layer first) first closes the bucket so far,
  // so that each push is one range.
  std::vector<Range> Add(size_t first, size_t count);

  // The backward pass is over: the bucket's rest, if any, as one push. The next pass starts with
  // a first bucket again.
  std::vector<Range> Flush();

 private:
  std::vector<Range> Close();

  const std::vector<int64_t> tensor_bytes_;
  const int64_t min_bytes_;
  Range bucket_;
  int64_t bucket_bytes_ = 0;
  bool first_ = true;  // The pass has closed no bucket yet.
};

}  // namespace rubato

#endif  // RUBATO_WORKER_PUSH_BUCKETS_H_
