#include "common/progress_writer.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(ProgressLineTest, EventFirstThenTheFieldsInOrder) {
  ProgressRecord r;
  RejoinRecord* rejoin = r.mutable_rejoin();
  rejoin->set_worker(1);
  rejoin->set_step(7);
  rejoin->set_resume_step(5);
  rejoin->set_t(2.5);
  EXPECT_EQ(ProgressLine(r), R"({"event":"rejoin","worker":1,"step":7,"resume_step":5,"t":2.5})");
}

// Every field without presence, zero or not, in field-number order; an optional one, when set,
// after them; a map in the order of its keys.
TEST(ProgressLineTest, ZerosPrintedOptionalsOnlyWhenSetInt64AsNumbers) {
  ProgressRecord r;
  StepRecord* step = r.mutable_step();
  step->set_worker(0);
  step->set_step(int64_t{1} << 40);  // Past int32, still a number.
  step->set_t(RoundDecimals(12.34567, 3));
  step->set_loss(RoundDecimals(0.123456789, 5));
  step->set_overlap(true);
  (*step->mutable_push_latency_ms())["dense2"] = 1.5;
  (*step->mutable_push_latency_ms())["conv1"] = 0.25;
  EXPECT_EQ(
      ProgressLine(r),
      R"({"event":"step","worker":0,"step":1099511627776,"epoch":0,"t":12.346,)"
      R"("loss":0.12346,"steps_per_s":0,"compute_ms":0,"comm_ms":0,"pull_ms":0,)"
      R"("push_ms":0,"delay_ms":0,"staleness":0,"dropped":0,"skipped":0,"overlap":true,)"
      R"("push_busy_ms":0,"hidden_fraction":0,"push_latency_ms":{"conv1":0.25,"dense2":1.5}})");
  step->set_grad_norm(0);
  EXPECT_NE(ProgressLine(r).find(R"("push_latency_ms":{"conv1":0.25,"dense2":1.5},"grad_norm":0})"),
            std::string::npos)
      << ProgressLine(r);
}

TEST(ProgressLineTest, ServerStatsInSnakeCaseWithNumbersInsideMessagesAndLists) {
  ProgressRecord r;
  GetStatsResponse* stats = r.mutable_stats();
  stats->set_shard_id(1);
  stats->mutable_consistency()->set_mode(BSP);
  stats->set_min_version(40);
  stats->set_dropped_workers(1);
  stats->add_staleness_histogram(3);
  stats->add_staleness_histogram(-1);
  TensorStats* tensor = stats->add_tensors();
  tensor->set_name("fc0.weight");
  tensor->set_elements(200704);
  tensor->set_version(40);
  stats->mutable_noise_scale()->set_g2_ema(0.5);
  const std::string line = ProgressLine(r);
  EXPECT_EQ(
      line.rfind(R"({"event":"stats","shard_id":1,"consistency":{"mode":"BSP","staleness":0,)", 0),
      0u)
      << line;
  for (const char* part :
       {R"("min_version":40,)", R"("dropped_workers":1,)", R"("staleness_histogram":[3,-1],)",
        R"("tensors":[{"name":"fc0.weight","elements":200704,"version":40}],)",
        R"("noise_scale":{"shard_id":0,"step":0,"g2":0,"trace":0,"g2_ema":0.5,)",
        R"("finished_workers":0,)", R"("batch_plan":[],)", R"("refused_updates":0,)",
        R"("reassigned_units":0,)", R"("consistency_plan":[]})"}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
  }
  EXPECT_EQ(line.find("Version"), std::string::npos) << line;  // No camelCase.
}

TEST(ProgressLineTest, StringsStayStringsEvenWhenTheyHoldDigitsOrQuotes) {
  ProgressRecord r;
  DoneRecord* done = r.mutable_done();
  done->set_steps(3);
  done->set_params_fnv1a("0123456789012345");
  done->set_train_loss(std::nan(""));
  done->set_test_accuracy(0.8);
  EXPECT_EQ(ProgressLine(r),
            R"({"event":"done","worker":0,"steps":3,"computed_steps":0,"skipped_steps":0,)"
            R"("redone_steps":0,"rejoins":0,"wall_s":0,"params_fnv1a":"0123456789012345",)"
            R"("train_loss":"NaN","final_batch":0,"units":0,"reassigned_units":0,)"
            R"("layerwise_steps":0,"test_accuracy":0.8})");

  ProgressRecord eval;
  eval.mutable_eval_model()->set_path(R"(a "quoted" \path","steps":"5)");
  eval.mutable_eval_model()->set_steps(5);
  EXPECT_EQ(ProgressLine(eval).rfind(
                R"({"event":"eval_model","path":"a \"quoted\" \\path\",\"steps\":\"5",)"
                R"("model":"","steps":5,)",
                0),
            0u)
      << ProgressLine(eval);
}

