#include "mixprec/checkpoint/format/retention.h"

#include "fail.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "posix_file.h"
#include "staging_dirs.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace mixprec::checkpoint {
namespace {

using detail::fail;

// kill(pid, 0) probes existence without sending anything; EPERM means it exists but belongs
// to someone else, which still counts as alive.
bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

// When process `pid` started, in CLOCK_REALTIME nanoseconds, from /proc/<pid>/stat (field 22:
// clock ticks after boot); nullopt where /proc does not say (not Linux, a hidden pid, a
// process gone meanwhile). Accurate to a tick plus the drift between the two clocks since boot.
std::optional<std::int64_t> process_start_ns(long pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  // The command name (field 2) is in parentheses and may hold spaces or ')': count fields from
  // the last ')'. After it come field 3 (state) … field 22 (starttime).
  const std::size_t name_end = stat.rfind(')');
  if (name_end == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(name_end + 1));
  std::string field;
  for (int i = 3; i < 22; ++i) fields >> field;
  unsigned long long start_ticks = 0;
  const long ticks_per_second = ::sysconf(_SC_CLK_TCK);
  if (!(fields >> start_ticks) || ticks_per_second <= 0) return std::nullopt;
  timespec real{};
  timespec boot{};
  ::clock_gettime(CLOCK_REALTIME, &real);
  ::clock_gettime(CLOCK_BOOTTIME, &boot);
  const std::int64_t boot_in_real_ns =
      (real.tv_sec - boot.tv_sec) * 1000000000LL + (real.tv_nsec - boot.tv_nsec);
  return boot_in_real_ns +
         static_cast<std::int64_t>(start_ticks / ticks_per_second) * 1000000000LL +
         static_cast<std::int64_t>(start_ticks % ticks_per_second) * 1000000000LL /
             ticks_per_second;
}

std::int64_t mtime_ns(const struct stat& st) {
  return st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
}

// The newest modification time of the entry and, for a directory, of what is directly in
// it: a writer streaming into one large file changes that file, not the directory.
std::int64_t newest_mtime_ns(const Directory& root, const std::string& name,
                             const struct stat& st) {
  std::int64_t newest = mtime_ns(st);
  if (!S_ISDIR(st.st_mode)) return newest;
  try {
    const Directory dir = root.subdirectory(name);
    for (const std::string& child : detail::list_directory(dir.fd(), dir.path())) {
      if (auto child_st = detail::stat_entry(dir.fd(), child, dir / child)) {
        newest = std::max(newest, mtime_ns(*child_st));
      }
    }
  } catch (const FormatError&) {
    // Vanished or unreadable meanwhile: the entry's own time decides.
  }
  return newest;
}

bool is_stale(const Directory& root, const std::string& name, const struct stat& st,
              const detail::LeftoverName& leftover, const StagingCleanupOptions& options) {
  const detail::WriterIdentity self = detail::current_writer();
  if (!leftover.writer || leftover.writer->host != self.host) {
    struct timespec now {};
    ::clock_gettime(CLOCK_REALTIME, &now);
    const std::int64_t now_ns = now.tv_sec * 1000000000LL + now.tv_nsec;
    const std::int64_t age_ns = now_ns - newest_mtime_ns(root, name, st);
    return age_ns >= std::chrono::nanoseconds(options.foreign_timeout).count();
  }
  if (leftover.writer->boot != self.boot) return true;
  if (leftover.writer->pid == self.pid) return !detail::is_owned(name);
  if (!process_alive(leftover.writer->pid)) return true;
  // Alive, but perhaps not the writer: a process that started after the entry's last change
  // cannot have made it. A second's margin covers the clocks' granularity and drift.
  const std::optional<std::int64_t> started = process_start_ns(leftover.writer->pid);
  return started && *started > newest_mtime_ns(root, name, st) + 1000000000LL;
}

}  // namespace

