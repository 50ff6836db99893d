#include "mixprec/checkpoint/format/retention.h"

#include "fail.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "staging_dirs.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace mixprec::checkpoint {
namespace {

using detail::fail;

// kill(pid, 0) probes existence without sending anything; EPERM means it exists but belongs
// to someone else, which still counts as alive.
bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

}  // namespace

RetentionOptions::RetentionOptions(std::size_t keep_last_, std::set<std::string> in_use_)
    : keep_last(keep_last_), in_use(std::move(in_use_)) {
  if (keep_last == 0) fail("RetentionOptions: keep_last must be at least 1");
}

std::vector<CheckpointInfo> list_checkpoints(const std::filesystem::path& root) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) return out;
  std::filesystem::directory_iterator it(root, ec);
  if (ec) fail(root.string(), ": list checkpoint root: ", ec.message());
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (!is_valid_file_name(name) || !entry.is_directory(ec)) continue;
    if (!std::filesystem::is_regular_file(entry.path() / kManifestFileName, ec)) continue;
    try {
      out.push_back({name, read_manifest(entry.path()).sequence});
    } catch (const FormatError&) {
      // Not ours, or damaged: either way retention must not treat it as a checkpoint it may
      // delete, and listing should not fail because of it.
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

std::vector<std::string> apply_retention(const std::filesystem::path& root,
                                         const RetentionOptions& options) {
  // Re-checked: the fields are public and may have been changed after construction.
  if (options.keep_last == 0) fail(root.string(), ": retention keep_last must be at least 1");
  const std::vector<CheckpointInfo> checkpoints = list_checkpoints(root);
  // Read before deleting anything: a malformed `latest` stops retention instead of letting it
  // delete what might be the only good checkpoint.
  const std::optional<std::string> latest = read_latest(root);
  std::vector<std::string> deleted;
  if (checkpoints.size() <= options.keep_last) return deleted;
  const std::size_t candidates = checkpoints.size() - options.keep_last;
  for (std::size_t i = 0; i < candidates; ++i) {
    const std::string& name = checkpoints[i].name;
    if (name == latest || options.in_use.count(name) != 0) continue;
    detail::remove_directory_atomically(root, name);
    deleted.push_back(name);
  }
  return deleted;
}

std::vector<std::string> clean_stale_staging(const std::filesystem::path& root) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) return removed;
  std::filesystem::directory_iterator it(root, ec);
  if (ec) fail(root.string(), ": list checkpoint root: ", ec.message());
  const long self = static_cast<long>(::getpid());
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    const std::optional<long> pid = detail::staging_dir_pid(name);
    if (!pid || !entry.is_directory(ec)) continue;
    const bool stale = *pid == self ? !detail::is_owned(name) : !process_alive(*pid);
    if (!stale) continue;
    detail::remove_tree(entry.path());
    removed.push_back(name);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace mixprec::checkpoint
