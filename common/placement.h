// Placement: which parameter-server shard holds each tensor.
//
// Whole tensors are placed (a shard never holds part of a tensor), so per-tensor norms for LARS and
// LAMB can later be computed on one shard. The rule is greedy longest-processing-time: tensors in
// decreasing size (ties by name) each go to the shard with the fewest bytes so far (ties to the
// lowest shard id). It is deterministic, so every worker computes the same placement independently,
// and its maximum load is at most 4/3 of the optimum (Graham 1969).
#ifndef RUBATO_COMMON_PLACEMENT_H_
#define RUBATO_COMMON_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace rubato {

struct TensorSize {
  std::string name;
  int64_t bytes = 0;
};

struct Placement {
  std::vector<int> shard_of;         // Shard of each input tensor, in input order.
  std::vector<int64_t> shard_bytes;  // Bytes held by each shard.

  // Largest shard's bytes over the mean (1.0 is perfect balance; 0 for an empty model).
  double imbalance() const;
};

// InvalidArgument if num_shards < 1, a size is negative, or two tensors share a name.
absl::StatusOr<Placement> PlaceTensors(absl::Span<const TensorSize> tensors, int num_shards);

}  // namespace rubato

#endif  // RUBATO_COMMON_PLACEMENT_H_
