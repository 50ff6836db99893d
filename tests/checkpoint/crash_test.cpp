// Crash during save, at the level of a whole training state: a fresh process loads the
// latest checkpoint, takes a step and saves, and is killed with SIGKILL at the n-th crash
// point of the save (format/crash_point.h: the writer lock, stale-staging cleanup, before,
// during and after each file, each fsync, each rename, the `latest` update). After every kill,
// `latest` must load and verify, no partial checkpoint may ever be visible as committed, and
// the staging a killed save leaves is removed by the next save (at most one is ever left).
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/support_training.h"
#include "support/remove_tree.h"
#include "support/test_env.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;

// Exit status of the worker run with MIXPREC_CRASH_POINT=<point>; -SIGKILL if it was killed.
int run_worker_with_crash_point(const fs::path& root, int point) {
  const std::string command = "MIXPREC_CRASH_POINT=" + std::to_string(point) + " " +
                              mixprec::test::required_env("MIXPREC_RESUME_WORKER") + " resume " +
                              root.string() + " bf16 6 2>/dev/null";
  const int status = std::system(command.c_str());
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  // std::system runs the command through sh, which reports a killed child as 128 + signal.
  return WIFSIGNALED(status) ? -WTERMSIG(status) : status;
}

TEST(CrashDuringSave, EveryKillPointLeavesALoadableLatest) {
  std::string tmpl = (fs::temp_directory_path() / "mixprec-crash-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << tmpl;
  const fs::path root = tmpl;
  ASSERT_EQ(std::system((mixprec::test::required_env("MIXPREC_RESUME_WORKER") + " first " +
                         root.string() + " bf16 5")
                            .c_str()),
            0);
  int killed = 0, completed = 0;
  for (int point = 1; point < 200; ++point) {
    const int rc = run_worker_with_crash_point(root, point);
    const bool was_killed = rc == 128 + SIGKILL || rc == -SIGKILL;
    ASSERT_TRUE(was_killed || rc == 0) << "crash point " << point << ": worker exit " << rc;
    killed += was_killed ? 1 : 0;

    // `latest` names a complete checkpoint that verifies and loads.
    const std::optional<std::string> latest = read_latest(root);
    ASSERT_TRUE(latest.has_value()) << "crash point " << point;
    EXPECT_NO_THROW(verify_checkpoint(root / *latest)) << "crash point " << point;
    mixprec::testing::TrainingSetup fresh(at::kBFloat16);
    EXPECT_NO_THROW(load_training_state(root, *fresh.model, *fresh.optimizer))
        << "crash point " << point;
    // Every committed (non-hidden) checkpoint is complete: nothing partial is ever published.
    for (const auto& info : list_checkpoints(root)) {
      EXPECT_NO_THROW(verify_checkpoint(root / info.name)) << info.name << " at point " << point;
    }
    int leftovers = 0;
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename();
      if (entry.is_directory() && name[0] != '.') {
        EXPECT_TRUE(fs::exists(entry.path() / "manifest.json")) << name << " at point " << point;
      }
      leftovers += name.starts_with(".tmp-") || name.starts_with("latest.tmp") ? 1 : 0;
    }
    // The earlier code never cleaned staging outside the tests: one more full-size directory
    // per preemption.
    EXPECT_LE(leftovers, was_killed ? 1 : 0) << "stale staging accumulates, point " << point;
    // Undo a finished save so the next run saves "final" again from step-5.
    if (fs::exists(root / "final")) {
      mixprec::testing::remove_tree(root / "final");
      write_latest(root, "step-5");
    }
    if (!was_killed) {
      completed = point;
      break;
    }
  }
  EXPECT_GT(completed, 10) << "the save should pass many crash points";
  EXPECT_EQ(killed, completed - 1);
  std::printf("crash test: %d kill points tried, save completes after %d crash points\n", killed,
              completed - 1);
  mixprec::testing::remove_tree(root);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
