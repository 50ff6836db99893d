// Kill-anywhere test of a whole save: a child process runs one save cycle (RootWriter: lock,
// stale staging, `latest` repair; write, commit, `latest`, retention) with
// MIXPREC_CRASH_POINT=k and is SIGKILLed at the k-th crash point, for every k. After each kill
// the checkpoint root must still hold a `latest` that names a checkpoint that verifies, every
// directory that looks committed must verify, and the newest complete checkpoint must never
// be older than before the save (no progress lost). The next save then recovers fully.
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"
#include "support/remove_tree.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <set>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::TempDir;
using testing::write_sample_checkpoint;

// What one training job's save does.
void save_cycle(const std::filesystem::path& root, const std::string& name) {
  testing::save_sample(root, name, 99, testing::keep_last(2));
}

// Checks the invariants; returns a description of the first violation, or "" if none.
// `allowed_latest`: what `latest` may name; `allowed_newest`: what the newest complete
// checkpoint may be (anything older would be progress lost).
std::string check_root(const std::filesystem::path& root,
                       const std::set<std::string>& allowed_latest,
                       const std::set<std::string>& allowed_newest) {
  try {
    const std::optional<std::string> latest = read_latest(root);
    if (!latest) return "no 'latest' after a crash: the previous commit was lost";
    if (!allowed_latest.count(*latest)) return "latest names '" + *latest + "'";
    verify_checkpoint(root / *latest);
    const NewestCheckpoint newest = find_newest_checkpoint(Directory::open(root));
    if (!newest.name || !allowed_newest.count(*newest.name)) {
      return "the newest complete checkpoint is '" + newest.name.value_or("") + "'";
    }
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      if (is_reserved_name(name) || name.starts_with(".tmp-")) continue;
      // Visible under a committed name: must be complete.
      verify_checkpoint(entry.path());
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct Scenario {
  std::set<std::string> allowed_latest, allowed_newest;
};

// Kills a save cycle of "ckpt-d" into a copy of `base` at every crash point.
void kill_everywhere(const std::filesystem::path& tmp, const std::filesystem::path& base,
                     const Scenario& scenario) {
  // A dry run counts the crash points of one save cycle.
  const auto dry = tmp / "dry";
  std::filesystem::copy(base, dry, std::filesystem::copy_options::recursive);
  detail::reset_crash_points();
  save_cycle(dry, "ckpt-d");
  const std::uint64_t points = detail::crash_points_reached();
  ASSERT_GT(points, 20u) << "the save cycle should pass many crash points";

  std::size_t killed = 0;
  std::size_t saw_new_latest = 0;
  for (std::uint64_t k = 1; k <= points + 1; ++k) {
    const auto root = tmp / ("run-" + std::to_string(k));
    std::filesystem::copy(base, root, std::filesystem::copy_options::recursive);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::setenv("MIXPREC_CRASH_POINT", std::to_string(k).c_str(), 1);
      ::freopen("/dev/null", "w", stderr);  // one "raising SIGKILL" line per k is noise
      detail::reset_crash_points();
      try {
        save_cycle(root, "ckpt-d");
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (k <= points) {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "crash point " << k << " did not kill the child (status " << status << ")";
      ++killed;
    } else {
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "past the last point";
    }
    const std::string problem = check_root(root, scenario.allowed_latest, scenario.allowed_newest);
    ASSERT_EQ(problem, "") << "after a kill at crash point " << k << " of " << points;
    if (read_latest(root) == "ckpt-d") ++saw_new_latest;

    // Recovery: the next job's save cleans up after the dead one and succeeds; nothing stale
    // remains, and `latest` names what it saved.
    const std::string next = std::filesystem::exists(root / "ckpt-d") ? "ckpt-e" : "ckpt-d";
    save_cycle(root, next);
    EXPECT_EQ(read_latest(root), next);
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      EXPECT_FALSE(name.starts_with(".tmp-") || name.starts_with("latest."))
          << "stale " << name << " left after crash point " << k;
    }
    mixprec::testing::remove_tree(root);
  }
  EXPECT_EQ(killed, points);
  EXPECT_GT(saw_new_latest, 0u);
  EXPECT_LT(saw_new_latest, points + 1);
  std::printf("[ crash    ] %llu crash points, %zu kills tried, latest moved in %zu runs\n",
              static_cast<unsigned long long>(points), killed, saw_new_latest);
}

TEST(CrashSafety, EveryKillPointLeavesALoadableRoot) {
  TempDir tmp;
  const auto base = tmp.path() / "base";
  write_sample_checkpoint(base, "ckpt-b", 1, 1);
  write_sample_checkpoint(base, "ckpt-c", 2, 2);
  kill_everywhere(tmp.path(), base, {{"ckpt-c", "ckpt-d"}, {"ckpt-c", "ckpt-d"}});
}

// The root a crash between commit and `latest` leaves: ckpt-c is complete, `latest` still
// names ckpt-b. The save repairs `latest` first, so kills also hit the repair's points.
TEST(CrashSafety, EveryKillPointWhileRepairingLatestLeavesALoadableRoot) {
  TempDir tmp;
  const auto base = tmp.path() / "base";
  write_sample_checkpoint(base, "ckpt-a", 1, 1);
  write_sample_checkpoint(base, "ckpt-b", 2, 2);
  write_sample_checkpoint(base, "ckpt-c", 3, 3, {.update_latest = false});
  kill_everywhere(tmp.path(), base, {{"ckpt-b", "ckpt-c", "ckpt-d"}, {"ckpt-c", "ckpt-d"}});
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
