#include "worker/ps/recovery.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/limits.h"

namespace rubato {

absl::Status CheckRegisterAnswers(const std::vector<RegisterResponse>& responses,
                                  const std::vector<std::string>& addresses) {
  const int shards = static_cast<int>(responses.size());
  for (int s = 0; s < shards; ++s) {
    const RegisterResponse& r = responses[s];
    if (r.num_shards() != shards || r.shard_id() != s) {
      return absl::FailedPreconditionError(absl::StrCat(
          "server at ", addresses[s], " is shard ", r.shard_id(), " of ", r.num_shards(),
          ", but this worker has it as shard ", s, " of ", shards));
    }
    // The worker seeks its data to this step (and may send it back in a Rollback).
    if (r.resume_step() < 0 || r.resume_step() >= kMaxStep) {
      return absl::InternalError(absl::StrCat("server at ", addresses[s], " answered resume_step ",
                                              r.resume_step(), ", not in [0, 2^48)"));
    }
    if (const int64_t part = r.part_elements();
        part != 0 && (part < kMinPartElements || part > kMaxTensorElements)) {
      return absl::InternalError(absl::StrCat("server at ", addresses[s], " answered part_elements ",
                                              part, ", not 0 or in [", kMinPartElements, ", ",
                                              kMaxTensorElements, "]"));
    }
  }
  return absl::OkStatus();
}

std::optional<RollbackPlan> PlanRollback(const std::vector<RegisterResponse>& responses) {
  if (responses.empty()) return std::nullopt;
  const ConsistencyMode mode = responses[0].consistency().mode();
  if (mode != BSP && mode != BACKUP && mode != ADAPTIVE) return std::nullopt;
  int behind = -1;
  bool differ = false;
  for (size_t s = 0; s < responses.size(); ++s) {
    const RegisterResponse& r = responses[s];
    differ |= r.recovery_id() != responses[0].recovery_id();
    if (r.recovery_id() != 0 && (behind < 0 || r.resume_step() < responses[behind].resume_step())) {
      behind = static_cast<int>(s);
    }
  }
  if (!differ || behind < 0) return std::nullopt;
  RollbackPlan plan;
  plan.behind = behind;
  plan.request.set_step(responses[behind].resume_step());
  plan.request.set_recovery_id(responses[behind].recovery_id());
  for (size_t s = 0; s < responses.size(); ++s) {
    if (responses[s].recovery_id() != plan.request.recovery_id()) {
      plan.shards.push_back(static_cast<int>(s));
    }
  }
  return plan;
}

uint64_t RecoveryIdFor(uint64_t from, int64_t step) {
  // splitmix64 of the two.
  uint64_t z = from ^ (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z == 0 ? 1 : z;
}

std::string DescribeSplitStep(const std::vector<RegisterResponse>& responses) {
  if (responses.empty() || responses[0].consistency().mode() != BSP) return "";
  int64_t low = responses[0].min_version(), high = responses[0].max_version();
  for (const RegisterResponse& r : responses) {
    low = std::min(low, r.min_version());
    high = std::max(high, r.max_version());
  }
  if (high <= low) return "";
  return absl::StrCat(
      "step ", low, " is half applied (tensor versions from ", low, " to ", high,
      ": a worker stopped between its pushes to different tensors); this worker computes it on "
      "weights of both versions, so the job is no longer bit-identical to an uninterrupted run");
}

std::string DescribeRecoveries(const std::vector<RegisterResponse>& responses) {
  std::vector<std::string> parts;
  for (size_t s = 0; s < responses.size(); ++s) {
    const RegisterResponse& r = responses[s];
    parts.push_back(absl::StrCat("shard ", s, " at step ", r.resume_step(),
                                 r.recovery_id() == 0
                                     ? std::string(", never restored")
                                     : absl::StrCat(", recovery ", absl::Hex(r.recovery_id()))));
  }
  return absl::StrJoin(parts, "; ");
}

}  // namespace rubato
