#include "common/ring_allreduce.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/in_process_ring_link.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

// Runs one all-reduce on `size` ranks in threads; returns each rank's result and status.
std::vector<std::vector<float>> RunRing(const std::vector<std::vector<float>>& inputs,
                                        int64_t round, std::vector<absl::Status>* statuses,
                                        int running = -1, int64_t segment = 0) {
  const int size = static_cast<int>(inputs.size());
  if (running < 0) running = size;
  std::vector<std::unique_ptr<InProcessMailbox>> boxes;
  for (int r = 0; r < size; ++r) boxes.push_back(std::make_unique<InProcessMailbox>());
  std::vector<std::vector<float>> data = inputs;
  statuses->assign(size, absl::OkStatus());
  // Links outlive every thread: a block may point into a finished rank's ledger.
  std::vector<std::unique_ptr<InProcessLink>> links;
  for (int r = 0; r < size; ++r) links.push_back(std::make_unique<InProcessLink>(r, &boxes));
  std::vector<std::thread> threads;
  for (int r = 0; r < running; ++r) {
    threads.emplace_back([&, r] {
      (*statuses)[r] = RingAllReduceMean(r, size, round, links[r].get(), absl::MakeSpan(data[r]),
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

TEST(RingAllReduceTest, ReduceInOrderIsBitIdenticalToTheRing) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int size = 1; size <= 6; ++size) {
    for (int64_t n : {1, 7, 1001}) {
      std::vector<std::vector<float>> inputs(size, std::vector<float>(n));
      for (auto& v : inputs) {
        for (float& x : v) x = normal(rng) * 1000.0f;  // Large values: rounding shows the order.
      }
      std::vector<absl::Status> statuses;
      const auto ring = RunRing(inputs, 0, &statuses);
      std::vector<absl::Span<const float>> spans(inputs.begin(), inputs.end());
      std::vector<float> mean(n), sum(n);
      RingReduceInOrder(spans, RingMeanScale(size), absl::MakeSpan(mean));
      EXPECT_EQ(mean, ring[0]) << "size " << size << ", n " << n;
      RingReduceInOrder(spans, 1.0f, absl::MakeSpan(sum));
      // Some ranks' values among zeros: the sums of those ranks alone, bit for bit.
      if (size > 2) {
        std::vector<std::vector<float>> some = inputs;
        std::fill(some[0].begin(), some[0].end(), 0.0f);
        std::fill(some[size - 2].begin(), some[size - 2].end(), 0.0f);
        std::vector<absl::Span<const float>> some_spans(some.begin(), some.end());
        std::vector<int> holders;
        for (int r = 0; r < size; ++r) {
          if (r != 0 && r != size - 2) holders.push_back(r);
        }
        std::vector<float> dense(n), sparse(n);
        RingReduceInOrder(some_spans, 1.0f, absl::MakeSpan(dense));
        RingReduceInOrder(some_spans, 1.0f, absl::MakeSpan(sparse), holders);
        EXPECT_EQ(sparse, dense) << "size " << size << ", n " << n;
      }
      if (size > 2 && n == 1001) {
        // Another order (rank 0 first for every chunk) rounds differently somewhere in 1,001.
        std::vector<float> naive(n, 0.0f);
        for (const auto& v : inputs) {
          for (int64_t i = 0; i < n; ++i) naive[i] += v[i];
        }
        EXPECT_NE(naive, sum) << "size " << size << ", n " << n;
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

TEST(RingAllReduceTest, BackToBackRoundsThatReuseTheBuffer) {
  // Like training: as soon as a call returns, the rank overwrites its vector with the next
  // gradient. The link reads sent blocks from that vector, so a call must not return before the
  // next rank has them (Flush); otherwise the next rank would read the next round's values.
  constexpr int kRounds = 20;
  for (int size : {2, 3, 4}) {
    const int64_t n = 37;
    auto value = [](int round, int rank, int64_t i) {
      return static_cast<float>(round * 1000 + rank * 100 + i);
    };
    std::vector<std::unique_ptr<InProcessMailbox>> boxes;
    for (int r = 0; r < size; ++r) boxes.push_back(std::make_unique<InProcessMailbox>());
    std::vector<std::unique_ptr<InProcessLink>> links;
    for (int r = 0; r < size; ++r) links.push_back(std::make_unique<InProcessLink>(r, &boxes));
    std::vector<int> wrong(size, 0);
    std::vector<absl::Status> statuses(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> data(n);
        for (int round = 0; round < kRounds; ++round) {
          for (int64_t i = 0; i < n; ++i) data[i] = value(round, r, i);
          statuses[r] = RingAllReduceMean(r, size, round, links[r].get(), absl::MakeSpan(data),
                                          absl::Seconds(5), /*segment_elements=*/4);
          if (!statuses[r].ok()) return;
          for (int64_t i = 0; i < n; ++i) {
            float sum = 0;  // Integers: exact in any order.
            for (int q = 0; q < size; ++q) sum += value(round, q, i);
            if (data[i] != sum / size) ++wrong[r];
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < size; ++r) {
      ASSERT_TRUE(statuses[r].ok()) << statuses[r];
      EXPECT_EQ(wrong[r], 0) << "rank " << r << " of " << size;
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
