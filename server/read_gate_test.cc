#include "server/read_gate.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace rubato {
namespace {

// Records which calls were started, in order.
struct Started {
  std::vector<std::string> order;
  ReadGate::Start Call(const std::string& name) {
    return std::make_shared<std::function<void()>>([this, name] { order.push_back(name); });
  }
};

TEST(ReadGateTest, ACallerReadsItsShareAndTheRestWaitUnread) {
  ReadGate gate(/*total=*/8, /*per_caller=*/2);
  Started s;
  gate.Enter(0, s.Call("a"));
  gate.Enter(0, s.Call("b"));
  gate.Enter(0, s.Call("c"));
  gate.Enter(1, s.Call("x"));
  EXPECT_EQ(s.order, (std::vector<std::string>{"a", "b", "x"}));
  EXPECT_EQ(gate.reading(0), 2);
  EXPECT_EQ(gate.waiting(0), 1);
  gate.Leave(0);  // "a" read: "c" takes its place
  EXPECT_EQ(s.order.back(), "c");
  EXPECT_EQ(gate.reading(0), 2);
  EXPECT_EQ(gate.waiting(0), 0);
}

TEST(ReadGateTest, TheTotalHoldsAndFreedReadsGoToWaitingCallersInTurn) {
  ReadGate gate(/*total=*/3, /*per_caller=*/2);
  Started s;
  gate.Enter(0, s.Call("0a"));
  gate.Enter(0, s.Call("0b"));
  gate.Enter(1, s.Call("1a"));
  gate.Enter(1, s.Call("1b"));  // total reached
  gate.Enter(2, s.Call("2a"));
  gate.Enter(0, s.Call("0c"));
  EXPECT_EQ(s.order, (std::vector<std::string>{"0a", "0b", "1a"}));
  EXPECT_EQ(gate.reading(), 3);
  // A freed read goes to the waiting caller with the fewest reads: 2 (none), then 0, then 1.
  gate.Leave(0);
  EXPECT_EQ(s.order.back(), "2a");
  gate.Leave(0);
  EXPECT_EQ(s.order.back(), "0c");
  gate.Leave(1);
  EXPECT_EQ(s.order.back(), "1b");
  EXPECT_EQ(gate.reading(), 3);
  EXPECT_LE(gate.reading(0), 2);
}

TEST(ReadGateTest, AWithdrawnCallNeverStarts) {
  ReadGate gate(/*total=*/1, /*per_caller=*/1);
  Started s;
  gate.Enter(0, s.Call("a"));
  ReadGate::Start b = s.Call("b");
  gate.Enter(1, b);
  EXPECT_TRUE(gate.Withdraw(1, b.get()));
  EXPECT_FALSE(gate.Withdraw(1, b.get()));
  gate.Leave(0);
  EXPECT_EQ(s.order, (std::vector<std::string>{"a"}));
  EXPECT_EQ(gate.reading(), 0);
}

}  // namespace
}  // namespace rubato