TEST(ProgressLineTest, RecordWithoutKind) {
  EXPECT_EQ(ProgressLine(ProgressRecord()), R"({"event":""})");
}

// What the writer prints, protobuf's JSON parser reads back: each kind's line is its message once
// "event" is ignored, 64-bit integers as numbers included.
TEST(ProgressLineTest, ReadsBackIntoTheKindsMessage) {
  ProgressRecord r;
  NoiseRecord* noise = r.mutable_noise();
  noise->set_worker(0);
  noise->set_step(99);
  noise->set_b_small(16);
  noise->set_b_big(48);
  noise->set_g2(RoundSignificant(1.23456789, 6));
  noise->set_b_simple_ema(RoundSignificant(1234567.0, 6));
  noise->set_steps(100);
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  NoiseRecord back;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(ProgressLine(r), &back, options).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(back, *noise))
      << back.DebugString();
  EXPECT_FALSE(back.has_b_simple());
  EXPECT_EQ(back.b_simple_ema(), 1234570.0);
}

// A stream that counts its flushes.
class CountingBuffer : public std::stringbuf {
 public:
  int syncs = 0;

 protected:
  int sync() override {
    ++syncs;
    return std::stringbuf::sync();
  }
};

TEST(WriteProgressTest, OneLineFlushedUnlessAskedNotTo) {
  CountingBuffer buffer;
  std::ostream out(&buffer);
  ProgressRecord r;
  r.mutable_batch()->set_step(50);
  r.mutable_batch()->set_batch_size(128);
  WriteProgress(out, r, /*flush=*/false);
  EXPECT_EQ(buffer.syncs, 0);
  WriteProgress(out, r);
  EXPECT_EQ(buffer.syncs, 1);
  const std::string line =
      R"({"event":"batch","worker":0,"step":50,"batch_size":128,"global_batch":0,)"
      R"("b_simple":0,"learning_rate":0,"steps":0,"t":0})";
  EXPECT_EQ(buffer.str(), line + "\n" + line + "\n");
}

TEST(RoundTest, AsPrintfRounds) {
  EXPECT_EQ(RoundDecimals(3.14159, 3), 3.142);
  EXPECT_EQ(RoundDecimals(2.5, 0), 2.0);  // printf rounds the binary value half to even.
  EXPECT_EQ(RoundDecimals(-0.0004, 3), 0.0);
  EXPECT_EQ(RoundDecimals(1e20, 2), 1e20);
  EXPECT_EQ(RoundSignificant(123456789, 6), 123457000);
  EXPECT_EQ(RoundSignificant(0.000123456789, 3), 0.000123);
  EXPECT_TRUE(std::isnan(RoundDecimals(std::nan(""), 3)));
  EXPECT_EQ(RoundSignificant(INFINITY, 6), INFINITY);
}

}  // namespace
TEST(CopyStreamToTest, AppendsWhatTheStreamGetsWhileItLivesAndGivesTheStreamBack) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/run-1/outputs";
  const std::string path = dir + "/records.jsonl";
  {
    auto first = CopyStreamTo::Open(&std::cout, path);  // Makes the directory.
    ASSERT_TRUE(first.ok()) << first.status();
  }
  std::ofstream(path) << "{\"event\":\"earlier\"}\n";  // A run before a restart.
  std::ostringstream out;
  out << "before\n";
  {
    auto copy = CopyStreamTo::Open(&out, path);
    ASSERT_TRUE(copy.ok()) << copy.status();
    ProgressRecord r;
    r.mutable_rejoin()->set_worker(1);
    WriteProgress(out, r);
    out << 'x' << std::string(5000, 'y') << '\n';  // One character, then more than a buffer.
  }
  out << "after\n";
  const std::string line = ProgressLine([] {
    ProgressRecord r;
    r.mutable_rejoin()->set_worker(1);
    return r;
  }());
  const std::string copied = line + "\nx" + std::string(5000, 'y') + "\n";
  EXPECT_EQ(out.str(), "before\n" + copied + "after\n");
  std::ifstream in(path);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file, "{\"event\":\"earlier\"}\n" + copied);
}

TEST(CopyStreamToTest, AFileThatCannotBeOpenedIsAnErrorNamingIt) {
  // Its directory would be under a plain file.
  const std::string file = std::string(std::getenv("TEST_TMPDIR")) + "/a-file";
  std::ofstream(file) << "x";
  std::ostringstream out;
  auto copy = CopyStreamTo::Open(&out, file + "/outputs/records.jsonl");
  ASSERT_FALSE(copy.ok());
  EXPECT_NE(copy.status().message().find(file + "/outputs"), std::string::npos) << copy.status();
  out << "still here";
  EXPECT_EQ(out.str(), "still here");
}

}  // namespace rubato
