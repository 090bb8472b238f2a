#include "common/isa_dispatch.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace rubato {
namespace {

TEST(IsaDispatchTest, SiblingBesideTheNameItWasRunBy) {
  EXPECT_EQ(Avx2Sibling("bazel-bin/worker/rubato_worker", "/x/y/rubato_worker"),
            "bazel-bin/worker/rubato_worker_avx2");
  EXPECT_EQ(Avx2Sibling("/opt/rubato/bin/rubato_worker", ""), "/opt/rubato/bin/rubato_worker_avx2");
  // Found on PATH: beside the executable itself.
  EXPECT_EQ(Avx2Sibling("rubato_worker", "/opt/rubato/bin/rubato_worker"),
            "/opt/rubato/bin/rubato_worker_avx2");
  // A bare name and no /proc/self/exe: nowhere, not the working directory.
  EXPECT_EQ(Avx2Sibling("rubato_worker", ""), "");
  EXPECT_EQ(Avx2Sibling("", "/opt/rubato/bin/rubato_worker"), "");
}

TEST(IsaDispatchTest, CompiledIsaIsTheBaselineHere) {
  // This test is built in the default configuration: baseline x86-64.
  EXPECT_STREQ(CompiledIsa(), "x86-64");
}

TEST(IsaDispatchTest, NoVariantBesideATestBinary) {
  unsetenv("RUBATO_CPU_ISA");
  char name[] = "/nonexistent/dir/some_test";
  char* argv[] = {name, nullptr};
  ExecIsaVariant(argv);  // Returns: nothing to exec.
  const std::string note = IsaNote();
  EXPECT_EQ(note.rfind("baseline x86-64 build: ", 0), 0u) << note;
  if (CpuHasAvx2Fma()) {
    EXPECT_EQ(note, "baseline x86-64 build: no AVX2 build at /nonexistent/dir/some_test_avx2");
  } else {
    EXPECT_EQ(note, "baseline x86-64 build: the processor lacks AVX2 or FMA");
  }
}

}  // namespace
}  // namespace rubato
