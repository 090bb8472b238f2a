// PartialAllReduce: the partial collectives of eager-SGD (Li, Ben-Nun, Di Girolamo, Alistarh,
// Hoefler: "Taming Unbalanced Training Workloads in Deep Learning with Partial Collective
// Operations", PPoPP 2020), behind `--mode allreduce:majority` and `allreduce:solo`.
//
// The synchronous ring (common/ring_allreduce.h) waits every step for its slowest rank. Here a
// round of the ring goes on as soon as a quorum of ranks have a gradient ready: at least half of
// them (majority) or any one (solo). The others take part in the round all the same, through this
// class's communication thread, so the ring stays whole, but they contribute only what they had
// ready, possibly nothing. A gradient that misses its round waits, added to any others of its
// rank not yet sent, for the next round its rank takes part in: it is folded in late, never lost.
//
// One round, on every rank's communication thread:
//  1. Activation. solo: a rank with a gradient ready starts the round's all-reduce; a rank with
//     none waits until the previous rank's first block arrives (RingLink::Incoming) and joins.
//     majority (and any quorum > 1): the ranks count who is ready with an all-reduce of one float
//     (a poll), started by any rank whose readiness changed since the last poll (the others join
//     on its first block, as above), until the count reaches the quorum. Every rank sees the same
//     count, so every rank decides the same way, and no rank polls while nothing changes.
//  2. The round: an all-reduce (sum) of each rank's pending gradient sum and, in one more float,
//     how many gradients it holds. Every rank divides the sum by that count (identical sums, since
//     the ring computes each chunk's sum once, so identical means), and applies it (`apply`).
// The job is a number of rounds, or as many as carry a given number of gradients (the examples a
// synchronous job of that many steps applies, so that both train for the same epochs); gradients
// still pending after the last round are reported as dropped. So every gradient a rank computed is
// applied exactly once, in the round that carried it, or counted as dropped, and every rank applies
// the same updates.
//
// The mean is over the gradients a round carried, so a round's update has the scale of one
// gradient whatever its count (eager-SGD divides by the number of ranks, which shrinks the steps
// of rounds with few contributions). A gradient carried late was computed on older weights: its
// staleness (rounds between the weights it was computed on and the round that applied it) is
// what the caller reports.
#ifndef RUBATO_WORKER_RING_PARTIAL_ALLREDUCE_H_
#define RUBATO_WORKER_RING_PARTIAL_ALLREDUCE_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ring_allreduce.h"

namespace rubato {

struct PartialAllReduceOptions {
  int rank = 0;
  int size = 1;
  // Ranks that must have a gradient ready before a round goes on: 1 (solo), (size + 1) / 2
  // (majority) or size (every round waits for all, as the synchronous ring does).
  int quorum = 1;
  // The job ends after `rounds` rounds (model updates), or as soon as its rounds have carried
  // `gradients` gradients, if that is > 0 (the examples of a synchronous job: equal epochs).
  int64_t rounds = 0;
  int64_t gradients = 0;
  int64_t elements = 0;  // A gradient's length.
  // The longest a round may wait for its quorum, and the longest each ring operation may take.
  absl::Duration timeout = absl::Seconds(60);
  // While it has nothing to send, the communication thread checks for this rank's gradient this
  // often between waits for the previous rank's blocks.
  absl::Duration poll = absl::Microseconds(200);
};

// "majority" or "solo" (the quorum for `size` ranks); INVALID_ARGUMENT otherwise.
absl::StatusOr<int> PartialQuorum(int size, const std::string& kind);

class PartialAllReduce {
 public:
  // Called on the communication thread after each round with the mean of the gradients it
  // carried and their number; an error ends the rounds.
  using Apply =
      std::function<absl::Status(int64_t round, absl::Span<const float> mean, int64_t gradients)>;

  // Starts the communication thread, which alone uses `link` (it must outlive this object's Stop
  // or destruction, and so must nothing else use it meanwhile).
  PartialAllReduce(const PartialAllReduceOptions& options, RingLink* link, Apply apply);
  // Stops the thread (see Stop).
  ~PartialAllReduce();
  PartialAllReduce(const PartialAllReduce&) = delete;
  PartialAllReduce& operator=(const PartialAllReduce&) = delete;

  struct Outcome {
    int64_t round = -1;       // The round that carried the gradient; -1: dropped (no rounds left).
    int64_t rounds_done = 0;  // Rounds applied when Contribute returned.
  };
  // Adds `gradient` (options.elements floats, all finite) to this rank's pending sum and waits
  // until a round has carried and applied it, or the rounds are over. Errors: a wrong length
  // (INVALID_ARGUMENT), the ring's failure, DEADLINE_EXCEEDED at `deadline`. One caller at a time.
  absl::StatusOr<Outcome> Contribute(absl::Span<const float> gradient, absl::Time deadline);

  int64_t rounds_done() const;
  // True once the rounds are over (done, failed or stopped).
  bool finished() const;

  struct Counts {
    int64_t contributed = 0;  // Gradients this rank handed to Contribute.
    int64_t sent = 0;         // Of those, carried by a round.
    int64_t dropped = 0;      // Pending when the rounds ended.
    int64_t polls = 0;        // Activation polls (quorum > 1).
  };
  Counts counts() const;

  // Waits until `deadline` for every round to be done (or to fail) and returns how they ended.
  absl::Status Wait(absl::Time deadline);
  // Ends the rounds early: the thread stops at its next wait for activation (within options.poll)
  // or after the ring operation it is in (within options.timeout), and is joined. Idempotent.
  void Stop();

 private:
  void Run();
  absl::Status RunRounds();
  // Activation of `round` (step 1 above).
  absl::Status Activate(int64_t round);
  // True once this rank has a gradient pending, or the previous rank's next block is coming.
  absl::StatusOr<bool> AwaitReadyOrIncoming(absl::Time deadline, bool reported_ready);

  const PartialAllReduceOptions options_;
  RingLink* const link_;
  const Apply apply_;
  int64_t next_tag_ = 0;     // The communication thread's alone.
  std::vector<float> send_;  // Likewise: elements + 1 floats (the count last).
  std::vector<float> poll_;  // One float.

  mutable absl::Mutex mu_;
  std::vector<float> pending_ ABSL_GUARDED_BY(mu_);
  int64_t pending_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t deposits_ ABSL_GUARDED_BY(mu_) = 0;        // Contribute calls so far.
  int64_t carried_ ABSL_GUARDED_BY(mu_) = 0;         // Deposits a round has taken.
  int64_t carried_round_ ABSL_GUARDED_BY(mu_) = -1;  // The round that took the latest of them.
  int64_t rounds_done_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
  int64_t carried_total_ = 0;  // Gradients every round so far carried (the thread's alone).
  std::thread thread_;
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_PARTIAL_ALLREDUCE_H_
