#include "sim/ring_job.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/ring_allreduce.h"
#include "common/status_macros.h"

namespace rubato {
namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

int64_t Ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The start of an operation that ranks begin on their own at own[r] (kNever: not on its own) and
// that the others join when the previous rank's first block reaches them, `first_block` seconds
// after it started, but not before idle[r].
std::vector<double> ActivatedStarts(const std::vector<double>& own, const std::vector<double>& idle,
                                    double first_block) {
  const int n = static_cast<int>(own.size());
  const int a = static_cast<int>(std::min_element(own.begin(), own.end()) - own.begin());
  std::vector<double> start(n);
  start[a] = own[a];
  // One pass around from the earliest: no rank can be reached before own[a] + first_block.
  for (int i = 1; i < n; ++i) {
    const int r = (a + i) % n;
    start[r] = std::min(own[r], std::max(idle[r], start[(r + n - 1) % n] + first_block));
  }
  return start;
}

class RingRun {
 public:
  explicit RingRun(const RingJobOptions& o) : o_(o), n_(o.workers) {}

  absl::StatusOr<TimingJobResult> Run() {
    const absl::Time real_start = absl::Now();
    result_.workers.resize(n_);
    ready_.assign(n_, 0);
    steps_.assign(n_, 0);
    for (int w = 0; w < n_; ++w) {
      if (!o_.stragglers.empty()) {
        ASSIGN_OR_RETURN(StragglerModel m, StragglerModel::Create(o_.stragglers[w], w));
        models_.push_back(std::move(m));
      }
      ready_[w] = StartStep(w, 0);
    }
    double wall = o_.partial ? RunPartial() : RunSynchronous();
    result_.wall = absl::Seconds(wall);
    result_.events = blocks_;
    result_.real_seconds = absl::ToDoubleSeconds(absl::Now() - real_start);
    return std::move(result_);
  }

 private:
  // Worker w computes its next step from `at` on: when its gradient is ready.
  double StartStep(int w, double at) {
    absl::Duration d = o_.step_time;
    if (!models_.empty()) d += models_[w].DelayFor(steps_[w], o_.step_time);
    result_.workers[w].compute += d;
    return at + absl::ToDoubleSeconds(d);
  }

  // Worker w's gradient, ready at ready_[w], is done with at `end`.
  void Done(int w, double end) {
    TimingJobResult::Worker& r = result_.workers[w];
    r.waiting += absl::Seconds(end - ready_[w]);
    r.finished = absl::Seconds(end);
    ++r.computed_steps;
    ++steps_[w];
  }

  double RunSynchronous() {
    double wall = 0;
    for (int64_t step = 0; step < o_.steps; ++step) {
      const std::vector<double> ends =
          RingAllReduceEnds(ready_, o_.elements, o_.segment_elements, o_.host, &blocks_);
      for (int w = 0; w < n_; ++w) {
        Done(w, ends[w]);
        wall = std::max(wall, ends[w]);
        if (step + 1 < o_.steps) ready_[w] = StartStep(w, ends[w]);
      }
    }
    return wall;
  }

  double RunPartial() {
    const int64_t elements = o_.elements + 1;  // The count rides along.
    const int64_t segment =
        o_.segment_elements > 0 ? o_.segment_elements : DefaultRingSegmentElements(elements, n_);
    const double rate = o_.host.nic_bytes_per_second;
    const double latency = absl::ToDoubleSeconds(o_.host.latency);
    auto first_block = [&](int64_t floats) {
      const int64_t first = std::min(segment, Ceil(floats, n_));
      return (4.0 * first + kRingBlockOverheadBytes) / rate + latency;
    };
    const double round_first = first_block(elements);
    const double poll_first = first_block(1);
    const int64_t goal = o_.steps * n_;
    int64_t carried = 0;
    std::vector<double> comm_free(n_, 0.0), own(n_), start;
    std::vector<bool> reported(n_);
    while (carried < goal) {
      if (o_.quorum <= 1) {
        for (int w = 0; w < n_; ++w) own[w] = std::max(comm_free[w], ready_[w]);
        start = ActivatedStarts(own, comm_free, round_first);
      } else {
        // Polls until one counts a quorum; the round follows it on every rank.
        std::fill(reported.begin(), reported.end(), false);
        for (;;) {
          for (int w = 0; w < n_; ++w)
            own[w] = reported[w] ? kNever : std::max(comm_free[w], ready_[w]);
          const std::vector<double> polled = ActivatedStarts(own, comm_free, poll_first);
          int count = 0;
          for (int w = 0; w < n_; ++w) {
            reported[w] = ready_[w] <= polled[w];
            count += reported[w];
          }
          comm_free = RingAllReduceEnds(polled, 1, 0, o_.host, &blocks_);
          if (count >= o_.quorum) break;
        }
        start = comm_free;
      }
      const std::vector<double> ends =
          RingAllReduceEnds(start, elements, segment, o_.host, &blocks_);
      for (int w = 0; w < n_; ++w) {
        if (ready_[w] <= start[w]) {
          ++carried;
          Done(w, ends[w]);
          ready_[w] = StartStep(w, ends[w]);
        }
      }
      comm_free = ends;
    }
    const double wall = *std::max_element(comm_free.begin(), comm_free.end());
    for (int w = 0; w < n_; ++w) {
      // A gradient pending at the end is dropped; its worker waited for the end. One still being
      // computed is not counted: the worker stops at the end.
      if (ready_[w] <= comm_free[w]) {
        ++result_.dropped_gradients;
        result_.workers[w].waiting += absl::Seconds(comm_free[w] - ready_[w]);
      } else {
        result_.workers[w].compute -= absl::Seconds(ready_[w] - comm_free[w]);
      }
      result_.workers[w].finished = absl::Seconds(comm_free[w]);
    }
    return wall;
  }

