#include "server/work_queue.h"

#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TakeWorkRequest Ask(int worker, std::vector<int64_t> units, int64_t epochs) {
  TakeWorkRequest r;
  r.set_worker_id(worker);
  for (int64_t u : units) r.add_units_per_worker(u);
  r.set_epochs(epochs);
  return r;
}

TEST(WorkQueueTest, EachWorkerWorksThroughItsOwnShareFromTheFront) {
  WorkQueue queue(2);
  for (int64_t k = 0; k < 3; ++k) {
    for (int w = 0; w < 2; ++w) {
      absl::StatusOr<TakeWorkResponse> r = queue.Take(Ask(w, {3, 3}, 1));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->done());
      EXPECT_EQ(r->unit().owner(), w);
      EXPECT_EQ(r->unit().index(), k);
      EXPECT_EQ(r->unit().epoch(), 0);
      EXPECT_EQ(r->unit().seq(), 2 * k + w);
    }
  }
  EXPECT_TRUE(queue.Take(Ask(0, {3, 3}, 1))->done());
  EXPECT_EQ(queue.handed_out(), 6);
  EXPECT_EQ(queue.reassigned(), 0);
}

TEST(WorkQueueTest, AWorkerDoneWithItsShareTakesFromTheBackOfTheLargestShare) {
  WorkQueue queue(3);
  const std::vector<int64_t> units = {2, 5, 4};
  ASSERT_EQ(queue.Take(Ask(0, units, 2))->unit().index(), 0);
  ASSERT_EQ(queue.Take(Ask(0, units, 2))->unit().index(), 1);
  // Worker 0's share is done: worker 1's has 5 left, worker 2's 4.
  TakeWorkResponse r = *queue.Take(Ask(0, units, 2));
  EXPECT_EQ(r.unit().owner(), 1);
  EXPECT_EQ(r.unit().index(), 4);
  EXPECT_EQ(r.unit().owner_had(), 5);
  // Now 4 and 4: the tie goes to the lower id.
  r = *queue.Take(Ask(0, units, 2));
  EXPECT_EQ(r.unit().owner(), 1);
  EXPECT_EQ(r.unit().index(), 3);
  r = *queue.Take(Ask(0, units, 2));
  EXPECT_EQ(r.unit().owner(), 2);
  EXPECT_EQ(r.unit().index(), 3);
  // The owner still starts from its front.
  EXPECT_EQ(queue.Take(Ask(1, units, 2))->unit().index(), 0);
  EXPECT_EQ(queue.reassigned(), 3);
}

TEST(WorkQueueTest, TheNextEpochBeginsOnlyWhenTheCurrentOneIsHandedOut) {
  WorkQueue queue(2);
  const std::vector<int64_t> units = {1, 2};
  EXPECT_EQ(queue.Take(Ask(0, units, 2))->unit().epoch(), 0);
  TakeWorkResponse r = *queue.Take(Ask(0, units, 2));  // Takes worker 1's last unit.
  EXPECT_EQ(r.unit().epoch(), 0);
  EXPECT_EQ(r.unit().owner(), 1);
  r = *queue.Take(Ask(1, units, 2));  // Worker 1's own front.
  EXPECT_EQ(r.unit().epoch(), 0);
  EXPECT_EQ(r.unit().index(), 0);
  r = *queue.Take(Ask(1, units, 2));
  EXPECT_EQ(r.unit().epoch(), 1);
  EXPECT_EQ(r.unit().owner(), 1);
}

// Any schedule of slowdowns: workers of random, changing speeds ask in the order their units end;
// every unit of every epoch is handed out exactly once, epochs in order.
TEST(WorkQueueTest, EveryUnitIsHandedOutExactlyOnceUnderAnySchedule) {
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    std::mt19937_64 rng(seed);
    const int n = 1 + static_cast<int>(rng() % 6);
    std::vector<int64_t> units(n);
    int64_t per_epoch = 0;
    for (int64_t& u : units) per_epoch += (u = 1 + static_cast<int64_t>(rng() % 7));
    const int64_t epochs = 1 + static_cast<int64_t>(rng() % 3);
    WorkQueue queue(n);
    // Each worker's time when it next asks; its per-unit time drawn anew for every unit, with some
    // workers up to 20x slower.
    std::multimap<double, int> next;
    for (int w = 0; w < n; ++w) next.emplace(0.0, w);
    std::set<std::tuple<int64_t, int, int64_t>> seen;
    int64_t last_epoch = 0, expected_seq = 0;
    int done = 0;
    while (done < n) {
      auto [t, w] = *next.begin();
      next.erase(next.begin());
      absl::StatusOr<TakeWorkResponse> r = queue.Take(Ask(w, units, epochs));
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->done()) {
        ++done;
        continue;
      }
      const WorkUnit& u = r->unit();
      ASSERT_GE(u.epoch(), last_epoch) << "seed " << seed;
      last_epoch = u.epoch();
      ASSERT_LT(u.index(), units[u.owner()]);
      EXPECT_EQ(u.seq(), expected_seq++);
      EXPECT_TRUE(seen.emplace(u.epoch(), u.owner(), u.index()).second)
          << "seed " << seed << ": unit " << u.index() << " of worker " << u.owner()
          << "'s share of epoch " << u.epoch() << " handed out twice";
      const double slow = (w == 0 && seed % 2 == 0) ? 20.0 : 1.0 + (rng() % 100) / 25.0;
      next.emplace(t + slow, w);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), per_epoch * epochs) << "seed " << seed;
    EXPECT_TRUE(queue.Take(Ask(0, units, epochs))->done());
  }
}

TEST(WorkQueueTest, ARetriedRequestGetsTheSameUnit) {
  WorkQueue queue(1);
  TakeWorkRequest r = Ask(0, {3}, 1);
  r.set_request(1);
  EXPECT_EQ(queue.Take(r)->unit().index(), 0);
  EXPECT_EQ(queue.Take(r)->unit().index(), 0);  // Its answer was lost: asked again.
  r.set_request(2);
  EXPECT_EQ(queue.Take(r)->unit().index(), 1);
  EXPECT_EQ(queue.handed_out(), 2);
}

TEST(WorkQueueTest, BadRequestsAreRefusedNamingTheProblem) {
  WorkQueue queue(2);
  EXPECT_EQ(queue.Take(Ask(2, {1, 1}, 1)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue.Take(Ask(-1, {1, 1}, 1)).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = queue.Take(Ask(0, {1}, 1)).status();
  EXPECT_NE(s.message().find("units_per_worker has 1 entries"), std::string::npos) << s;
  s = queue.Take(Ask(0, {1, 0}, 1)).status();
  EXPECT_NE(s.message().find("units_per_worker[1]"), std::string::npos) << s;
  s = queue.Take(Ask(0, {1, int64_t{1} << 30}, 1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = queue.Take(Ask(0, {1, 1}, 0)).status();
  EXPECT_NE(s.message().find("epochs must be"), std::string::npos) << s;
  // Nothing was fixed by the refused requests; the first good one fixes the layout.
  ASSERT_TRUE(queue.Take(Ask(0, {2, 2}, 1)).ok());
  s = queue.Take(Ask(1, {2, 3}, 1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("job mismatch"), std::string::npos) << s;
  EXPECT_EQ(queue.handed_out(), 1);
}

}  // namespace
}  // namespace rubato
