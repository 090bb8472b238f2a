// rubato_worker's straggler-injection flags (--slowdown, --slow_workers, --min_step_ms, the
// random delays, --pause_at_step, --crash_at_step, the straggler patterns and --delay_trace), read
// into the options of worker/straggler_model.h. Defined here, beside the model they configure, so
// that worker_main.cc holds the worker's own flags; the defaults inject nothing.
#ifndef RUBATO_WORKER_STRAGGLER_FLAGS_H_
#define RUBATO_WORKER_STRAGGLER_FLAGS_H_

#include "absl/status/statusor.h"
#include "worker/straggler_model.h"

namespace rubato {

// Worker `worker_id`'s options of a job of `num_workers` from the flags: its --slow_workers
// factor, if listed, in place of --slowdown, and its rows of --delay_trace. InvalidArgument
// naming the flag: a bad --slow_workers entry, an unknown --delay_distribution, a --delay_trace
// that cannot be read or parsed. (The values themselves are checked by StragglerModel::Create.)
absl::StatusOr<StragglerOptions> StragglerOptionsFromFlags(int worker_id, int num_workers);

}  // namespace rubato

#endif  // RUBATO_WORKER_STRAGGLER_FLAGS_H_
