#include "worker/work_feed.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "proto/progress.pb.h"

namespace rubato {

namespace {

int64_t UnitsPerEpoch(const UnitBatcher& batcher) {
  const std::vector<int64_t>& units = batcher.units_per_worker();
  return std::max<int64_t>(1, std::accumulate(units.begin(), units.end(), int64_t{0}));
}

// Draws the units a source gives, one after another.
class UnitFeed : public WorkFeed {
 public:
  explicit UnitFeed(UnitBatcher* batcher) : batcher_(batcher) {}

  absl::StatusOr<int> Next(float* x, int32_t* y, std::optional<WorkUnit>* began) final {
    began->reset();
    if (int rows = batcher_->Next(x, y); rows > 0) return rows;
    if (done_) return 0;
    absl::StatusOr<std::optional<WorkUnit>> unit = NextUnit();
    if (!unit.ok()) return unit.status();
    if (!unit->has_value()) {
      done_ = true;
      return 0;
    }
    const WorkUnit& u = **unit;
    if (absl::Status s = batcher_->Begin(u.epoch(), u.owner(), u.index()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("unit ", u.seq(), " handed out: ", s.message()));
    }
    Began(u, UnitsPerEpoch(*batcher_));
    *began = u;
    return batcher_->Next(x, y);
  }

 protected:
  // The next unit, or none when the data is done.
  virtual absl::StatusOr<std::optional<WorkUnit>> NextUnit() = 0;

  UnitBatcher* const batcher_;

 private:
  bool done_ = false;
};

class FromServers final : public UnitFeed {
 public:
  FromServers(PsClient* client, UnitBatcher* batcher, int worker, int64_t epochs)
      : UnitFeed(batcher), client_(client) {
    request_.set_worker_id(worker);
    for (int64_t u : batcher->units_per_worker()) request_.add_units_per_worker(u);
    request_.set_epochs(epochs);
  }

 private:
  absl::StatusOr<std::optional<WorkUnit>> NextUnit() override {
    request_.set_request(request_.request() + 1);
    absl::StatusOr<TakeWorkResponse> r = client_->TakeWork(request_);
    if (!r.ok()) return r.status();
    if (r->done()) return std::optional<WorkUnit>();
    return std::optional<WorkUnit>(r->unit());
  }

  PsClient* const client_;
  TakeWorkRequest request_;
};

class Replayed final : public UnitFeed {
 public:
  Replayed(UnitBatcher* batcher, std::vector<WorkUnit> units)
      : UnitFeed(batcher), units_(std::move(units)) {}

 private:
  absl::StatusOr<std::optional<WorkUnit>> NextUnit() override {
    if (next_ == units_.size()) return std::optional<WorkUnit>();
    return std::optional<WorkUnit>(units_[next_++]);
  }

  const std::vector<WorkUnit> units_;
  size_t next_ = 0;
};

}  // namespace

std::unique_ptr<WorkFeed> ServerWorkFeed(PsClient* client, UnitBatcher* batcher, int worker,
                                         int64_t epochs) {
  return std::make_unique<FromServers>(client, batcher, worker, epochs);
}

absl::StatusOr<std::unique_ptr<WorkFeed>> ReplayWorkFeed(const std::string& path,
                                                         UnitBatcher* batcher, int worker) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--reassign_replay: cannot open ", path));
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // "event".
  std::vector<WorkUnit> units;
  std::set<std::tuple<int64_t, int, int64_t>> seen;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (!absl::StrContains(line, "\"event\":\"unit\"")) continue;
    UnitRecord r;
    const auto parsed = google::protobuf::util::JsonStringToMessage(line, &r, options);
    const std::string where = absl::StrCat(path, ":", n, ": ");
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "not a unit record: ", parsed.ToString()));
    }
    if (r.worker() != worker) continue;
    const std::vector<int64_t>& per = batcher->units_per_worker();
    if (r.owner() < 0 || r.owner() >= static_cast<int>(per.size()) || r.unit() < 0 ||
        r.unit() >= per[r.owner()] || r.epoch() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, "unit ", r.unit(), " of worker ",
                                                     r.owner(),
                                                     "'s share does not exist in this job"));
    }
    if (!seen.emplace(r.epoch(), r.owner(), r.unit()).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, "unit ", r.unit(), " of worker ",
                                                     r.owner(), "'s share of epoch ", r.epoch(),
                                                     " comes twice"));
    }
    WorkUnit u;
    u.set_epoch(r.epoch());
    u.set_owner(r.owner());
    u.set_index(r.unit());
    u.set_seq(r.seq());
    units.push_back(u);
  }
  if (units.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--reassign_replay: ", path, " holds no unit record of worker ", worker));
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const WorkUnit& a, const WorkUnit& b) { return a.seq() < b.seq(); });
  return std::unique_ptr<WorkFeed>(std::make_unique<Replayed>(batcher, std::move(units)));
}

}  // namespace rubato
