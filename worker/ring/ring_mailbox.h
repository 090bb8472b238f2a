// Where blocks from the previous rank wait until the ring all-reduce asks for them.
//
// worker/ring/ring_service.h parses each block off the stream from the previous rank
// (worker/ring/ring_codec.h) and Puts it here, still in the transport's buffers; GrpcRingLink::Receive
// (worker/ring/ring_link.h) Takes it by tag, adding or copying it into the destination. The service
// and the link also report failures here, so that a Take waiting for a block that will never come
// fails at once, naming the rank that failed, instead of at its deadline.
#ifndef RUBATO_WORKER_RING_RING_MAILBOX_H_
#define RUBATO_WORKER_RING_RING_MAILBOX_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/ring_allreduce.h"
#include "worker/ring/ring_codec.h"

namespace rubato {

// Blocks delivered to this rank by `from_rank` (its previous neighbour), by tag. Thread-safe.
class RingMailbox {
 public:
  explicit RingMailbox(int from_rank) : from_rank_(from_rank) {}
  RingMailbox(const RingMailbox&) = delete;
  RingMailbox& operator=(const RingMailbox&) = delete;

  int from_rank() const { return from_rank_; }

  // INVALID_ARGUMENT for a sender other than from_rank, a size that is not whole floats, or a
  // repeated tag.
  absl::Status Put(int from, int64_t tag, RingPayload payload);
  // Waits until `deadline` for block `tag`, then adds it to `out` or copies it there, checking in
  // the same pass that every value is finite. Logs a warning every 5 s while it waits, naming the
  // block, the previous rank and when it will give up. DEADLINE_EXCEEDED names the previous rank;
  // UNAVAILABLE if its stream broke before the block came; INVALID_ARGUMENT for a size other than
  // out.size() or a non-finite value (`out` may then hold part of the block).
  absl::Status Take(int64_t tag, absl::Span<float> out, RingLink::Combine combine,
                    absl::Time deadline);

  // Waits until `deadline` for any block to be here, or the stream from the previous rank to end:
  // true then, false at the deadline.
  bool AwaitAny(absl::Time deadline);

  // The service reports the previous rank's stream: opened, or ended other than by the sender
  // closing it (the sender died or cancelled; `why` says how). Take then fails at once for blocks
  // that did not come.
  void StreamOpened();
  void StreamBroke(absl::string_view why);
  // This rank's link to the next rank failed: Take fails at once too (the ring cannot complete),
  // with `error`. Stays until the mailbox is destroyed.
  void Abort(absl::Status error);

 private:
  const int from_rank_;
  absl::Mutex mu_;
  std::map<int64_t, RingPayload> blocks_ ABSL_GUARDED_BY(mu_);
  std::string broken_ ABSL_GUARDED_BY(mu_);  // Non-empty once the stream broke.
  bool opened_ ABSL_GUARDED_BY(mu_) = false;  // The stream from the previous rank opened.
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rubato

#endif  // RUBATO_WORKER_RING_RING_MAILBOX_H_
