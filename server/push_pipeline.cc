#include "server/push_pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/tensor_bytes.h"
#include "server/request_checks.h"

namespace rubato {
namespace {

// One push on its way through the stages; shared by its tasks, the last of which answers.
class PushOperation : public std::enable_shared_from_this<PushOperation> {
 public:
  PushOperation(PushStages* stages, WirePush request, std::vector<GradientTarget> targets,
                std::shared_ptr<const void> keepalive, PushPipeline::Done done)
      : stages_(stages),
        request_(std::move(request)),
        targets_(std::move(targets)),
        keepalive_(std::move(keepalive)),
        done_(std::move(done)),
        to_check_(static_cast<int>(targets_.size())),
        left_(static_cast<int>(targets_.size())),
        checks_(targets_.size()),
        outcomes_(targets_.size()) {
    size_t bytes = 0;
    for (const WireTensor& g : request_.gradients) bytes += g.data.size();
    on_pool_ = bytes > PushPipeline::kInlinePushBytes;
  }

  // Validate: one task per gradient checks its values; the last to finish admits the push.
  void Start() {
    for (size_t k = 0; k < targets_.size(); ++k) {
      Run([self = shared_from_this(), k] { self->CheckValues(k); });
    }
  }

 private:
  void Run(std::function<void()> task) {
    if (on_pool_) {
      stages_->Post(std::move(task));
    } else {
      task();
    }
  }

  void CheckValues(size_t k) {
    const WireTensor& g = request_.gradients[k];
    absl::Status check = CheckFloatChunks(absl::StrCat("gradient '", g.name, "'"), g.data,
                                          targets_[k].elements, &targets_[k].max_abs);
    {
      absl::MutexLock lock(&mu_);
      checks_[k] = std::move(check);
      if (--to_check_ > 0) return;
    }
    AdmitAndApply();
  }

  // Admit: the first failed check in request order answers; else the shard admits it. Apply:
  // one task per gradient.
  void AdmitAndApply() {
    absl::Status verdict;
    for (const absl::Status& c : checks_) {
      if (!c.ok()) {
        verdict = c;
        break;
      }
    }
    if (verdict.ok()) verdict = stages_->Admit(request_);
    stages_->Count(verdict.ok());
    if (!verdict.ok()) {
      Answer(verdict);
      return;
    }
    for (size_t k = 0; k < targets_.size(); ++k) {
      Run([self = shared_from_this(), k] { self->Apply(k); });
    }
  }

  void Apply(size_t k) {
    std::function<void(absl::Status)> on_added;
    if (keepalive_ != nullptr) {
      on_added = [self = shared_from_this()](absl::Status s) { self->GradientDone(std::move(s)); };
    }
    GradientOutcome& outcome = outcomes_[k];
    stages_->Apply(request_.worker_id, request_.step, targets_[k], &request_.gradients[k].data,
                   keepalive_, std::move(on_added), &outcome);
    if (!outcome.held) GradientDone(outcome.refused);
  }

  void GradientDone(absl::Status status) {
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok() && error_.ok()) error_ = std::move(status);
      if (--left_ > 0) return;
    }
    if (!error_.ok()) {
      Answer(error_);
      return;
    }
    PushResponse response;
    stages_->Annotate(request_.step, &response);
    for (const GradientOutcome& o : outcomes_) {
      switch (o.kind) {
        case GradientOutcome::kAccepted:
          response.set_accepted(response.accepted() + 1);
          response.set_max_staleness(std::max(response.max_staleness(), o.staleness));
          break;
        case GradientOutcome::kDuplicate:
          response.set_duplicates(response.duplicates() + 1);
          break;
        case GradientOutcome::kDropped:
          response.set_dropped(response.dropped() + 1);
          break;
      }
    }
    Answer(std::move(response));
  }

  void Answer(absl::StatusOr<PushResponse> answer) {
    PushPipeline::Done done = std::move(done_);
    done(std::move(answer));
  }

  PushStages* const stages_;
  const WirePush request_;
  std::vector<GradientTarget> targets_;  // max_abs written as checks_ is
  const std::shared_ptr<const void> keepalive_;
  PushPipeline::Done done_;  // Taken by the one task that answers.
  bool on_pool_ = false;

  absl::Mutex mu_;
  int to_check_ ABSL_GUARDED_BY(mu_);
  int left_ ABSL_GUARDED_BY(mu_);
  // Per gradient, each written by its own task before the count that publishes it drops.
  std::vector<absl::Status> checks_;
  std::vector<GradientOutcome> outcomes_;
  absl::Status error_;  // Under mu_ until the last gradient is done.
};

}  // namespace

void PushPipeline::Push(WirePush request, std::shared_ptr<const void> keepalive, Done done) {
  absl::Status status = stages_->CheckState(request);
  absl::StatusOr<std::vector<GradientTarget>> targets;
  if (status.ok()) {
    targets = Resolve(request);
    status = targets.status();
  }
  if (status.ok() && request.gradients.empty()) status = stages_->Admit(request);
  if (!status.ok()) {
    stages_->Count(false);
    done(status);
    return;
  }
  if (request.gradients.empty()) {
    stages_->Count(true);
    done(PushResponse());
    return;
  }
  auto op = std::make_shared<PushOperation>(stages_, std::move(request), std::move(*targets),
                                            std::move(keepalive), std::move(done));
  op->Start();
}

absl::StatusOr<std::vector<GradientTarget>> PushPipeline::Resolve(const WirePush& request) const {
  std::vector<GradientTarget> targets;
  targets.reserve(request.gradients.size());
  absl::flat_hash_set<int> seen;
  for (const WireTensor& g : request.gradients) {
    RETURN_IF_ERROR(CheckTensorName(g.name));  // Before it is echoed in an error.
    auto it = index_->find(g.name);
    if (it == index_->end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown tensor '", Printable(g.name), "' (not on shard ", shard_id_, ")"));
    }
    if (!seen.insert(it->second).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", g.name, "' appears twice in one push"));
    }
    // A part: bsp only, at a part's first element, of that part's size (checked with the values).
    const TensorAggregator& t = *(*tensors_)[it->second];
    GradientTarget target;
    target.tensor = it->second;
    if (g.offset == 0 &&
        (t.parts() < 2 || g.data.size() == static_cast<size_t>(t.elements()) * 4)) {
      target.elements = t.elements();  // The whole gradient (its size is checked with the values).
      targets.push_back(target);
      continue;
    }
    if (t.parts() < 2) {
      return absl::InvalidArgumentError(absl::StrCat("gradient '", g.name, "' at offset ", g.offset,
                                                     ": tensor '", g.name,
                                                     "' is pushed whole (offset 0)"));
    }
    if (g.offset < 0 || g.offset >= t.elements() || g.offset % t.part_elements() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient '", g.name, "' at offset ", g.offset, " does not start a part of '", g.name,
          "' (", t.elements(), " elements in parts of ", t.part_elements(), ")"));
    }
    target.part = static_cast<int>(g.offset / t.part_elements());
    target.elements = t.part_size(target.part);
    targets.push_back(target);
  }
  const TensorAggregator::Context ctx = stages_->Context();
  for (const GradientTarget& target : targets) {
    RETURN_IF_ERROR((*tensors_)[target.tensor]->CheckStep(ctx, request.worker_id, request.step));
  }
  return targets;
}

}  // namespace rubato
