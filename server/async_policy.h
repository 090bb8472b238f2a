// AsyncPolicy (async): every gradient is applied alone on arrival and pulls never wait (Dean et
// al. 2012, Downpour SGD).
#ifndef RUBATO_SERVER_ASYNC_POLICY_H_
#define RUBATO_SERVER_ASYNC_POLICY_H_

#include "server/arrival_policy.h"

namespace rubato {

class AsyncPolicy final : public ArrivalPolicy {
 public:
  explicit AsyncPolicy(const ConsistencyConfig& config) : ArrivalPolicy(config) {}
};

}  // namespace rubato

#endif  // RUBATO_SERVER_ASYNC_POLICY_H_
