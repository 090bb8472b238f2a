// FanOut: one operation of a PsClient, as calls to shards that run at once, each retried as the
// operation says, ending exactly once with the first error (naming its shard) or OK.
//
// Nothing waits on a thread: a call is started through its shard's gate (worker/ps/call_gate.h),
// ends by callback on the channel's thread, and a call to be retried waits out its backoff on the
// client's RetryTimer. `done` runs on the thread that ends the last call (possibly the caller's,
// inside StartFanOut, when a channel answers at once). Synchronous operations are StartFanOut and a
// wait (RunFanOut).
//
// The operation's deadline (now + timeout, on the timer's clock) is every call's deadline, retries
// included: a call that gets through after a retry still has the time left (a bsp pull may wait at
// the barrier). Once one call fails, no call is retried any more, and the operation ends when the
// calls in flight have.
#ifndef RUBATO_WORKER_PS_FAN_OUT_H_
#define RUBATO_WORKER_PS_FAN_OUT_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/ps/call_gate.h"
#include "worker/ps/retry_timer.h"
#include "worker/ps/shard_channel.h"

namespace rubato {

enum class Retry {
  kNever,
  // The calls wait for a shard that is not up yet (ShardChannel::CallOptions::wait_for_ready);
  // running out of time means it could not be reached.
  kWaitForReady,
  // A call that fails because the transport did (UNAVAILABLE, not "shutting down"), or that had
  // no answer at all by its deadline (DEADLINE_EXCEEDED at or after it: a shard stopped, frozen
  // or cut off without a reset; a shard's own timeouts answer well before it), is started again
  // after a backoff (0.1 s doubling to 2 s, per call) until it gets through, for up to the retry
  // timeout from its first failure. Each attempt has the operation's timeout from its start, so
  // an operation with retries may end up to the retry timeout plus one timeout after its start.
  kWhileUnavailable,
};

// Calls to one shard that an operation without gates of its own lets run at once.
inline constexpr int kCallsInFlightPerShard = 2;

// What every operation of a client shares. All must outlive the operations.
struct FanOutContext {
  std::vector<ShardChannel*> channels;  // By shard.
  Timer* timer = nullptr;               // Its clock is the operations' clock.
  absl::Duration retry_timeout = absl::Seconds(30);
};

struct FanOutSpec {
  std::vector<int> shards;  // The shard of each call.
  // Each call's weight at its shard's gate (empty: 1 each).
  std::vector<int64_t> weights;
  // One gate per shard, shared with other operations (empty: gates of this operation's own, of
  // kCallsInFlightPerShard calls).
  std::vector<CallGate*> gates;
  absl::Duration timeout = absl::Seconds(30);
  Retry retry = Retry::kNever;
};

// Starts call `call` on `channel`, which must end it with `done`; called again for a retry.
using StartCall = std::function<void(ShardChannel* channel, int call,
                                     const ShardChannel::CallOptions& options,
                                     ShardChannel::Done done)>;

void StartFanOut(const FanOutContext* context, FanOutSpec spec, StartCall start,
                 std::function<void(absl::Status)> done);

// StartFanOut, then waits for it to end.
absl::Status RunFanOut(const FanOutContext* context, FanOutSpec spec, StartCall start);

// The same call to every shard (call i goes to shard i).
FanOutSpec EveryShard(int shards, absl::Duration timeout, Retry retry);

}  // namespace rubato

#endif  // RUBATO_WORKER_PS_FAN_OUT_H_
