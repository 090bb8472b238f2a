#include "common/cluster_spec.h"

#include <fstream>

#include "gtest/gtest.h"

namespace rubato {
namespace {

ClusterSpec Good() {
  ClusterSpec s;
  s.add_servers("127.0.0.1:5000");
  s.set_num_workers(2);
  FillClusterSpecDefaults(&s);
  return s;
}

TEST(ConsistencyTest, ParsesAndFormatsEveryMode) {
  for (const char* text : {"bsp", "async", "backup:1", "ssp:3", "ssp:0", "allreduce",
                           "allreduce:majority", "allreduce:solo", "adaptive", "adaptive:5"}) {
    auto c = ParseConsistency(text);
    ASSERT_TRUE(c.ok()) << text << ": " << c.status();
    EXPECT_EQ(FormatConsistency(*c), text);
  }
  EXPECT_EQ(ParseConsistency("ssp:4")->staleness(), 4);
  EXPECT_EQ(ParseConsistency("backup:2")->backup_workers(), 2);
  EXPECT_EQ(ParseConsistency("allreduce:majority")->allreduce_quorum(), QUORUM_MAJORITY);
  EXPECT_EQ(ParseConsistency("adaptive")->adaptive_every_steps(), kDefaultAdaptiveEverySteps);
  EXPECT_EQ(ParseConsistency("adaptive:5")->adaptive_every_steps(), 5);
  EXPECT_EQ(FormatConsistency(*ParseConsistency("adaptive:20")), "adaptive");
}

TEST(ConsistencyTest, AdaptivePeriodsAreCheckedAndBelongToAdaptiveOnly) {
  ClusterSpec s = Good();
  s.mutable_consistency()->set_mode(ADAPTIVE);
  FillClusterSpecDefaults(&s);
  EXPECT_EQ(s.consistency().adaptive_every_steps(), kDefaultAdaptiveEverySteps);
  EXPECT_TRUE(ValidateClusterSpec(s, /*need_servers=*/true).ok());
  s.mutable_consistency()->set_adaptive_every_steps(-3);
  absl::Status bad = ValidateClusterSpec(s, /*need_servers=*/true);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("adaptive_every_steps"), std::string::npos) << bad;
  s.mutable_consistency()->set_mode(BSP);
  s.mutable_consistency()->set_adaptive_every_steps(10);
  bad = ValidateClusterSpec(s, /*need_servers=*/true);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("applies to adaptive"), std::string::npos) << bad;
}

TEST(ConsistencyTest, RejectsMalformedModes) {
  for (const char* text :
       {"", "BSP", "ssp", "ssp:", "ssp:-1", "backup:x", "sync", "allreduce:", "allreduce:most",
        "adaptive:", "adaptive:0", "adaptive:-2", "adaptive:x"}) {
    auto c = ParseConsistency(text);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(c.status().message().find("mode"), std::string::npos);
  }
}

TEST(ClusterSpecTest, DefaultsAreFilled) {
  ClusterSpec s = Good();
  EXPECT_EQ(s.consistency().mode(), BSP);
  EXPECT_EQ(s.optimizer().type(), "sgd");
  EXPECT_DOUBLE_EQ(s.optimizer().learning_rate(), kDefaultLearningRate);
  EXPECT_EQ(s.lease_ms(), kDefaultLeaseMs);
  EXPECT_TRUE(ValidateClusterSpec(s, /*need_servers=*/true).ok());
}

void ExpectFieldError(const ClusterSpec& s, const std::string& field, bool need_servers = true) {
  absl::Status status = ValidateClusterSpec(s, need_servers);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_NE(status.message().find(field), std::string::npos) << status;
}

TEST(ClusterSpecTest, EachBadFieldIsNamed) {
  ClusterSpec s = Good();
  s.clear_servers();
  ExpectFieldError(s, "servers");
  EXPECT_TRUE(ValidateClusterSpec(s, /*need_servers=*/false).ok());

  s = Good();
  s.set_servers(0, "localhost");
  ExpectFieldError(s, "servers[0]");
  s.set_servers(0, "localhost:99999");
  ExpectFieldError(s, "servers[0]");

  s = Good();
  s.set_num_workers(0);
  ExpectFieldError(s, "num_workers");

  s = Good();
  s.mutable_consistency()->set_mode(BACKUP);
  s.mutable_consistency()->set_backup_workers(2);
  ExpectFieldError(s, "backup_workers");

  s = Good();
  s.mutable_consistency()->set_allreduce_quorum(QUORUM_SOLO);
  ExpectFieldError(s, "allreduce_quorum applies to allreduce, not bsp");

  s = Good();
  s.mutable_optimizer()->set_learning_rate(-0.1);
  ExpectFieldError(s, "optimizer.learning_rate");

  s = Good();
  s.set_wait_timeout_ms(-5);
  ExpectFieldError(s, "wait_timeout_ms");

  // Work reassignment: async only (bsp, backup and ssp are refused saying why), units >= 1.
  s = Good();
  s.mutable_reassign()->set_unit_batches(4);
  ExpectFieldError(s, "reassign needs the async consistency mode");
  s.mutable_consistency()->set_mode(ASYNC);
  EXPECT_TRUE(ValidateClusterSpec(s, /*need_servers=*/true).ok());
  s.mutable_reassign()->set_unit_batches(-1);
  ExpectFieldError(s, "reassign.unit_batches");
}

TEST(ClusterSpecTest, ReadsTextFormatFiles) {
  const std::string path = ::testing::TempDir() + "/spec.textproto";
  {
    std::ofstream out(path);
    out << "servers: \"127.0.0.1:1\"\nservers: \"127.0.0.1:2\"\nnum_workers: 3\n"
           "consistency { mode: SSP staleness: 2 }\noptimizer { type: \"sgd\" learning_rate: 0.05 "
           "}\n";
  }
  auto s = ReadClusterSpecFile(path);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->servers_size(), 2);
  EXPECT_EQ(s->num_workers(), 3);
  EXPECT_EQ(FormatConsistency(s->consistency()), "ssp:2");
  EXPECT_DOUBLE_EQ(s->optimizer().learning_rate(), 0.05);

  EXPECT_EQ(ReadClusterSpecFile(path + ".missing").status().code(), absl::StatusCode::kNotFound);

  const std::string bad = ::testing::TempDir() + "/bad.textproto";
  {
    std::ofstream out(bad);
    out << "num_workers: 2\nnum_wrokers: 3\n";
  }
  auto b = ReadClusterSpecFile(bad);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("line 2"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("num_wrokers"), std::string::npos) << b.status();
}

}  // namespace
}  // namespace rubato
