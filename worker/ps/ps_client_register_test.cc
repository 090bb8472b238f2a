// PsClient::Register over scripted channels: what it waits out and what it gives up on.
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "worker/ps/ps_client.h"
#include "worker/ps/refusing_shard_channel.h"

namespace rubato {
namespace {

// A shard whose first `refusals` Register calls answer UNAVAILABLE "shutting down" (a shard
// exiting to roll back), and later ones register the worker at `resume_step`.
class RestartingShard final : public RefusingShardChannel {
 public:
  RestartingShard(int shard, int shards, int refusals, int64_t resume_step)
      : RefusingShardChannel("scripted:" + std::to_string(shard)),
        shard_(shard),
        shards_(shards),
        refusals_(refusals),
        resume_step_(resume_step) {}

  void Register(const RegisterRequest&, RegisterResponse* response, const CallOptions&,
                Done d) override {
    {
      absl::MutexLock lock(&mu_);
      if (calls_++ < refusals_) {
        d(absl::UnavailableError("parameter server is shutting down"));
        return;
      }
    }
    response->set_shard_id(shard_);
    response->set_num_shards(shards_);
    response->mutable_consistency()->set_mode(BSP);
    response->set_resume_step(resume_step_);
    d(absl::OkStatus());
  }

  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  const int shard_;
  const int shards_;
  const int refusals_;
  const int64_t resume_step_;
  absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

PsClientOptions TwoTensors() {
  PsClientOptions options;
  options.num_workers = 2;
  options.consistency.set_mode(BSP);
  TensorSpec w;
  w.set_name("w");
  w.add_shape(4);
  TensorSpec b = w;
  b.set_name("b");
  options.model = {w, b};
  return options;
}

// Issue 30's recovery run: worker 1 re-registered while shard 0 was exiting to roll back at
// worker 0's request; the shard's "shutting down" ended worker 1, and worker 0 then waited at the
// restarted shard for a worker that never came.
TEST(PsClientRegisterTest, AShardShuttingDownToRollBackIsWaitedForUpToTheConnectTimeout) {
  std::vector<std::unique_ptr<ShardChannel>> channels;
  channels.push_back(std::make_unique<RestartingShard>(0, 2, /*refusals=*/3, 60));
  channels.push_back(std::make_unique<RestartingShard>(1, 2, /*refusals=*/0, 60));
  auto* restarting = static_cast<RestartingShard*>(channels[0].get());
  PsClientOptions options = TwoTensors();
  options.connect_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreatePsClient(options, std::move(channels));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::vector<float>> initial(2, std::vector<float>(4, 0.f));
  absl::StatusOr<int64_t> resume = (*client)->Register(initial, 16, 0);
  ASSERT_TRUE(resume.ok()) << resume.status();
  EXPECT_EQ(*resume, 60);
  EXPECT_EQ(restarting->calls(), 4);
}

TEST(PsClientRegisterTest, AShardThatKeepsShuttingDownFailsRegistrationAtTheConnectTimeout) {
  std::vector<std::unique_ptr<ShardChannel>> channels;
  channels.push_back(std::make_unique<RestartingShard>(0, 2, /*refusals=*/1 << 30, 0));
  channels.push_back(std::make_unique<RestartingShard>(1, 2, /*refusals=*/0, 0));
  PsClientOptions options = TwoTensors();
  options.connect_timeout = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<PsClient>> client = CreatePsClient(options, std::move(channels));
  ASSERT_TRUE(client.ok()) << client.status();
  const std::vector<std::vector<float>> initial(2, std::vector<float>(4, 0.f));
  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> resume = (*client)->Register(initial, 16, 0);
  EXPECT_TRUE(absl::IsUnavailable(resume.status())) << resume.status();
  EXPECT_EQ(resume.status().message(), "server scripted:0: parameter server is shutting down");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

}  // namespace
}  // namespace rubato
