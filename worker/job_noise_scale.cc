#include "worker/job_noise_scale.h"

#include "common/limits.h"
#include "common/progress_writer.h"
#include "proto/progress.pb.h"

namespace rubato {

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
  ProgressRecord r;
  NoiseRecord* noise = r.mutable_noise();
  noise->set_worker(worker);
  noise->set_step(step);
  noise->set_b_small(first.batch_small());
  noise->set_b_big(int64_t{first.batch_small()} * first.workers());
  noise->set_g2(RoundSignificant(g2, 6));
  noise->set_trace(RoundSignificant(trace, 6));
  // A ratio only where |G|^2's estimate is positive (one step's can be <= 0).
  if (g2 > 0) noise->set_b_simple(RoundSignificant(trace / g2, 6));
  noise->set_g2_ema(RoundSignificant(g2_ema, 6));
  noise->set_trace_ema(RoundSignificant(trace_ema, 6));
  if (g2_ema > 0) noise->set_b_simple_ema(RoundSignificant(trace_ema / g2_ema, 6));
  noise->set_steps(first.steps());
  return ProgressLine(r);
}

}  // namespace rubato
