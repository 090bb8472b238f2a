#include "common/auth.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace rubato {
namespace {

JobAuth Auth(const std::string& secret = "0123456789abcdef0123456789abcdef") {
  return *JobAuth::FromSecret(secret);
}

TEST(JobAuthTest, WorkerTokensVerifyAsThatWorker) {
  const JobAuth auth = Auth();
  for (int id : {0, 1, 7, 4095}) {
    absl::StatusOr<AuthIdentity> who = auth.Verify(auth.WorkerToken(id));
    ASSERT_TRUE(who.ok()) << who.status();
    EXPECT_EQ(who->worker_id, id);
  }
  absl::StatusOr<AuthIdentity> op = auth.Verify(auth.OperatorToken());
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_FALSE(op->worker_id.has_value());
}

// The expected MAC was computed independently:
//   echo -n "rubato worker 3" | openssl dgst -sha256 -hmac JefeJefeJefeJefe
TEST(JobAuthTest, TokenIsHmacSha256OfTheWorkerId) {
  const JobAuth auth = Auth("JefeJefeJefeJefe");
  const std::string token = auth.WorkerToken(3);
  EXPECT_EQ(token, "worker/3/1cb19353d835e74368585c3c334a92539a01c8bffe75ff477c9d97bb11ee217e");
  EXPECT_NE(auth.WorkerToken(3), auth.WorkerToken(4));
  EXPECT_NE(Auth("JefeJefeJefeJefX").WorkerToken(3), token);
}

TEST(JobAuthTest, RefusesForgedAndMalformedTokens) {
  const JobAuth auth = Auth();
  const JobAuth other = Auth("another secret, long enough");
  const std::string good = auth.WorkerToken(1);
  std::string flipped = good;
  flipped.back() = flipped.back() == '0' ? '1' : '0';
  const std::string mac = good.substr(good.rfind('/') + 1);
  for (const std::string& bad :
       {std::string(), std::string("worker/1/"), other.WorkerToken(1), flipped,
        good.substr(0, good.size() - 1), good + "0", std::string("worker/2/") + mac,
        std::string("worker/+1/") + mac, std::string("worker/01/") + mac,
        std::string("worker/-1/") + mac, std::string("worker/99999999999/") + mac,
        std::string("operator/") + mac, std::string("admin/") + mac, other.OperatorToken()}) {
    absl::StatusOr<AuthIdentity> who = auth.Verify(bad);
    EXPECT_EQ(who.status().code(), absl::StatusCode::kUnauthenticated) << bad;
  }
}

TEST(JobAuthTest, SecretLength) {
  EXPECT_EQ(JobAuth::FromSecret("short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JobAuth::FromSecret(std::string(kMaxSecretBytes + 1, 'x')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(JobAuth::FromSecret(std::string(kMinSecretBytes, 'x')).ok());
}

TEST(JobAuthTest, SecretFile) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/job.secret";
  std::ofstream(path) << "0123456789abcdef0123456789abcdef\n";
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  absl::StatusOr<JobAuth> auth = JobAuth::FromFile(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  // The trailing newline is not part of the secret.
  EXPECT_EQ(auth->WorkerToken(0), Auth().WorkerToken(0));

  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  absl::Status readable = JobAuth::FromFile(path).status();
  EXPECT_EQ(readable.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(readable.message().find("mode 644"), std::string::npos) << readable;
  for (mode_t bad : {0604, 0660, 0610, 0601, 0666}) {
    ASSERT_EQ(::chmod(path.c_str(), bad), 0);
    EXPECT_EQ(JobAuth::FromFile(path).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // A group that only reads it: what a Kubernetes Secret volume with fsGroup gives.
  for (mode_t good : {0400, 0440, 0640}) {
    ASSERT_EQ(::chmod(path.c_str(), good), 0);
    EXPECT_TRUE(JobAuth::FromFile(path).ok()) << good;
  }

  EXPECT_EQ(JobAuth::FromFile(dir + "/missing").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace rubato
