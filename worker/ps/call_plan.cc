#include "worker/ps/call_plan.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"

namespace rubato {

absl::StatusOr<CallPlan> PlanCalls(const std::vector<TensorSpec>& model, int num_shards,
                                   int64_t max_message_bytes, int64_t target_call_bytes) {
  if (model.empty()) return absl::InvalidArgumentError("the model has no tensors");
  CallPlan plan;
  std::vector<TensorSize> sizes;
  for (const TensorSpec& spec : model) {
    const int64_t elements = ElementCount(spec.shape());
    if (elements < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", spec.name(), "' has invalid shape ", ShapeString(spec.shape())));
    }
    if (elements > kMaxTensorElements) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", spec.name(), "' has ", elements,
                                                     " elements; at most ", kMaxTensorElements));
    }
    sizes.push_back({spec.name(), 4 * elements});
    plan.elements.push_back(elements);
  }
  ASSIGN_OR_RETURN(plan.placement, PlaceTensors(sizes, num_shards));
  // Register sends a shard's initial values in one message; pushes and pulls send at least one
  // whole tensor per message. Both must fit the job's limit.
  for (size_t s = 0; s < plan.placement.shard_bytes.size(); ++s) {
    const int64_t needed = plan.placement.shard_bytes[s] + kMessageOverheadBytes;
    if (needed > max_message_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", s, " holds ", plan.placement.shard_bytes[s],
          " bytes of this model, more than one message may carry (", max_message_bytes >> 20,
          " MiB): give every server and worker --max_message_mb=",
          (needed + (int64_t{1} << 20) - 1) >> 20, " or more"));
    }
  }
  for (int s = 0; s < num_shards; ++s) {
    int64_t bytes = 0;
    bool open = false;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (plan.placement.shard_of[i] != s) continue;
      if (!open || bytes + sizes[i].bytes > target_call_bytes) {
        plan.groups.push_back({s, {}});
        bytes = 0;
        open = true;
      }
      plan.groups.back().tensors.push_back(static_cast<int>(i));
      bytes += sizes[i].bytes;
    }
  }
  return plan;
}

int64_t PushCallBytes(int64_t part_elements, int64_t target_call_bytes) {
  return part_elements > 0 ? std::min(target_call_bytes, 4 * part_elements) : target_call_bytes;
}

std::vector<PushCall> PlanPushCalls(const CallPlan& plan, const std::vector<int>& tensors,
                                    const std::vector<int64_t>& part_elements,
                                    int64_t target_call_bytes) {
  std::map<int, std::vector<int>> by_shard;
  for (int i : tensors) by_shard[plan.placement.shard_of[i]].push_back(i);
  std::vector<PushCall> calls;
  for (auto& [shard, list] : by_shard) {
    std::sort(list.begin(), list.end());
    const int64_t part =
        static_cast<size_t>(shard) < part_elements.size() ? part_elements[shard] : 0;
    const int64_t call_bytes = PushCallBytes(part, target_call_bytes);
    int64_t bytes = 0;
    bool open = false;  // the last call takes more whole tensors
    for (int i : list) {
      const int64_t n = plan.elements[i];
      if (part > 0 && n > part) {
        for (int64_t at = 0; at < n; at += part) {
          calls.push_back({shard, {{i, at, std::min(part, n - at)}}});
        }
        open = false;
        continue;
      }
      if (!open || bytes + 4 * n > call_bytes) {
        calls.push_back({shard, {}});
        bytes = 0;
        open = true;
      }
      calls.back().pieces.push_back({i, 0, n});
      bytes += 4 * n;
    }
  }
  return calls;
}

}  // namespace rubato
