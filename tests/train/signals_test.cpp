// StopRequest in this very process: which signal asked, what a second one does, and what the
// process has again once the request is gone.
#include "signals.h"

#include <gtest/gtest.h>

#include <csignal>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

volatile std::sig_atomic_t g_own_handler_calls = 0;
extern "C" void count_own_handler_call(int) { g_own_handler_calls = g_own_handler_calls + 1; }

// The test process's own SIGINT and SIGTERM actions, put back at scope exit: a StopRequest
// leaves SIGTERM handled on purpose.
class KeepSignalActions {
 public:
  KeepSignalActions() {
    sigaction(SIGINT, nullptr, &int_);
    sigaction(SIGTERM, nullptr, &term_);
  }
  ~KeepSignalActions() {
    sigaction(SIGINT, &int_, nullptr);
    sigaction(SIGTERM, &term_, nullptr);
  }
  KeepSignalActions(const KeepSignalActions&) = delete;
  KeepSignalActions& operator=(const KeepSignalActions&) = delete;

 private:
  struct sigaction int_ {};
  struct sigaction term_ {};
};

sighandler_t handler_of(int signal_number) {
  struct sigaction now {};
  sigaction(signal_number, nullptr, &now);
  return now.sa_handler;
}

// A first SIGINT asks to stop and gives SIGINT its default action back, so that a second
// Ctrl-C ends the process; once the request is gone, SIGINT has the handler it had before.
TEST(StopRequest, ASigintAsksOnceAndTheNextOneWouldEndTheProcess) {
  const KeepSignalActions keep;
  struct sigaction own {};
  own.sa_handler = count_own_handler_call;
  sigemptyset(&own.sa_mask);
  ASSERT_EQ(sigaction(SIGINT, &own, nullptr), 0);
  g_own_handler_calls = 0;
  {
    const StopRequest stop;
    EXPECT_FALSE(stop.requested());
    EXPECT_EQ(stop.signal_number(), 0);
    ASSERT_EQ(std::raise(SIGINT), 0);
    EXPECT_TRUE(stop.requested());
    EXPECT_EQ(stop.signal_number(), SIGINT);
    EXPECT_EQ(handler_of(SIGINT), SIG_DFL) << "a second Ctrl-C must end the process";
  }
  EXPECT_EQ(g_own_handler_calls, 0) << "the first SIGINT was the request's";
  ASSERT_EQ(handler_of(SIGINT), &count_own_handler_call) << "the handler from before is back";
  ASSERT_EQ(std::raise(SIGINT), 0);
  EXPECT_EQ(g_own_handler_calls, 1);
}

// SIGTERM stays handled after the first one (a launcher and its step daemon both send one),
// and a new StopRequest starts unasked.
TEST(StopRequest, SigtermStaysHandledAndANewRequestStartsUnasked) {
  const KeepSignalActions keep;
  {
    const StopRequest stop;
    ASSERT_EQ(std::raise(SIGTERM), 0);
    EXPECT_EQ(stop.signal_number(), SIGTERM);
    ASSERT_NE(handler_of(SIGTERM), SIG_DFL) << "a second SIGTERM would end the process";
    ASSERT_EQ(std::raise(SIGTERM), 0);
    EXPECT_EQ(stop.signal_number(), SIGTERM);
  }
  const StopRequest again;
  EXPECT_FALSE(again.requested()) << "the last request's signal is forgotten";
  EXPECT_EQ(again.signal_number(), 0);
}

// A SIGTERM the process started with ignored stays ignored: the launcher meant it so.
TEST(StopRequest, ASigtermIgnoredAtStartStaysIgnored) {
  const KeepSignalActions keep;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGTERM, &ignore, nullptr), 0);
  const StopRequest stop;
  EXPECT_EQ(handler_of(SIGTERM), SIG_IGN);
  ASSERT_EQ(std::raise(SIGTERM), 0);
  EXPECT_FALSE(stop.requested());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
