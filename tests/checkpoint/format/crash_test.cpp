// Kill-anywhere test of the commit protocol: a child process saves a checkpoint (and applies
// retention) with MIXPREC_CRASH_POINT=k and is SIGKILLed at the k-th crash point, for every k.
// After each kill the checkpoint root must still hold a `latest` that names a checkpoint that
// verifies completely, and every directory that looks committed must verify as well.
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace {

using testing::TempDir;
using testing::write_sample_checkpoint;

// What one training job's save does: clean up after earlier crashes, write, commit, retain.
void save_cycle(const std::filesystem::path& root, const std::string& name) {
  clean_stale_staging(root);
  write_sample_checkpoint(root, name, next_sequence(root), 99);
  apply_retention(root, RetentionOptions(2));
}

// Checks the invariants; returns a description of the first violation, or "" if none.
std::string check_root(const std::filesystem::path& root) {
  try {
    const std::optional<std::string> latest = read_latest(root);
    if (!latest) return "no 'latest' after a crash: the previous commit was lost";
    if (*latest != "ckpt-b" && *latest != "ckpt-c") return "latest names '" + *latest + "'";
    verify_checkpoint(root / *latest);
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      if (name == "latest" || name == "latest.tmp" || name.starts_with(".tmp-")) continue;
      // Visible under a committed name: must be complete.
      verify_checkpoint(entry.path());
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(CrashSafety, EveryKillPointLeavesALoadableRoot) {
  TempDir tmp;
  const auto base = tmp.path() / "base";
  write_sample_checkpoint(base, "ckpt-a", 1, 1);
  write_sample_checkpoint(base, "ckpt-b", 2, 2);

  // A dry run counts the crash points of one save cycle.
  const auto dry = tmp.path() / "dry";
  std::filesystem::copy(base, dry, std::filesystem::copy_options::recursive);
  detail::reset_crash_points();
  save_cycle(dry, "ckpt-c");
  const std::uint64_t points = detail::crash_points_reached();
  ASSERT_GT(points, 20u) << "the save cycle should pass many crash points";

  std::size_t killed = 0;
  std::size_t saw_new_latest = 0;
  for (std::uint64_t k = 1; k <= points + 1; ++k) {
    const auto root = tmp.path() / ("run-" + std::to_string(k));
    std::filesystem::copy(base, root, std::filesystem::copy_options::recursive);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::setenv("MIXPREC_CRASH_POINT", std::to_string(k).c_str(), 1);
      ::freopen("/dev/null", "w", stderr);  // one "raising SIGKILL" line per k is noise
      detail::reset_crash_points();
      try {
        save_cycle(root, "ckpt-c");
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
    const std::string problem = check_root(root);
    ASSERT_EQ(problem, "") << "after a kill at crash point " << k << " of " << points;
    if (read_latest(root) == "ckpt-c") ++saw_new_latest;

    // Recovery: the next job cleans up and saves again; nothing stale may remain.
    clean_stale_staging(root);
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      EXPECT_FALSE(entry.path().filename().string().starts_with(".tmp-"))
          << "stale staging left after crash point " << k;
    }
    const std::string next = std::filesystem::exists(root / "ckpt-c") ? "ckpt-d" : "ckpt-c";
    save_cycle(root, next);
    EXPECT_EQ(read_latest(root), next);
    std::filesystem::remove_all(root);
  }
  EXPECT_EQ(killed, points);
  EXPECT_GT(saw_new_latest, 0u);
  EXPECT_LT(saw_new_latest, points + 1);
  std::printf("[ crash    ] %llu crash points, %zu kills tried, latest moved in %zu runs\n",
              static_cast<unsigned long long>(points), killed, saw_new_latest);
}

}  // namespace
}  // namespace mixprec::checkpoint
