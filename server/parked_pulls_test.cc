#include "server/parked_pulls.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

// A pull whose answer lands in *answered (its status) and *count.
PullStatePtr MakePull(int worker, int64_t step, std::vector<int> tensors, absl::Time deadline,
                      absl::Status* answered, int* count) {
  return std::make_shared<PullState>(worker, step, std::move(tensors), deadline,
                                     [answered, count](absl::Status s, std::vector<PulledTensor>) {
                                       *answered = std::move(s);
                                       ++*count;
                                     });
}

TEST(PullStateTest, IsOverOnceEverySlotIsFilledOrItIsEnded) {
  absl::Status status;
  int count = 0;
  PullStatePtr p = MakePull(0, 1, {3, 5}, kT0, &status, &count);
  auto values = std::make_shared<const std::vector<float>>(2, 1.0f);
  EXPECT_FALSE(p->Fill(1, {values, 4}));
  EXPECT_FALSE(p->Over());
  EXPECT_TRUE(p->Fill(0, {values, 4}));
  EXPECT_TRUE(p->Over());
  EXPECT_FALSE(p->End());  // Already over.
  EXPECT_FALSE(p->Fill(0, {values, 5}));
  std::vector<TensorSnapshot> got = p->TakeSnapshots();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].version, 4);
  EXPECT_EQ(count, 0);  // Answering is the caller's.
}

TEST(ParkedPullsTest, ARetryOfOverlappingTensorsSupersedesOnlyTheSameWorkersPull) {
  ParkedPulls parked;
  absl::Status s0, s1, s2;
  int n0 = 0, n1 = 0, n2 = 0;
  parked.Park(MakePull(0, 3, {0, 1}, kT0, &s0, &n0));
  parked.Park(MakePull(1, 3, {0, 1}, kT0, &s1, &n1));
  parked.Park(MakePull(0, 3, {2}, kT0, &s2, &n2));
  absl::Status retry_status;
  int retry_count = 0;
  PullStatePtr retry = MakePull(0, 4, {1}, kT0, &retry_status, &retry_count);
  std::vector<std::function<void()>> answers;
  parked.Supersede(*retry, &answers);
  ASSERT_EQ(answers.size(), 1u);
  for (auto& a : answers) a();
  EXPECT_EQ(n0, 1);
  EXPECT_EQ(s0.code(), absl::StatusCode::kAborted);
  EXPECT_NE(s0.message().find("superseded by its pull for step 4"), std::string::npos) << s0;
  EXPECT_EQ(n1 + n2, 0);
  EXPECT_EQ(parked.Pending(), 2);
}

TEST(ParkedPullsTest, ArmsWhatMayStartAndHandsBackWhatArmingCompleted) {
  ParkedPulls parked;
  absl::Status s;
  int n = 0;
  for (int step = 0; step < 4; ++step) parked.Park(MakePull(step, step, {0}, kT0, &s, &n));
  std::vector<PullStatePtr> ready;
  std::vector<int> armed;
  parked.ArmWhere([](const PullState& p) { return p.step() % 2 == 0; },
                  [&](const PullStatePtr& p) {
                    p->armed = true;
                    armed.push_back(static_cast<int>(p->step()));
                    return p->step() == 0;  // Only step 0 is complete at once.
                  },
                  &ready);
  EXPECT_EQ(armed, (std::vector<int>{0, 2}));
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0]->step(), 0);
  EXPECT_EQ(parked.Pending(), 3);
  // Armed pulls are not armed twice.
  armed.clear();
  parked.ArmWhere([](const PullState&) { return true; },
                  [&](const PullStatePtr& p) {
                    p->armed = true;
                    armed.push_back(static_cast<int>(p->step()));
                    return false;
                  },
                  &ready);
  EXPECT_EQ(armed, (std::vector<int>{1, 3}));
}

TEST(ParkedPullsTest, ExpireEndsThePullsPastTheirDeadlineAndSaysWhenToLookAgain) {
  ParkedPulls parked;
  absl::Status s;
  int n = 0;
  parked.Park(MakePull(0, 0, {0}, kT0 + absl::Seconds(1), &s, &n));
  parked.Park(MakePull(1, 0, {0}, kT0 + absl::Seconds(5), &s, &n));
  parked.Park(MakePull(2, 0, {0}, kT0 + absl::Seconds(3), &s, &n));
  std::vector<std::pair<PullStatePtr, absl::Status>> expired;
  auto why = [](const PullState& p) {
    return absl::DeadlineExceededError(absl::StrCat("worker ", p.worker()));
  };
  EXPECT_EQ(parked.Expire(kT0, why, &expired), kT0 + absl::Seconds(1));
  EXPECT_TRUE(expired.empty());
  EXPECT_EQ(parked.Expire(kT0 + absl::Seconds(3), why, &expired), kT0 + absl::Seconds(5));
  ASSERT_EQ(expired.size(), 2u);
  EXPECT_EQ(expired[0].first->worker(), 0);
  EXPECT_EQ(expired[1].second.message(), "worker 2");
  EXPECT_TRUE(expired[0].first->Over());
  EXPECT_EQ(parked.Pending(), 1);
  std::vector<PullStatePtr> ended;
  parked.EndAll(&ended);
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0]->worker(), 1);
  EXPECT_EQ(parked.Pending(), 0);
  EXPECT_EQ(parked.Expire(kT0 + absl::Hours(1), why, &expired), absl::InfiniteFuture());
}

}  // namespace
}  // namespace rubato
