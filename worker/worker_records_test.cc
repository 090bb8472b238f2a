#include "worker/worker_records.h"

#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/progress_writer.h"
#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(WorkerRecordsTest, FingerprintFollowsTheBytesInOrder) {
  EXPECT_EQ(ParamsFingerprint({{1.0f, 2.0f}, {}}), ParamsFingerprint({{1.0f}, {2.0f}}));
  EXPECT_NE(ParamsFingerprint({{1.0f, 2.0f}}), ParamsFingerprint({{2.0f, 1.0f}}));
}

TEST(WorkerRecordsTest, StartRecordSaysTheJob) {
  JobLength job;
  job.global_batch = 128;
  job.steps_per_epoch = 469;
  job.steps = 1407;
  EXPECT_EQ(ProgressLine(StartProgress(1, job, 64, "cnn", 454922, "cpu", true, "bsp", 30000)),
            R"({"event":"start","worker":1,"steps":1407,"steps_per_epoch":469,"batch_size":64,)"
            R"("global_batch":128,"model":"cnn","parameters":454922,"backend":"cpu",)"
            R"("overlap":true,"mode":"bsp","shard_examples":30000})");
}

TEST(WorkerRecordsTest, DoneRecordHasTestFiguresOnlyWhereEvaluated) {
  TrainingResult result;
  result.steps = 10;
  result.computed_steps = 9;
  result.skipped_steps = 1;
  result.wall_seconds = 1.23456;
  result.final_loss = 0.123456789;
  result.test.loss = 0.4;
  result.test.accuracy = 0.876543;
  result.final_batch = 64;
  const std::string evaluated = ProgressLine(DoneProgress(0, result, {{0.0f}}, true));
  EXPECT_NE(evaluated.find(R"("wall_s":1.235,)"), std::string::npos) << evaluated;
  EXPECT_NE(evaluated.find(R"("train_loss":0.12346,)"), std::string::npos) << evaluated;
  EXPECT_NE(evaluated.find(R"("test_accuracy":0.87654)"), std::string::npos) << evaluated;
  EXPECT_EQ(evaluated.find("noise_scale"), std::string::npos) << evaluated;  // NaN: not measured.
  const std::string not_evaluated = ProgressLine(DoneProgress(1, result, {{0.0f}}, false));
  EXPECT_EQ(not_evaluated.find("test_"), std::string::npos) << not_evaluated;
  result.noise_scale = 1234.5678;
  const std::string noise = ProgressLine(DoneProgress(1, result, {}, false));
  const std::string fingerprint =
      absl::StrFormat(R"("params_fnv1a":"%016x",)", ParamsFingerprint({}));
  EXPECT_NE(noise.find(fingerprint), std::string::npos) << noise;
  EXPECT_NE(noise.find(R"("noise_scale":1234.57})"), std::string::npos) << noise;
}

TEST(WorkerRecordsTest, ToolRecordsNameTheModelAndRoundItsFigures) {
  ModelFile about;
  about.set_model("mlp:784-256-10");
  about.set_steps(500);
  about.set_mode("bsp");
  about.set_global_batch(256);
  about.set_optimizer("sgd");
  about.set_test_accuracy(0.8512345);
  EvalResult eval;
  eval.loss = 0.4123456;
  eval.accuracy = 0.85;
  eval.examples = 10000;
  EXPECT_EQ(ProgressLine(EvalModelProgress("m.model", about, "cpu", eval)),
            R"({"event":"eval_model","path":"m.model","model":"mlp:784-256-10","steps":500,)"
            R"("mode":"bsp","backend":"cpu","test_loss":0.41235,"test_accuracy":0.85,)"
            R"("examples":10000,"job_test_accuracy":0.85123})");
  SharpnessResult sharp;
  sharp.loss = 0.25;
  sharp.max_loss = 0.2612345678;
  sharp.sharpness = 4.493827;
  sharp.best_step = 7;
  EXPECT_EQ(ProgressLine(SharpnessProgress("m.model", about, 0.001, 10, 1000, sharp)),
            R"({"event":"sharpness","path":"m.model","model":"mlp:784-256-10",)"
            R"("global_batch":256,"optimizer":"sgd","epsilon":0.001,"steps":10,)"
            R"("examples":1000,"loss":0.25,"max_loss":0.261235,"sharpness":4.4938,)"
            R"("best_step":7})");
}

TEST(JobLengthTest, EpochsOrStepsAndTheEvaluationDefault) {
  const JobLength j = JobLengthOf(64, 4, 60000, /*steps=*/0, /*epochs=*/3);
  EXPECT_EQ(j.global_batch, 256);
  EXPECT_EQ(j.steps_per_epoch, 235);  // ceil(60000 / 256): the last step is short.
  EXPECT_EQ(j.steps, 705);
  EXPECT_EQ(DefaultEvalEvery(j), 117);
  EXPECT_EQ(JobLengthOf(64, 4, 60000, /*steps=*/100, /*epochs=*/3).steps, 100);
  const JobLength tiny = JobLengthOf(64, 4, 10, 0, 2);
  EXPECT_EQ(tiny.steps_per_epoch, 1);
  EXPECT_EQ(tiny.steps, 2);
  EXPECT_EQ(DefaultEvalEvery(tiny), 1);
}

TEST(JobLengthTest, WhoEvaluates) {
  EXPECT_TRUE(WorkerEvaluates(0, BSP, false));
  EXPECT_FALSE(WorkerEvaluates(1, BSP, false));
  EXPECT_TRUE(WorkerEvaluates(1, BSP, true));
  EXPECT_TRUE(WorkerEvaluates(1, ASYNC, false));
  EXPECT_TRUE(WorkerEvaluates(3, BACKUP, false));
}

}  // namespace
}  // namespace rubato
