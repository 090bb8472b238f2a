#include "common/ring_allreduce.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

// Tagged blocks waiting for one rank.
class Mailbox {
 public:
  void Put(int64_t tag, std::vector<float> block) {
    absl::MutexLock lock(&mu_);
    blocks_[tag] = std::move(block);
  }
  absl::Status Take(int64_t tag, absl::Span<float> out, absl::Time deadline, int from) {
    absl::MutexLock lock(&mu_);
    auto has = [&] { return blocks_.count(tag) > 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&has), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("no block ", tag, " from rank ", from));
    }
    const std::vector<float>& block = blocks_[tag];
    if (block.size() != out.size()) {
      return absl::InternalError(absl::StrCat("block ", tag, " has ", block.size(), " elements"));
    }
    std::copy(block.begin(), block.end(), out.begin());
    blocks_.erase(tag);
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  std::map<int64_t, std::vector<float>> blocks_ ABSL_GUARDED_BY(mu_);
};

class InProcessLink : public RingLink {
 public:
  InProcessLink(int rank, std::vector<std::unique_ptr<Mailbox>>* boxes)
      : rank_(rank), boxes_(boxes) {}
  absl::Status Send(int64_t tag, absl::Span<const float> data) override {
    (*boxes_)[(rank_ + 1) % boxes_->size()]->Put(tag, std::vector<float>(data.begin(), data.end()));
    return absl::OkStatus();
  }
  absl::Status Receive(int64_t tag, absl::Span<float> out, absl::Time deadline) override {
    const int size = static_cast<int>(boxes_->size());
    return (*boxes_)[rank_]->Take(tag, out, deadline, (rank_ + size - 1) % size);
  }

 private:
  int rank_;
  std::vector<std::unique_ptr<Mailbox>>* boxes_;
};

// Runs one all-reduce on `size` ranks in threads; returns each rank's result and status.
std::vector<std::vector<float>> RunRing(const std::vector<std::vector<float>>& inputs,
                                        int64_t round, std::vector<absl::Status>* statuses,
                                        int running = -1, int64_t segment = int64_t{1} << 20) {
  const int size = static_cast<int>(inputs.size());
  if (running < 0) running = size;
  std::vector<std::unique_ptr<Mailbox>> boxes;
  for (int r = 0; r < size; ++r) boxes.push_back(std::make_unique<Mailbox>());
  std::vector<std::vector<float>> data = inputs;
  statuses->assign(size, absl::OkStatus());
  std::vector<std::thread> threads;
  for (int r = 0; r < running; ++r) {
    threads.emplace_back([&, r] {
      InProcessLink link(r, &boxes);
      (*statuses)[r] = RingAllReduceMean(r, size, round, &link, absl::MakeSpan(data[r]),
                                         absl::Seconds(2), segment);
    });
  }
  for (auto& t : threads) t.join();
  return data;
}

TEST(RingAllReduceTest, MeanOnEveryRankForManySizesAndLengths) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int size = 1; size <= 5; ++size) {
    for (int64_t n : {0, 1, 2, 5, 7, 100, 1001}) {
      std::vector<std::vector<float>> inputs(size, std::vector<float>(n));
      for (auto& v : inputs) {
        for (float& x : v) x = normal(rng);
      }
      std::vector<absl::Status> statuses;
      const auto out = RunRing(inputs, /*round=*/0, &statuses);
      for (int r = 0; r < size; ++r) {
        ASSERT_TRUE(statuses[r].ok()) << statuses[r];
        EXPECT_EQ(out[r], out[0]) << "rank " << r << " differs; size " << size << ", n " << n;
      }
      for (int64_t i = 0; i < n; ++i) {
        double mean = 0;
        for (const auto& v : inputs) mean += v[i];
        mean /= size;
        EXPECT_NEAR(out[0][i], mean, 1e-6 * (1 + std::fabs(mean))) << "size " << size << " i " << i;
      }
    }
  }
}

TEST(RingAllReduceTest, SegmentedChunksGiveTheSameResult) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int size : {2, 3, 5}) {
    std::vector<std::vector<float>> inputs(size, std::vector<float>(103));
    for (auto& v : inputs) {
      for (float& x : v) x = normal(rng);
    }
    std::vector<absl::Status> statuses;
    const auto whole = RunRing(inputs, 0, &statuses);
    for (int64_t segment : {1, 3, 7, 1000}) {
      const auto parts = RunRing(inputs, 0, &statuses, -1, segment);
      for (int r = 0; r < size; ++r) {
        ASSERT_TRUE(statuses[r].ok()) << statuses[r];
        EXPECT_EQ(parts[r], whole[0]) << "size " << size << " segment " << segment << " rank " << r;
      }
    }
  }
}

TEST(RingAllReduceTest, ExactForSmallIntegers) {
  // Sums of small integers are exact in float, so the ring order cannot matter.
  std::vector<std::vector<float>> inputs = {{1, 2, 3}, {4, 5, 6}, {7, 8, 9}, {0, 1, 2}};
  std::vector<absl::Status> statuses;
  const auto out = RunRing(inputs, 3, &statuses);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(out[r], (std::vector<float>{3, 4, 5})) << r;
}

TEST(RingAllReduceTest, AMissingPeerIsADeadlineNamingIt) {
  std::vector<std::vector<float>> inputs(3, std::vector<float>(10, 1.0f));
  std::vector<absl::Status> statuses;
  RunRing(inputs, 0, &statuses, /*running=*/2);  // Rank 2 never joins.
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(statuses[0].message().find("from rank 2"), std::string::npos) << statuses[0];
}

TEST(RingAllReduceTest, RejectsABadRank) {
  std::vector<float> v(3);
  EXPECT_EQ(RingAllReduceMean(3, 3, 0, nullptr, absl::MakeSpan(v), absl::Seconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rubato
