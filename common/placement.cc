#include "common/placement.h"

#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace rubato {

double Placement::imbalance() const {
  if (shard_bytes.empty()) return 0;
  const int64_t total = std::accumulate(shard_bytes.begin(), shard_bytes.end(), int64_t{0});
  if (total == 0) return 0;
  const int64_t max = *std::max_element(shard_bytes.begin(), shard_bytes.end());
  return static_cast<double>(max) * shard_bytes.size() / total;
}

absl::StatusOr<Placement> PlaceTensors(absl::Span<const TensorSize> tensors, int num_shards) {
  if (num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_shards must be >= 1, got ", num_shards));
  }
  absl::flat_hash_set<std::string> names;
  for (const TensorSize& t : tensors) {
    if (t.bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has negative size"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", t.name, "' appears twice"));
    }
  }
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (tensors[a].bytes != tensors[b].bytes) return tensors[a].bytes > tensors[b].bytes;
    return tensors[a].name < tensors[b].name;
  });
  Placement p;
  p.shard_of.assign(tensors.size(), 0);
  p.shard_bytes.assign(num_shards, 0);
  for (size_t i : order) {
    const int shard = static_cast<int>(
        std::min_element(p.shard_bytes.begin(), p.shard_bytes.end()) - p.shard_bytes.begin());
    p.shard_of[i] = shard;
    p.shard_bytes[shard] += tensors[i].bytes;
  }
  return p;
}

}  // namespace rubato
