#include "worker/job_noise_scale.h"

#include "absl/strings/str_format.h"
#include "common/limits.h"

namespace rubato {
namespace {

// trace / g2 as JSON: null where |G|^2's estimate is not positive (one step's can be <= 0).
std::string Ratio(double trace, double g2) {
  return g2 > 0 ? absl::StrFormat("%.6g", trace / g2) : "null";
}

}  // namespace

JobNoiseScale::JobNoiseScale(size_t shards) : latest_(shards) {
  for (NoiseScaleStats& s : latest_) s.set_step(-1);
  relay_.set_step(-1);
}

std::string JobNoiseScale::Update(int worker, const std::vector<NoiseScaleStats>& reports) {
  for (const NoiseScaleStats& r : reports) {
    // A report that could not come from a shard of this job is ignored: an unknown shard, a
    // batch or gradient count out of range, or a figure that is not finite.
    const int shard = r.shard_id();
    if (shard < 0 || shard >= static_cast<int>(latest_.size())) continue;
    if (r.batch_small() < 1 || r.batch_small() > kMaxBatchSize || r.workers() < 2 ||
        r.workers() > kMaxWorkers || !std::isfinite(r.g2()) || !std::isfinite(r.trace()) ||
        !std::isfinite(r.g2_ema()) || !std::isfinite(r.trace_ema())) {
      continue;
    }
    if (r.step() > latest_[shard].step()) latest_[shard] = r;
  }
  const int64_t step = latest_.empty() ? -1 : latest_[0].step();
  double g2 = 0, trace = 0, g2_ema = 0, trace_ema = 0;
  for (const NoiseScaleStats& s : latest_) {
    if (s.step() != step) return "";
    g2 += s.g2();
    trace += s.trace();
    g2_ema += s.g2_ema();
    trace_ema += s.trace_ema();
  }
  // Finite reports can still add up past the double range.
  if (step <= measured_step_ || !std::isfinite(g2 + trace + g2_ema + trace_ema)) return "";
  measured_step_ = step;
  if (g2_ema > 0) b_simple_ema_ = trace_ema / g2_ema;
  relay_.set_step(step);
  relay_.set_g2_ema(g2_ema);
  relay_.set_trace_ema(trace_ema);
  const NoiseScaleStats& first = latest_[0];
  return absl::StrFormat(
      "{\"event\":\"noise\",\"worker\":%d,\"step\":%d,\"b_small\":%d,\"b_big\":%d,"
      "\"g2\":%.6g,\"trace\":%.6g,\"b_simple\":%s,\"g2_ema\":%.6g,\"trace_ema\":%.6g,"
      "\"b_simple_ema\":%s,\"steps\":%d}",
      worker, step, first.batch_small(), int64_t{first.batch_small()} * first.workers(), g2, trace,
      Ratio(trace, g2), g2_ema, trace_ema, Ratio(trace_ema, g2_ema), first.steps());
}

}  // namespace rubato
