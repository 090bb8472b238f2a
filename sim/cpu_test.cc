#include "sim/cpu.h"

#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

double Ms(const EventLoop& loop, absl::Time start) {
  return absl::ToDoubleMilliseconds(loop.Now() - start);
}

TEST(CpuTest, WorkBeyondTheCoresIsShared) {
  EventLoop loop;
  const absl::Time start = loop.Now();
  Cpu cpu(&loop, 2);
  std::vector<double> ends;
  for (int i = 0; i < 4; ++i)
    cpu.Run(absl::Milliseconds(10), [&] { ends.push_back(Ms(loop, start)); });
  EXPECT_EQ(cpu.running(), 4);
  loop.Run();
  // Four 10 ms jobs on two cores: each at half speed, all done at 20 ms.
  ASSERT_EQ(ends.size(), 4u);
  for (double e : ends) EXPECT_NEAR(e, 20, 1e-3);
  EXPECT_EQ(cpu.running(), 0);
  EXPECT_EQ(cpu.busy(), absl::Milliseconds(40));
}

TEST(CpuTest, ArrivalsAndDeparturesChangeTheShare) {
  EventLoop loop;
  const absl::Time start = loop.Now();
  Cpu cpu(&loop, 1);
  double a = -1, b = -1;
  cpu.Run(absl::Milliseconds(10), [&] { a = Ms(loop, start); });
  loop.After(absl::Milliseconds(5),
             [&] { cpu.Run(absl::Milliseconds(10), [&] { b = Ms(loop, start); }); });
  loop.Run();
  // A runs alone for 5 ms, then shares: its last 5 ms take 10 (done at 15); B has had 5 ms of
  // work by then and runs alone for its last 5 (done at 20).
  EXPECT_NEAR(a, 15, 1e-3);
  EXPECT_NEAR(b, 20, 1e-3);
}

TEST(CpuTest, WideWorkUsesSeveralCoresAndCountsThemInTheShare) {
  EventLoop loop;
  const absl::Time start = loop.Now();
  Cpu cpu(&loop, 2);
  double wide = -1, narrow = -1;
  // Alone, 10 ms of width-2 work takes 5 ms on two cores.
  cpu.Run(
      absl::Milliseconds(10), [&] { wide = Ms(loop, start); }, 2);
  loop.Run();
  EXPECT_NEAR(wide, 5, 1e-3);
  // With a width-1 job beside it (3 of width on 2 cores), each gets 2/3 of its width: the wide
  // one does 4/3 ms of work a ms, the narrow one 2/3. The narrow one's 2 ms end at 3 ms (the wide
  // one has done 4 by then); the wide one's last 6 take 3 more ms alone.
  const absl::Time t0 = loop.Now();
  cpu.Run(
      absl::Milliseconds(10), [&] { wide = Ms(loop, t0); }, 2);
  cpu.Run(absl::Milliseconds(2), [&] { narrow = Ms(loop, t0); });
  loop.Run();
  EXPECT_NEAR(narrow, 3, 1e-3);
  EXPECT_NEAR(wide, 6, 1e-3);
}

TEST(CpuTest, ZeroCoresMeansNoSharing) {
  EventLoop loop;
  const absl::Time start = loop.Now();
  Cpu cpu(&loop, 0);
  std::vector<double> ends;
  for (int i = 1; i <= 3; ++i) {
    cpu.Run(absl::Milliseconds(i), [&] { ends.push_back(Ms(loop, start)); });
  }
  cpu.Run(absl::ZeroDuration(), [&] { ends.push_back(Ms(loop, start)); });
  loop.Run();
  EXPECT_EQ(ends, (std::vector<double>{0, 1, 2, 3}));
}

TEST(CpuTest, WorkWithinTheCoresTakesItsOwnTime) {
  EventLoop loop;
  const absl::Time start = loop.Now();
  Cpu cpu(&loop, 4);
  double a = -1, b = -1;
  cpu.Run(absl::Milliseconds(3), [&] { a = Ms(loop, start); });
  cpu.Run(absl::Milliseconds(7), [&] { b = Ms(loop, start); });
  loop.Run();
  EXPECT_NEAR(a, 3, 1e-3);
  EXPECT_NEAR(b, 7, 1e-3);
}

}  // namespace
}  // namespace rubato
