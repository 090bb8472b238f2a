#include "common/auth.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace rubato {
namespace {

JobAuth Auth(const std::string& secret = "0123456789abcdef0123456789abcdef",
             const std::string& job_id = "test-job-1") {
  return *JobAuth::FromSecret(secret, job_id);
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

// The expected MACs were computed independently:
//   K=$(echo -n "rubato job test-job-1" | openssl dgst -sha256 -hmac JefeJefeJefeJefe -r | cut -c1-64)
//   echo -n "rubato worker 3" | openssl dgst -sha256 -mac HMAC -macopt hexkey:$K
//   echo -n "rubato data hello worker 3 000102...1f" | openssl dgst -sha256 -mac HMAC -macopt hexkey:$K
TEST(JobAuthTest, TokenIsHmacSha256OfTheWorkerIdUnderTheJobsKey) {
  const JobAuth auth = Auth("JefeJefeJefeJefe");
  const std::string token = auth.WorkerToken(3);
  EXPECT_EQ(token, "worker/3/aef38d23c85f874277303ebf036e484ed382f697bf6f510291764368dc4c4618");
  EXPECT_NE(auth.WorkerToken(3), auth.WorkerToken(4));
  EXPECT_NE(Auth("JefeJefeJefeJefX").WorkerToken(3), token);
  std::string challenge(kChallengeBytes, '\0');
  for (size_t i = 0; i < challenge.size(); ++i) challenge[i] = static_cast<char>(i);
  EXPECT_EQ(auth.HelloAnswer(3, challenge),
            "a449db20a1a680c8fe7389436d08535b20f36438ba40d512ac7a5d9d2b14b466");
}

TEST(JobAuthTest, NothingOfOneJobIsAcceptedByAnotherWithTheSameSecret) {
  const JobAuth first = Auth("the same secret for both jobs", "mnist-0011223344556677");
  const JobAuth second = Auth("the same secret for both jobs", "mnist-8899aabbccddeeff");
  for (const std::string& token : {first.WorkerToken(0), first.WorkerToken(1),
                                   first.OperatorToken()}) {
    EXPECT_TRUE(first.Verify(token).ok()) << token;
    const absl::Status refused = second.Verify(token).status();
    EXPECT_TRUE(absl::IsUnauthenticated(refused)) << token;
    EXPECT_NE(refused.message().find("--job_id"), std::string::npos) << refused;
  }
  const std::string challenge(kChallengeBytes, 'c');
  const std::string answer = first.HelloAnswer(0, challenge);
  EXPECT_TRUE(first.VerifyHelloAnswer(0, challenge, answer).ok());
  EXPECT_TRUE(absl::IsUnauthenticated(second.VerifyHelloAnswer(0, challenge, answer)));
}

TEST(JobAuthTest, AHelloAnswerFitsOneWorkerAndOneChallengeOnly) {
  const JobAuth auth = Auth();
  const std::string challenge(kChallengeBytes, 'x');
  std::string other = challenge;
  other.back() = 'y';
  const std::string answer = auth.HelloAnswer(2, challenge);
  EXPECT_TRUE(auth.VerifyHelloAnswer(2, challenge, answer).ok());
  EXPECT_FALSE(auth.VerifyHelloAnswer(2, other, answer).ok()) << "a replay on a new connection";
  EXPECT_FALSE(auth.VerifyHelloAnswer(3, challenge, answer).ok()) << "another worker";
  EXPECT_FALSE(auth.VerifyHelloAnswer(2, challenge, answer.substr(1)).ok());
  EXPECT_FALSE(auth.VerifyHelloAnswer(2, challenge, auth.WorkerToken(2)).ok());
  EXPECT_FALSE(auth.VerifyHelloAnswer(2, challenge, "").ok());
}

TEST(JobAuthTest, AJobIdIsRequiredAndChecked) {
  const std::string secret = "0123456789abcdef0123456789abcdef";
  const absl::Status none = JobAuth::FromSecret(secret, "").status();
  EXPECT_TRUE(absl::IsInvalidArgument(none)) << none;
  EXPECT_NE(none.message().find("--auth_secret_file needs --job_id"), std::string::npos) << none;
  for (const std::string& bad : {std::string("a b"), std::string("job/1"), std::string("j\n"),
                                 std::string(kMaxJobIdBytes + 1, 'j'), std::string("\xff")}) {
    const absl::Status s = JobAuth::FromSecret(secret, bad).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find("--job_id must be"), std::string::npos) << s;
  }
  for (const std::string& good : {std::string("j"), std::string("mnist_2.run-01"),
                                  std::string(kMaxJobIdBytes, 'j')}) {
    EXPECT_TRUE(JobAuth::FromSecret(secret, good).ok()) << good;
  }
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
  EXPECT_EQ(JobAuth::FromSecret("short", "j").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(JobAuth::FromSecret(std::string(kMaxSecretBytes + 1, 'x'), "j").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(JobAuth::FromSecret(std::string(kMinSecretBytes, 'x'), "j").ok());
}

TEST(JobAuthTest, SecretFile) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/job.secret";
  std::ofstream(path) << "0123456789abcdef0123456789abcdef\n";
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  absl::StatusOr<JobAuth> auth = JobAuth::FromFile(path, "test-job-1");
  ASSERT_TRUE(auth.ok()) << auth.status();
  // The trailing newline is not part of the secret.
  EXPECT_EQ(auth->WorkerToken(0), Auth().WorkerToken(0));

  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  absl::Status readable = JobAuth::FromFile(path, "test-job-1").status();
  EXPECT_EQ(readable.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(readable.message().find("mode 644"), std::string::npos) << readable;
  for (mode_t bad : {0604, 0660, 0610, 0601, 0666}) {
    ASSERT_EQ(::chmod(path.c_str(), bad), 0);
    EXPECT_EQ(JobAuth::FromFile(path, "test-job-1").status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // A group that only reads it: what a Kubernetes Secret volume with fsGroup gives.
  for (mode_t good : {0400, 0440, 0640}) {
    ASSERT_EQ(::chmod(path.c_str(), good), 0);
    EXPECT_TRUE(JobAuth::FromFile(path, "test-job-1").ok()) << good;
  }

  EXPECT_EQ(JobAuth::FromFile(dir + "/missing", "test-job-1").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace rubato
