// The order of a save's durability steps, seen at the system calls (syscall_trace.h).
//
// crash_test.cpp kills a save at every crash point, but a killed process keeps the page cache:
// it passes with any fsync missing. A power cut does not keep it. What a power cut needs, for a
// whole save through RootWriter (stage, write, commit, `latest`, retention) and for the repair
// of a stale `latest` when a writer opens the root:
//   * each file's last write comes before an fsync of it, and that before the fsync of the
//     staging directory, which comes before the rename that commits it;
//   * the root is fsynced after that rename and before `latest` moves to the new checkpoint;
//   * `latest`'s new file is fsynced after its last write and before its rename, and the root
//     after that rename;
//   * retention renames an old checkpoint aside only once the new `latest` is durable, and
//     fsyncs the root before it deletes anything of it: a name that looks committed never
//     comes back half deleted.
// Built into a binary of its own (durability_tests): the wrappers see every call it makes.
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/root_layout.h"

#include "format_test_util.h"
#include "syscall_trace.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <functional>
#include <sstream>

namespace mixprec::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::SyscallEvent;
using testing::SyscallTrace;
using testing::TempDir;

constexpr std::size_t kNone = static_cast<std::size_t>(-1);

// A save's calls, and the searches the checks make in them.
class Calls {
 public:
  explicit Calls(std::vector<SyscallEvent> events) : events_(std::move(events)) {}

  const SyscallEvent& operator[](std::size_t i) const { return events_.at(i); }

  // The first matching call at or after `from`, or kNone.
  std::size_t first(const std::string& call, const fs::path& path, std::size_t from = 0) const {
    for (std::size_t i = from; i < events_.size(); ++i) {
      if (events_[i].call == call && events_[i].path == path) return i;
    }
    return kNone;
  }
  // The first fsync or fdatasync of the file `path` at or after `from`, or kNone: either makes
  // its data durable (a directory's entries need fsync).
  std::size_t first_data_sync(const fs::path& path, std::size_t from) const {
    return std::min(first("fsync", path, from), first("fdatasync", path, from));
  }
  // The last matching call before `before`, or kNone.
  std::size_t last(const std::string& call, const fs::path& path, std::size_t before) const {
    for (std::size_t i = std::min(before, events_.size()); i-- > 0;) {
      if (events_[i].call == call && events_[i].path == path) return i;
    }
    return kNone;
  }
  // The first rename to `to` at or after `from`, or kNone.
  std::size_t rename_to(const fs::path& to, std::size_t from = 0) const {
    for (std::size_t i = from; i < events_.size(); ++i) {
      if (events_[i].call == "rename" && events_[i].to == to) return i;
    }
    return kNone;
  }
  // The first unlink or rmdir inside `dir`, or kNone.
  std::size_t first_removal_in(const fs::path& dir) const {
    for (std::size_t i = 0; i < events_.size(); ++i) {
      const auto& e = events_[i];
      if ((e.call == "unlink" || e.call == "rmdir") && e.path.parent_path() == dir) return i;
    }
    return kNone;
  }

  // Every call, numbered: printed with a failure.
  std::string listing() const {
    std::ostringstream out;
    for (std::size_t i = 0; i < events_.size(); ++i) {
      out << i << ": " << events_[i].call << " " << events_[i].path.string();
      if (!events_[i].to.empty()) out << " -> " << events_[i].to.string();
      out << "\n";
    }
    return out.str();
  }

 private:
  std::vector<SyscallEvent> events_;
};

// `latest` moved by the rename at or after `from`: its file written, then fsynced, before the
// rename, and the root fsynced after it. Returns the index of that root fsync (kNone if absent).
std::size_t expect_durable_latest(const Calls& calls, const fs::path& root, std::size_t from) {
  const std::size_t moved = calls.rename_to(root / kLatestFileName, from);
  if (moved == kNone) {
    ADD_FAILURE() << "`latest` was never renamed into place";
    return kNone;
  }
  const fs::path written = calls[moved].path;
  const std::size_t last_write = calls.last("write", written, moved);
  EXPECT_NE(last_write, kNone) << written;
  const std::size_t synced = calls.first_data_sync(written, last_write == kNone ? 0 : last_write);
  EXPECT_LT(synced, moved) << written << " is not fsynced between its last write and its rename";
  const std::size_t root_synced = calls.first("fsync", root, moved);
  EXPECT_NE(root_synced, kNone) << "the root is not fsynced after `latest`'s rename";
  return root_synced;
}

