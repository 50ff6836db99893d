// Keep-last-K retention by commit sequence, and cleanup of stale staging directories.
#include "mixprec/checkpoint/format/retention.h"

#include "mixprec/checkpoint/format/latest.h"

#include "format_test_util.h"
#include "staging_dirs.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

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

// Equal sequences (a checkpoint directory copied within the root) are ordered by name, so that
// listing, retention and the newest-checkpoint lookup agree on one order whatever the
// directory order.
TEST(Retention, EqualSequencesAreOrderedByName) {
  TempDir tmp;
  for (const char* name : {"b", "a", "c"}) write_sample_checkpoint(tmp.path(), name, 1, 1);
  EXPECT_EQ(names(list_checkpoints(tmp.path())), (std::vector<std::string>{"a", "b", "c"}));
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

// The constructor refuses keep_last 0, but the field is public: set afterwards, retention must
// still refuse it (before deleting anything) rather than delete every checkpoint but latest.
TEST(Retention, KeepLastZeroSetAfterConstructionIsRefusedBeforeDeleting) {
  TempDir tmp;
  for (int i = 1; i <= 3; ++i) {
    write_sample_checkpoint(tmp.path(), numbered(i), static_cast<std::uint64_t>(i), 1);
  }
  write_latest(tmp.path(), "c3");
  RetentionOptions options(1);
  options.keep_last = 0;
  EXPECT_FORMAT_ERROR(apply_retention(tmp.path(), options), "keep_last must be at least 1");
  EXPECT_EQ(names(list_checkpoints(tmp.path())), (std::vector<std::string>{"c1", "c2", "c3"}));
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

// A pid that is certainly dead: a child we have already reaped.
long dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

std::string staging_name(const std::string& host, const std::string& boot, long pid) {
  return ".tmp-x@" + host + "@" + boot + "-" + std::to_string(pid) + "-0123456789abcdef";
}

// Sets the modification time of `path` (and what is directly in it) `age` into the past.
void make_old(const std::filesystem::path& path, std::chrono::seconds age) {
  const auto when = std::filesystem::file_time_type::clock::now() - age;
  if (std::filesystem::is_directory(path)) {
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      std::filesystem::last_write_time(e.path(), when);
    }
  }
  std::filesystem::last_write_time(path, when);
}

// The rule of retention.h, case by case. The earlier code knew only "<name>-<pid>-<hex>" and
// removed any directory whose pid was not alive here — on a shared filesystem, the live
// staging of a writer on another host.
TEST(StaleStaging, HostIdentityDecidesWhatIsStale) {
  TempDir tmp;
  const auto& root = tmp.path();
  const detail::WriterIdentity self = detail::current_writer();
  const std::string other_boot =
      self.boot == "ffffffffffffffff" ? "0000000000000000" : "ffffffffffffffff";
  const std::string dead = staging_name(self.host, self.boot, dead_pid());
  const std::string live = staging_name(self.host, self.boot, ::getppid());
  const std::string own_orphan = staging_name(self.host, self.boot, ::getpid());
  const std::string rebooted = staging_name(self.host, other_boot, ::getppid());
  const std::string foreign_young = staging_name("other-host", self.boot, dead_pid());
  const std::string foreign_old = staging_name("other-host2", self.boot, dead_pid());
  const std::string legacy_young = ".tmp-x-" + std::to_string(dead_pid()) + "-0123456789abcdef";
  const std::string legacy_old = ".tmp-y-" + std::to_string(dead_pid()) + "-0123456789abcdef";
  const std::string latest_tmp_dead = "latest.tmp-" + self.host + "@" + self.boot + "-" +
                                      std::to_string(dead_pid()) + "-0123456789abcdef";
  const std::string not_ours = ".tmp-x-notapid-0123456789abcdef";
  for (const auto& d : {dead, live, own_orphan, rebooted, foreign_young, foreign_old, legacy_young,
                        legacy_old, not_ours}) {
    std::filesystem::create_directories(root / d / "sub");
    testing::write_file(root / d / "data", "x");
  }
  testing::write_file(root / latest_tmp_dead, "c1\n");
  testing::write_file(root / "latest.tmp", "planted\n");  // not a name we make: left alone
  make_old(root / foreign_old, std::chrono::hours(2));
  make_old(root / legacy_old, std::chrono::hours(2));
  // Old but with a file written just now: a writer on another host still streaming into it.
  const std::string foreign_busy = staging_name("other-host3", self.boot, dead_pid());
  std::filesystem::create_directories(root / foreign_busy);
  testing::write_file(root / foreign_busy / "data-00000.safetensors", "streaming");
  std::filesystem::last_write_time(
      root / foreign_busy, std::filesystem::file_time_type::clock::now() - std::chrono::hours(2));
  CheckpointStaging active(root, "active");

  const auto removed = clean_stale_staging(root, StagingCleanupOptions{std::chrono::hours(1)});
  std::vector<std::string> expected{dead,        own_orphan, rebooted,
                                    foreign_old, legacy_old, latest_tmp_dead};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  for (const auto& kept :
       {live, foreign_young, foreign_busy, legacy_young, not_ours, std::string("latest.tmp")}) {
    EXPECT_TRUE(std::filesystem::exists(root / kept)) << kept;
  }
  EXPECT_TRUE(std::filesystem::exists(active.dir()));
  EXPECT_FALSE(std::filesystem::exists(root / dead));
}

// A writer's pid, once it died, may be given to another process: in a container pids come
// from a small range and are reused soon. That process's start, after the entry's last change,
// shows it is not the writer; a live process that started before it may still be writing.
TEST(StaleStaging, APidTheWriterNoLongerHoldsIsStale) {
  TempDir tmp;
  const auto& root = tmp.path();
  const pid_t child = ::fork();
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  const detail::WriterIdentity self = detail::current_writer();
  const std::string reused = staging_name(self.host, self.boot, child);
  const std::string reused_latest = "latest.tmp-" + self.host + "@" + self.boot + "-" +
                                    std::to_string(child) + "-0123456789abcdef";
  std::string writing = reused;
  writing[5] = 'w';  // another name of the same writer
  for (const auto& d : {reused, writing}) {
    std::filesystem::create_directories(root / d);
    testing::write_file(root / d / "data", "x");
  }
  testing::write_file(root / reused_latest, "c1\n");
  make_old(root / reused, std::chrono::minutes(10));
  make_old(root / reused_latest, std::chrono::minutes(10));

  const auto removed = clean_stale_staging(root, StagingCleanupOptions{std::chrono::hours(1)});
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  std::vector<std::string> expected{reused, reused_latest};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  EXPECT_TRUE(std::filesystem::exists(root / writing)) << "changed after its writer started";
}

TEST(StaleStaging, NamesCarryTheWriterAndParseBack) {
  const detail::WriterIdentity self = detail::current_writer();
  EXPECT_FALSE(self.host.empty());
  EXPECT_EQ(self.boot.size(), 16u);
  const std::string name = detail::make_staging_dir_name(std::string(200, 'n'));
  EXPECT_LT(name.size(), 255u) << "must fit NAME_MAX";
  auto parsed = detail::parse_leftover_name(name);
  ASSERT_TRUE(parsed);
  EXPECT_TRUE(parsed->directory);
  ASSERT_TRUE(parsed->writer);
  EXPECT_EQ(*parsed->writer, self);
  auto latest_tmp = detail::parse_leftover_name(detail::make_latest_temp_name());
  ASSERT_TRUE(latest_tmp && latest_tmp->writer);
  EXPECT_FALSE(latest_tmp->directory);
  EXPECT_EQ(*latest_tmp->writer, self);
  for (const char* other :
       {"latest", "latest.tmp", "ckpt", ".tmp-", ".tmp-x@host@zz-1-0123456789abcdef",
        ".tmp-@h@0123456789abcdef-1-0123456789abcdef"}) {
    EXPECT_FALSE(detail::parse_leftover_name(other)) << other;
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
