// ReadGate: how many request bodies the gRPC layer receives at once, in all and per caller.
//
// gRPC takes in a stream's data as its handler reads it: a Push or Pull whose read has not started
// holds at most the server's stream window (common/grpc_options.h, kServerStreamWindowBytes), while
// one being read gets a window of its whole message. ParameterService starts a call's read only
// through this gate, so what gRPC holds of bodies in flight is at most
// total x the message limit (plus a stream window per waiting call), whoever sends them. A caller
// (a worker, by its token) has at most `per_caller` reads at once, so one that trickles its bodies
// cannot take every read from the others; a freed read goes to the waiting caller with the fewest
// reads going (in turn among equals). Reads end by themselves (the body arrives, or the call is cancelled, at the latest at its
// deadline), so a call that waits here always gets its turn or its cancellation.
//
// Thread-safe. The start functions run outside the gate's lock.
#ifndef RUBATO_SERVER_READ_GATE_H_
#define RUBATO_SERVER_READ_GATE_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace rubato {

class ReadGate {
 public:
  using Start = std::shared_ptr<std::function<void()>>;

  // total, per_caller >= 1.
  ReadGate(int total, int per_caller) : total_(total), per_caller_(per_caller) {}

  // Runs `start` now if a read is free for `caller`, else later, on the thread whose Leave frees
  // one.
  void Enter(int caller, Start start);
  // A read of `caller`'s ended.
  void Leave(int caller);
  // Takes back a waiting `start` (its call was cancelled): true if it was still waiting.
  bool Withdraw(int caller, const std::function<void()>* start);

  // Reads going and calls waiting, for one caller and in all (tests).
  int reading(int caller) const;
  int waiting(int caller) const;
  int reading() const;

 private:
  // Hands the free reads to waiting callers in turn, into *grants.
  void Grant(std::vector<Start>* grants) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int total_;
  const int per_caller_;
  mutable absl::Mutex mu_;
  int reading_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int> reading_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::deque<Start>> waiting_ ABSL_GUARDED_BY(mu_);  // no empty queues
  int last_served_ ABSL_GUARDED_BY(mu_) = -1;  // the caller granted last (round robin)
};

}  // namespace rubato

#endif  // RUBATO_SERVER_READ_GATE_H_