TEST(DurabilityOrder, ASaveMakesEachStepDurableBeforeTheNextDependsOnIt) {
  TempDir tmp;
  const fs::path root = tmp.path() / "root";
  testing::save_sample(root, "a", 1);
  testing::save_sample(root, "b", 2);
  std::vector<SyscallEvent> events;
  {
    SyscallTrace trace(root);
    testing::save_sample(root, "c", 3, testing::keep_last(1));
    events = trace.events();
  }
  const Calls calls(std::move(events));
  SCOPED_TRACE("the save's calls:\n" + calls.listing());
  const fs::path real_root = fs::canonical(root);

  // The commit: files, then their directory, then the rename.
  const std::size_t commit = calls.rename_to(real_root / "c");
  ASSERT_NE(commit, kNone) << "no rename committed c";
  const fs::path staging = calls[commit].path;
  const std::size_t directory_synced = calls.last("fsync", staging, commit);
  ASSERT_NE(directory_synced, kNone) << "the staging directory is not fsynced before the commit";
  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(real_root / "c")) {
    const fs::path staged = staging / entry.path().filename();
    const std::size_t last_write = calls.last("write", staged, commit);
    ASSERT_NE(last_write, kNone) << staged << " was never written";
    EXPECT_LT(calls.first_data_sync(staged, last_write), directory_synced)
        << staged << " is not fsynced between its last write and its directory's fsync";
    ++files;
  }
  EXPECT_EQ(files, 3u);  // two data files and the manifest

  // The commit is durable before `latest` names it; then `latest` itself.
  const std::size_t root_synced = calls.first("fsync", real_root, commit);
  const std::size_t latest_moved = calls.rename_to(real_root / kLatestFileName, commit);
  EXPECT_LT(root_synced, latest_moved) << "the root is not fsynced between the commit and `latest`";
  const std::size_t latest_durable = expect_durable_latest(calls, real_root, commit);

  // Retention, only once `latest` names the new checkpoint durably.
  for (const std::string old : {"a", "b"}) {
    SCOPED_TRACE("retention of " + old);
    EXPECT_FALSE(fs::exists(real_root / old));
    const std::size_t aside = calls.first("rename", real_root / old);
    ASSERT_NE(aside, kNone) << old << " was not renamed aside before its removal";
    EXPECT_GT(aside, latest_durable) << old << " is removed before the new `latest` is durable";
    const std::size_t aside_synced = calls.first("fsync", real_root, aside);
    const std::size_t removal = calls.first_removal_in(calls[aside].to);
    ASSERT_NE(removal, kNone) << "nothing of " << old << " was deleted";
    EXPECT_LT(aside_synced, removal)
        << "the root is not fsynced between renaming " << old << " aside and deleting it";
  }
}

// A writer that opens a root whose `latest` is stale points it at the newest checkpoint, as
// durably as a save does.
TEST(DurabilityOrder, RepairingAStaleLatestIsDurable) {
  TempDir tmp;
  const fs::path root = tmp.path() / "root";
  testing::write_sample_checkpoint(root, "c1", 1, 1);
  testing::write_sample_checkpoint(root, "c2", 2, 2, {.update_latest = false});
  std::vector<SyscallEvent> events;
  {
    SyscallTrace trace(root);
    RootWriter writer(root);
    ASSERT_EQ(writer.report().repaired_latest, "c2");
    events = trace.events();
  }
  const Calls calls(std::move(events));
  SCOPED_TRACE("the repair's calls:\n" + calls.listing());
  expect_durable_latest(calls, fs::canonical(root), 0);
  EXPECT_EQ(read_latest(root), "c2");
}

}  // namespace
}  // namespace mixprec::checkpoint
