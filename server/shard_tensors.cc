#include "server/shard_tensors.h"

#include <algorithm>
#include <utility>

#include "absl/types/span.h"
#include "common/limits.h"
#include "common/tensor_bytes.h"

namespace rubato {

ShardTensors::ShardTensors(int num_workers) {
  auto view = std::make_shared<TensorAggregator::Members>();
  view->member.assign(num_workers, 0);
  member_view_ = std::move(view);
}

void ShardTensors::Adopt(const RegisterRequest& request, const Optimizer& optimizer,
                         int64_t part_elements) {
  const int num_workers = static_cast<int>(member_view_->member.size());
  for (int i = 0; i < request.model_size(); ++i) {
    const TensorSpec& spec = request.model(i);
    std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
    std::vector<float> values(ElementCount(shape));
    BytesToFloats(request.initial_values(i).data(), absl::MakeSpan(values));
    const TensorRole role = optimizer.RoleOf(spec.name(), shape);
    tensors_.push_back(std::make_unique<TensorAggregator>(
        spec.name(), std::move(shape), std::move(values), role, num_workers, part_elements));
    index_[spec.name()] = i;
  }
}

void ShardTensors::Adopt(RestoredTensors restored) {
  tensors_ = std::move(restored.tensors);
  index_ = std::move(restored.index);
}

int64_t ShardTensors::MinVersion() const {
  int64_t v = kMaxStep;
  for (const auto& t : tensors_) v = std::min(v, t->version());
  return tensors_.empty() ? 0 : v;
}

int64_t ShardTensors::MaxVersion() const {
  int64_t v = 0;
  for (const auto& t : tensors_) v = std::max(v, t->version());
  return v;
}

void ShardTensors::PublishMembers(const Membership& members) {
  auto view = std::make_shared<TensorAggregator::Members>();
  view->member = members.member();
  view->count = members.members();
  std::atomic_store(&member_view_, std::shared_ptr<const TensorAggregator::Members>(view));
}

std::optional<double> ShardTensors::ApplyCompleted(const TensorAggregator::Context& ctx,
                                                   Released* released) {
  std::optional<double> rate;
  for (auto& t : tensors_) {
    double lr = 0;
    if (t->ApplyIfComplete(ctx, released, &lr)) rate = lr;
  }
  return rate;
}

bool ShardTensors::Arm(const PullStatePtr& pull, int64_t need) const {
  pull->armed = true;
  bool complete = false;
  for (size_t k = 0; k < pull->tensors().size(); ++k) {
    complete =
        tensors_[pull->tensors()[k]]->Pull(pull->worker(), need, pull, static_cast<int>(k)) ||
        complete;
  }
  return complete;
}

std::vector<PulledTensor> ShardTensors::Answer(PullState& pull) const {
  std::vector<TensorSnapshot> got = pull.TakeSnapshots();
  std::vector<PulledTensor> answer;
  answer.reserve(got.size());
  for (size_t k = 0; k < got.size(); ++k) {
    answer.push_back({&tensors_[pull.tensors()[k]]->name(), std::move(got[k])});
  }
  return answer;
}

absl::Time ShardTensors::ExpireHeld(absl::Time now, absl::Duration max_wait, Released* released) {
  if (now < next_held_check_) return next_held_check_;
  absl::Time earliest = absl::InfiniteFuture();
  const std::shared_ptr<const TensorAggregator::Members> view = std::atomic_load(&member_view_);
  for (auto& t : tensors_) {
    earliest = std::min(
        earliest,
        t->ExpireHeld(now - max_wait, *view, absl::ToInt64Milliseconds(max_wait), released));
  }
  next_held_check_ = std::min(now + absl::Seconds(1), earliest + max_wait);
  return next_held_check_;
}

void ShardTensors::ReleaseHeld(const absl::Status& status, Released* released) {
  for (auto& t : tensors_) t->ReleaseHeld(status, released);
}

}  // namespace rubato
