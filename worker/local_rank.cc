#include "worker/local_rank.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rubato {

absl::StatusOr<LocalRank> FindLocalRank(int flag, int worker_id,
                                        const std::function<const char*(const char*)>& getenv) {
  if (flag < -1) return absl::InvalidArgumentError(absl::StrCat("--local_rank=", flag, " < -1"));
  if (flag >= 0) return LocalRank{flag, "--local_rank"};
  for (const char* name : kLocalRankVariables) {
    const char* value = getenv(name);
    if (value == nullptr || *value == '\0') continue;
    int rank = -1;
    if (!absl::SimpleAtoi(value, &rank) || rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", value, " in the environment is not a rank >= 0"));
    }
    return LocalRank{rank, name};
  }
  return LocalRank{worker_id, "the worker id"};
}

}  // namespace rubato
