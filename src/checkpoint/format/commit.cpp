#include "mixprec/checkpoint/format/commit.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "posix_file.h"
#include "staging_dirs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

namespace mixprec::checkpoint {
namespace {

using detail::crash_point;
using detail::fail;
using detail::fail_errno;

[[noreturn]] void fail_exists(const std::filesystem::path& path) {
  fail(path.string(), ": checkpoint already exists; refusing to overwrite a committed checkpoint",
       " (resume from it, or save under another name)");
}

// rename() that refuses to replace an existing destination. RENAME_NOREPLACE makes the
// check-and-rename atomic; where the filesystem lacks it (EINVAL), plain rename() is still
// safe for us because it cannot replace a non-empty directory and a committed checkpoint
// always holds at least its manifest.
void rename_no_replace(const Directory& root, const std::string& from, const std::string& to) {
  if (::renameat2(root.fd(), from.c_str(), root.fd(), to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL || err == ENOSYS) {
    if (::renameat(root.fd(), from.c_str(), root.fd(), to.c_str()) == 0) return;
    err = errno;
  }
  if (err == EEXIST || err == ENOTEMPTY) fail_exists(root / to);
  fail_errno(root / from, detail::concat("rename to ", (root / to).string()), err);
}

// Checks the name, then creates the staging directory and opens it.
Directory create_staging(const Directory& root, const std::string& name,
                         const std::string& dir_name) {
  check_checkpoint_name(root.path(), name);
  if (detail::stat_entry(root.fd(), name, root / name)) fail_exists(root / name);
  crash_point("staging: before mkdir");
  if (::mkdirat(root.fd(), dir_name.c_str(), 0755) != 0) fail_errno(root / dir_name, "mkdir");
  detail::mark_owned(dir_name);
  try {
    return root.subdirectory(dir_name);
  } catch (...) {
    detail::unmark_owned(dir_name);
    throw;
  }
}

}  // namespace

CheckpointStaging::CheckpointStaging(const std::filesystem::path& root, std::string name)
    : CheckpointStaging(open_root(root, /*create=*/true), std::move(name)) {}

CheckpointStaging::CheckpointStaging(const Directory& root, std::string name)
    : root_(root.duplicate()),
      name_(std::move(name)),
      dir_name_(detail::make_staging_dir_name(name_)),
      dir_(create_staging(root_, name_, dir_name_)) {}

CheckpointStaging::~CheckpointStaging() {
  detail::unmark_owned(dir_name_);
  if (committed_) return;
  try {
    detail::remove_tree_at(root_.fd(), dir_name_, dir_.path());
  } catch (const FormatError&) {
    // Best effort: a leftover is removed as stale staging by the next writer.
  }
}

std::filesystem::path CheckpointStaging::file(std::string_view file_name) const {
  if (!is_valid_file_name(file_name)) {
    fail(dir_.path().string(), ": '", file_name, "' is not a valid file name in a checkpoint");
  }
  return dir_ / file_name;
}

void CheckpointStaging::write_file(std::string_view file_name, std::span<const std::byte> bytes) {
  const std::filesystem::path path = file(file_name);
  crash_point("file: before create");
  detail::UniqueFd fd =
      detail::open_regular_at(dir_.fd(), file_name, O_WRONLY | O_CREAT | O_EXCL, path);
  detail::write_all(fd.get(), bytes, path);
  crash_point("file: after write");
  detail::fsync_fd(fd.get(), path);
  crash_point("file: after fsync");
  fd.close_checked(path);
}

void CheckpointStaging::write_file(std::string_view file_name, std::string_view text) {
  write_file(file_name, std::as_bytes(std::span(text.data(), text.size())));
}

std::filesystem::path CheckpointStaging::commit(const CommitOptions& options) {
  if (committed_) fail(dir_.path().string(), ": commit() called twice");
  const auto manifest = detail::stat_entry(dir_.fd(), kManifestFileName, dir_ / kManifestFileName);
  if (!manifest || !S_ISREG(manifest->st_mode)) {
    fail(dir_.path().string(), ": no ", kManifestFileName, " written; refusing to commit");
  }
  // Re-fsync every file: writers other than write_file() (e.g. a caller's own) may not have,
  // and an unsynced file behind a durable rename is exactly the partial checkpoint we forbid.
  for (const std::string& entry : detail::list_directory(dir_.fd(), dir_.path())) {
    const std::filesystem::path path = dir_ / entry;
    const auto st = detail::stat_entry(dir_.fd(), entry, path);
    if (st && !S_ISREG(st->st_mode)) {
      fail(path.string(), ": only regular files may be in a checkpoint directory (found ",
           detail::file_type_name(st->st_mode), ")");
    }
    detail::UniqueFd fd = detail::open_regular_at(dir_.fd(), entry, O_RDONLY, path);
    detail::fsync_fd(fd.get(), path);
  }
  crash_point("commit: before staging fsync");
  detail::fsync_fd(dir_.fd(), dir_.path());
  crash_point("commit: before rename");
  rename_no_replace(root_, dir_name_, name_);
  committed_ = true;
  crash_point("commit: after rename");
  detail::fsync_fd(root_.fd(), root_.path());
  crash_point("commit: after root fsync");
  if (options.update_latest) write_latest(root_, name_);
  return root_ / name_;
}

}  // namespace mixprec::checkpoint
