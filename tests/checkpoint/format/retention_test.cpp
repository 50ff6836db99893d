// Keep-last-K retention by commit sequence, and cleanup of stale staging directories.
#include "mixprec/checkpoint/format/retention.h"

#include "mixprec/checkpoint/format/latest.h"

#include "format_test_util.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace {

using testing::TempDir;
using testing::write_sample_checkpoint;

// "c<i>" (built with += : GCC 12 warns spuriously on "literal" + std::string, PR105329).
std::string numbered(int i) {
  std::string name = "c";
  name += std::to_string(i);
  return name;
}

std::vector<std::string> names(const std::vector<CheckpointInfo>& list) {
  std::vector<std::string> out;
  for (const auto& c : list) out.push_back(c.name);
  return out;
}

TEST(Retention, OrdersBySequenceNotByName) {
  TempDir tmp;
  const auto& root = tmp.path();
  EXPECT_EQ(next_sequence(root / "missing"), 1u);
  // Names sort the other way round from commit order.
  write_sample_checkpoint(root, "z-first", next_sequence(root), 1);
  write_sample_checkpoint(root, "m-second", next_sequence(root), 2);
  write_sample_checkpoint(root, "a-third", next_sequence(root), 3);
  // Things that are not checkpoints are listed as nothing and never touched.
  std::filesystem::create_directory(root / "notes");
  std::filesystem::create_directory(root / "broken");
  testing::write_file(root / "broken" / "manifest.json", "{not json");
  const auto list = list_checkpoints(root);
  EXPECT_EQ(names(list), (std::vector<std::string>{"z-first", "m-second", "a-third"}));
  EXPECT_EQ(list.back().sequence, 3u);
  EXPECT_EQ(next_sequence(root), 4u);
}

TEST(Retention, KeepsLastKAndNeverLatestOrInUse) {
  TempDir tmp;
  const auto& root = tmp.path();
  for (int i = 1; i <= 6; ++i) {
    write_sample_checkpoint(root, numbered(i), static_cast<std::uint64_t>(i),
                            static_cast<std::uint32_t>(i));
  }
  write_latest(root, "c2");  // e.g. the newer ones failed validation by the user's own check
  std::filesystem::create_directory(root / "notes");
  const auto deleted = apply_retention(root, RetentionOptions(2, {"c3"}));
  EXPECT_EQ(deleted, (std::vector<std::string>{"c1", "c4"}));
  EXPECT_EQ(names(list_checkpoints(root)), (std::vector<std::string>{"c2", "c3", "c5", "c6"}));
  EXPECT_TRUE(std::filesystem::exists(root / "notes"));
  EXPECT_TRUE(clean_stale_staging(root).empty()) << "deletion must leave no hidden leftovers";
  EXPECT_TRUE(apply_retention(root, RetentionOptions(4)).empty());
  EXPECT_FORMAT_ERROR(apply_retention(root, RetentionOptions(0)), "keep_last");
}

TEST(Retention, MalformedLatestStopsRetentionBeforeDeleting) {
  TempDir tmp;
  for (int i = 1; i <= 3; ++i) {
    write_sample_checkpoint(tmp.path(), numbered(i), static_cast<std::uint64_t>(i), 1);
  }
  testing::write_file(tmp.path() / "latest", "../c1\n");
  EXPECT_FORMAT_ERROR(apply_retention(tmp.path(), RetentionOptions(1)), "latest");
  EXPECT_EQ(list_checkpoints(tmp.path()).size(), 3u);
}

TEST(StaleStaging, RemovesDeadAndUnownedKeepsLiveAndOwned) {
  TempDir tmp;
  const auto& root = tmp.path();
  // A pid that is certainly dead: a child we have already reaped.
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);
  const std::string dead = ".tmp-x-" + std::to_string(child) + "-0123456789abcdef";
  const std::string live = ".tmp-x-" + std::to_string(::getppid()) + "-0123456789abcdef";
  const std::string own_orphan = ".tmp-x-" + std::to_string(::getpid()) + "-0123456789abcdef";
  const std::string not_ours = ".tmp-x-notapid-0123456789abcdef";
  for (const auto& d : {dead, live, own_orphan, not_ours}) {
    std::filesystem::create_directories(root / d / "sub");
  }
  CheckpointStaging active(root, "active");
  const auto removed = clean_stale_staging(root);
  std::vector<std::string> expected{dead, own_orphan};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  EXPECT_TRUE(std::filesystem::exists(root / live));
  EXPECT_TRUE(std::filesystem::exists(root / not_ours));
  EXPECT_TRUE(std::filesystem::exists(active.dir()));
}

}  // namespace
}  // namespace mixprec::checkpoint
