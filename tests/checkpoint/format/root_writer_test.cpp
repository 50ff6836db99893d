// The one writer of a root (root_writer.h): the lock, `latest` repair, reserved and existing
// names, and failures after a durable commit reported as warnings.
#include "mixprec/checkpoint/format/root_writer.h"

#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using testing::save_sample;
using testing::TempDir;
using testing::write_sample_checkpoint;

// c1 (sequence 1) named by `latest`, then c2 (sequence 2) committed without moving `latest`:
// what a crash between the commit rename and the `latest` update leaves.
void make_stale_root(const fs::path& root) {
  write_sample_checkpoint(root, "c1", 1, 1);
  write_sample_checkpoint(root, "c2", 2, 2, {.update_latest = false});
}

TEST(RootWriter, ACleanRootReportsNothing) {
  TempDir tmp;
  OpenReport opened;
  const PublishReport report = save_sample(tmp.path() / "root", "a", 1, {}, {}, &opened);
  EXPECT_EQ(report.dir, tmp.path() / "root" / "a");
  EXPECT_TRUE(report.warnings.empty());
  EXPECT_TRUE(opened.cleaned_staging.empty());
  EXPECT_EQ(opened.repaired_latest, std::nullopt);
  EXPECT_TRUE(opened.warnings.empty());
  EXPECT_EQ(read_latest(tmp.path() / "root"), "a");
  EXPECT_TRUE(fs::is_regular_file(tmp.path() / "root" / "lock"));
}

TEST(RootWriter, FindsTheNewestCompleteCheckpointWithoutWriting) {
  TempDir tmp;
  make_stale_root(tmp.path());
  const std::string latest_before = testing::read_file(tmp.path() / "latest");
  const NewestCheckpoint newest = find_newest_checkpoint(Directory::open(tmp.path()));
  EXPECT_EQ(newest.name, "c2");
  EXPECT_EQ(newest.recorded, "c1");
  EXPECT_TRUE(newest.latest_is_stale());
  EXPECT_EQ(testing::read_file(tmp.path() / "latest"), latest_before);
}

// Only a higher sequence than `latest`'s makes a checkpoint newer: a committed copy with the
// same sequence (a name that sorts after `latest`'s) is neither verified nor taken.
TEST(RootWriter, ACheckpointWithLatestsSequenceIsNotNewer) {
  TempDir tmp;
  write_sample_checkpoint(tmp.path(), "c1", 1, 1);
  write_sample_checkpoint(tmp.path(), "c1-copy", 1, 2, {.update_latest = false});
  const NewestCheckpoint newest = find_newest_checkpoint(Directory::open(tmp.path()));
  EXPECT_EQ(newest.name, "c1");
  EXPECT_FALSE(newest.latest_is_stale());
  EXPECT_TRUE(newest.skipped.empty());
}

// The earlier code never looked past `latest`: resume went back to c1, and every later save
// of c2 failed with "already exists".
TEST(RootWriter, RepairsLatestAndSaysSo) {
  TempDir tmp;
  make_stale_root(tmp.path());
  // A newer checkpoint that does not verify is skipped, with a warning, and left alone.
  const fs::path bad = write_sample_checkpoint(tmp.path(), "c3", 3, 3, {.update_latest = false});
  std::string data = testing::read_file(bad / "data-1.safetensors");
  data[data.size() - 1] ^= 1;
  testing::write_file(bad / "data-1.safetensors", data);

  RootWriter writer(tmp.path());
  EXPECT_EQ(writer.report().repaired_latest, "c2");
  EXPECT_EQ(read_latest(tmp.path()), "c2");
  ASSERT_EQ(writer.report().warnings.size(), 1u);
  EXPECT_NE(writer.report().warnings[0].find("c3"), std::string::npos);
  EXPECT_NE(writer.report().warnings[0].find("checksum"), std::string::npos);
  EXPECT_TRUE(fs::exists(bad));

  // Saving c2 again is not a dead end: the error says it is committed and now `latest`.
  EXPECT_FORMAT_ERROR(writer.stage("c2"), "c2", "already exists and is committed", "now does",
                      "resume from it");
  auto staging = writer.stage("c4");
  testing::write_sample_files(*staging, writer.next_sequence(), 4);
  EXPECT_EQ(writer.next_sequence(), 4u);
  writer.publish(*staging);
  EXPECT_EQ(read_latest(tmp.path()), "c4");
}

TEST(RootWriter, ReplacesAMissingOrHostileLatest) {
  for (const std::string kind : {"missing", "link", "fifo", "garbage"}) {
    SCOPED_TRACE(kind);
    TempDir tmp;
    make_stale_root(tmp.path());
    testing::write_file(tmp.path() / "outside", "c1\n");
    const fs::path latest = tmp.path() / "latest";
    if (kind == "missing") fs::remove(latest);
    if (kind == "link") testing::replace_with_symlink(latest, tmp.path() / "outside");
    if (kind == "fifo") testing::replace_with_fifo(latest);
    if (kind == "garbage") testing::write_file(latest, "../../etc\n");
    testing::AlarmGuard guard(60);
    RootWriter writer(tmp.path());
    EXPECT_EQ(writer.report().repaired_latest, "c2");
    EXPECT_EQ(writer.report().warnings.size(), kind == "missing" ? 0u : 1u);
    EXPECT_FALSE(fs::is_symlink(latest));
    EXPECT_EQ(read_latest(tmp.path()), "c2");
    EXPECT_EQ(testing::read_file(tmp.path() / "outside"), "c1\n");
  }
}