  const RingJobOptions& o_;
  const int n_;
  std::vector<StragglerModel> models_;
  std::vector<double> ready_;   // When each worker's current gradient is (or was) ready.
  std::vector<int64_t> steps_;  // Each worker's gradients done with.
  int64_t blocks_ = 0;
  TimingJobResult result_;
};

}  // namespace

absl::Status ValidateRingJobOptions(const RingJobOptions& o) {
  if (o.workers < 1) return absl::InvalidArgumentError("ring job: workers must be >= 1");
  if (o.elements < 1) return absl::InvalidArgumentError("ring job: elements must be >= 1");
  if (o.steps < 1) return absl::InvalidArgumentError("ring job: steps must be >= 1");
  if (o.quorum < 1 || o.quorum > o.workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring job: quorum ", o.quorum, " is not in [1, ", o.workers, "]"));
  }
  if (!o.partial && o.quorum != o.workers) {
    return absl::InvalidArgumentError("ring job: the synchronous ring's quorum is every worker");
  }
  if (o.step_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ring job: step_time must be >= 0");
  }
  if (o.segment_elements < 0) {
    return absl::InvalidArgumentError("ring job: segment_elements must be >= 0");
  }
  if (!o.stragglers.empty() && static_cast<int>(o.stragglers.size()) != o.workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring job: straggler options for ", o.stragglers.size(), " workers, not ", o.workers));
  }
  return ValidateHostSpec(o.host);
}

std::vector<double> RingAllReduceEnds(const std::vector<double>& start, int64_t elements,
                                      int64_t segment_elements, const HostSpec& host,
                                      int64_t* blocks) {
  const int n = static_cast<int>(start.size());
  if (n <= 1) return start;
  if (segment_elements <= 0) segment_elements = DefaultRingSegmentElements(elements, n);
  const int64_t chunk = Ceil(elements, n);
  const int segments = static_cast<int>(std::max<int64_t>(1, Ceil(chunk, segment_elements)));
  // Each segment's time on the wire; the last may be shorter.
  std::vector<double> wire(segments);
  for (int s = 0; s < segments; ++s) {
    const int64_t floats = std::min(segment_elements, chunk - s * segment_elements);
    wire[s] =
        (4.0 * std::max<int64_t>(floats, 0) + kRingBlockOverheadBytes) / host.nic_bytes_per_second;
  }
  const double latency = absl::ToDoubleSeconds(host.latency);
  // arrived[r * segments + s]: when segment s of the previous step reached rank r.
  std::vector<double> arrived(static_cast<size_t>(n) * segments), next(arrived.size());
  std::vector<double> out_free(start);  // When each rank's NIC is free to send.
  const int steps = 2 * (n - 1);
  for (int k = 0; k < steps; ++k) {
    for (int r = 0; r < n; ++r) {
      const int to = r + 1 == n ? 0 : r + 1;
      const double* in = &arrived[static_cast<size_t>(r) * segments];
      double* out = &next[static_cast<size_t>(to) * segments];
      double t = out_free[r];
      for (int s = 0; s < segments; ++s) {
        // Step 0 sends at the rank's start; later steps after the block they pass on arrived.
        if (k > 0) t = std::max(t, in[s]);
        t += wire[s];
        out[s] = t + latency;
      }
      out_free[r] = t;
    }
    arrived.swap(next);
  }
  if (blocks != nullptr) *blocks += static_cast<int64_t>(steps) * n * segments;
  std::vector<double> end(n);
  for (int r = 0; r < n; ++r) {
    const int to = r + 1 == n ? 0 : r + 1;
    const double* mine = &arrived[static_cast<size_t>(r) * segments];
    const double* theirs = &arrived[static_cast<size_t>(to) * segments];
    // The last block received, and the next rank holding every block sent (Flush).
    end[r] = std::max({start[r], *std::max_element(mine, mine + segments),
                       *std::max_element(theirs, theirs + segments)});
  }
  return end;
}

absl::StatusOr<TimingJobResult> RunRingJob(const RingJobOptions& options) {
  RETURN_IF_ERROR(ValidateRingJobOptions(options));
  return RingRun(options).Run();
}

}  // namespace rubato