RetentionOptions::RetentionOptions(std::size_t keep_last_, std::set<std::string> in_use_)
    : keep_last(keep_last_), in_use(std::move(in_use_)) {
  if (keep_last == 0) fail("RetentionOptions: keep_last must be at least 1");
}

std::vector<CheckpointInfo> list_checkpoints(const std::filesystem::path& root) {
  std::error_code ec;
  if (!std::filesystem::exists(root, ec)) return {};
  return list_checkpoints(open_root(root));
}

std::vector<CheckpointInfo> list_checkpoints(const Directory& root) {
  std::vector<CheckpointInfo> out;
  for (const std::string& name : detail::list_directory(root.fd(), root.path())) {
    if (!is_valid_file_name(name) || is_reserved_name(name)) continue;
    const auto st = detail::stat_entry(root.fd(), name, root / name);
    if (!st || !S_ISDIR(st->st_mode)) continue;  // links are never followed, files not ours
    try {
      out.push_back({name, read_manifest(root.subdirectory(name)).sequence});
    } catch (const FormatError&) {
      // Not ours, damaged, or a hostile manifest (a link, a FIFO): either way retention must
      // not treat it as a checkpoint it may delete, and listing should not fail because of it.
    }
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    return a.sequence != b.sequence ? a.sequence < b.sequence : a.name < b.name;
  });
  return out;
}

std::uint64_t next_sequence(const std::filesystem::path& root) {
  auto checkpoints = list_checkpoints(root);
  return checkpoints.empty() ? 1 : checkpoints.back().sequence + 1;
}

std::uint64_t next_sequence(const Directory& root) {
  auto checkpoints = list_checkpoints(root);
  return checkpoints.empty() ? 1 : checkpoints.back().sequence + 1;
}

std::vector<std::string> apply_retention(const std::filesystem::path& root,
                                         const RetentionOptions& options) {
  return apply_retention(open_root(root), options);
}

std::vector<std::string> apply_retention(const Directory& root, const RetentionOptions& options,
                                         std::vector<std::string>* deleted) {
  // Re-checked: the fields are public and may have been changed after construction.
  if (options.keep_last == 0)
    fail(root.path().string(), ": retention keep_last must be at least 1");
  const std::vector<CheckpointInfo> checkpoints = list_checkpoints(root);
  // Read before deleting anything: a malformed `latest` stops retention instead of letting it
  // delete what might be the only good checkpoint.
  const std::optional<std::string> latest = read_latest(root);
  std::vector<std::string> out;
  if (checkpoints.size() <= options.keep_last) return out;
  const std::size_t candidates = checkpoints.size() - options.keep_last;
  for (std::size_t i = 0; i < candidates; ++i) {
    const std::string& name = checkpoints[i].name;
    if (name == latest || options.in_use.count(name) != 0) continue;
    detail::remove_directory_atomically(root, name);
    out.push_back(name);
    if (deleted != nullptr) deleted->push_back(name);
  }
  return out;
}

std::vector<std::string> clean_stale_staging(const std::filesystem::path& root,
                                             const StagingCleanupOptions& options) {
  std::error_code ec;
  if (!std::filesystem::exists(root, ec)) return {};
  return clean_stale_staging(open_root(root), options);
}

std::vector<std::string> clean_stale_staging(const Directory& root,
                                             const StagingCleanupOptions& options) {
  std::vector<std::string> removed;
  for (const std::string& name : detail::list_directory(root.fd(), root.path())) {
    const std::optional<detail::LeftoverName> leftover = detail::parse_leftover_name(name);
    if (!leftover) continue;
    const auto st = detail::stat_entry(root.fd(), name, root / name);
    // Only what we create: a directory for staging, a regular file for `latest`. A link or
    // anything else under such a name was planted, not left by us.
    if (!st || (leftover->directory ? !S_ISDIR(st->st_mode) : !S_ISREG(st->st_mode))) continue;
    if (!is_stale(root, name, *st, *leftover, options)) continue;
    detail::remove_tree_at(root.fd(), name, root / name);
    removed.push_back(name);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace mixprec::checkpoint