TEST(RootWriter, ReservedNamesAreRefused) {
  TempDir tmp;
  RootWriter writer(tmp.path());
  for (const std::string name : {"latest", "latest.tmp", "latest.tmp-x", "latest.old", "lock"}) {
    EXPECT_FORMAT_ERROR(writer.stage(name), "'" + name + "' is a reserved name");
    EXPECT_FORMAT_ERROR(CheckpointStaging(tmp.path(), name), "reserved name");
  }
  EXPECT_FORMAT_ERROR(writer.stage(".hidden"), "not a valid checkpoint name");
  fs::create_directory(tmp.path() / "notes");
  EXPECT_FORMAT_ERROR(writer.stage("notes"), "already exists (a directory, not a committed");
}

// A directory where `latest` should be: its update fails after the commit. The checkpoint is
// committed and durable, so the save reports warnings instead of throwing as if it had failed.
TEST(RootWriter, FailuresAfterTheCommitAreWarnings) {
  TempDir tmp;
  write_sample_checkpoint(tmp.path(), "c1", 1, 1);
  fs::remove(tmp.path() / "latest");
  fs::create_directories(tmp.path() / "latest" / "blocker");
  OpenReport opened;
  const PublishReport report = save_sample(tmp.path(), "c2", 2, testing::keep_last(1), {}, &opened);
  EXPECT_FALSE(opened.warnings.empty());
  ASSERT_EQ(report.warnings.size(), 2u);
  EXPECT_NE(report.warnings[0].find("'latest' was not updated"), std::string::npos)
      << report.warnings[0];
  EXPECT_NE(report.warnings[1].find("retention stopped"), std::string::npos) << report.warnings[1];
  EXPECT_NO_THROW(verify_checkpoint(report.dir));
  EXPECT_EQ(find_newest_checkpoint(Directory::open(tmp.path())).name, "c2");
}

TEST(RootWriterLock, ASecondWriterInTheSameProcessIsRefused) {
  TempDir tmp;
  RootWriter first(tmp.path());
  EXPECT_FORMAT_ERROR(RootWriter(tmp.path()), (tmp.path() / "lock").string(), "another writer",
                      "pid " + std::to_string(::getpid()), "set a lock timeout");
  EXPECT_FORMAT_ERROR(RootWriter(tmp.path(), {.lock_timeout = std::chrono::milliseconds(50)}),
                      "another writer", "waited 50 ms");
}

// Real processes: a child holds the lock; the parent is refused, then waits for it.
TEST(RootWriterLock, AnotherProcessIsRefusedOrWaits) {
  TempDir tmp;
  int held[2], release[2];
  ASSERT_EQ(::pipe(held), 0);
  ASSERT_EQ(::pipe(release), 0);
  std::fflush(nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    try {
      RootWriter writer(tmp.path());
      char c = 1;
      if (::write(held[1], &c, 1) != 1 || ::read(release[0], &c, 1) != 1) code = 2;
      ::usleep(100 * 1000);  // the parent is waiting by now (the test does not rely on it)
    } catch (...) {
      code = 1;
    }
    ::_exit(code);
  }
  char c = 0;
  ASSERT_EQ(::read(held[0], &c, 1), 1);
  EXPECT_FORMAT_ERROR(RootWriter(tmp.path()), "another writer", "pid " + std::to_string(child));
  ASSERT_EQ(::write(release[1], &c, 1), 1);
  {
    RootWriter waited(tmp.path(), {.lock_timeout = std::chrono::seconds(120)});
    EXPECT_TRUE(waited.report().warnings.empty());
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int fd : {held[0], held[1], release[0], release[1]}) ::close(fd);
}

// Two processes save into one root at the same time, each waiting for the lock, with
// retention. Nothing is lost or dangling: every save succeeded, sequences are unique, `latest`
// names the newest checkpoint, everything kept verifies, no staging is left behind.
TEST(RootWriterLock, TwoProcessesSavingConcurrentlyLoseNothing) {
  TempDir tmp;
  const fs::path root = tmp.path() / "root";
  constexpr int kSaves = 8;
  std::fflush(nullptr);
  std::vector<pid_t> children;
  for (int p = 0; p < 2; ++p) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int code = 0;
      try {
        for (int k = 0; k < kSaves; ++k) {
          const std::string name = "p" + std::to_string(p) + "-" + std::to_string(k);
          const PublishReport report =
              save_sample(root, name, static_cast<std::uint32_t>(10 * p + k), testing::keep_last(3),
                          {.lock_timeout = std::chrono::seconds(120)});
          if (!report.warnings.empty()) code = 2;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", p, e.what());
        code = 1;
      }
      ::_exit(code);
    }
    children.push_back(child);
  }
  for (pid_t child : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  const std::vector<CheckpointInfo> kept = list_checkpoints(root);
  ASSERT_EQ(kept.size(), 3u);
  for (std::size_t i = 1; i < kept.size(); ++i) EXPECT_LT(kept[i - 1].sequence, kept[i].sequence);
  EXPECT_EQ(kept.back().sequence, 2u * kSaves) << "every save got its own sequence";
  EXPECT_EQ(read_latest(root), kept.back().name);
  for (const CheckpointInfo& c : kept) EXPECT_NO_THROW(verify_checkpoint(root / c.name)) << c.name;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    EXPECT_FALSE(name.starts_with(".tmp-") || name.starts_with("latest.")) << name;
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
