#include "mixprec/checkpoint/format/commit.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
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

// rename() that refuses to replace an existing destination. RENAME_NOREPLACE makes the
// check-and-rename atomic; where the filesystem lacks it (EINVAL), plain rename() is still
// safe for us because it cannot replace a non-empty directory and a committed checkpoint
// always holds at least its manifest.
void rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL || err == ENOSYS) {
    if (::rename(from.c_str(), to.c_str()) == 0) return;
    err = errno;
  }
  if (err == EEXIST || err == ENOTEMPTY) {
    fail(to.string(), ": checkpoint already exists; refusing to overwrite a committed checkpoint");
  }
  fail_errno(from, detail::concat("rename to ", to.string()), err);
}

}  // namespace

void fsync_directory(const std::filesystem::path& dir) {
  detail::UniqueFd fd = detail::open_file(dir, O_RDONLY | O_DIRECTORY);
  detail::fsync_fd(fd.get(), dir);
  fd.close_checked(dir);
}

CheckpointStaging::CheckpointStaging(std::filesystem::path root, std::string name)
    : root_(std::move(root)), name_(std::move(name)) {
  if (!is_valid_file_name(name_)) {
    fail(root_.string(), ": '", name_, "' is not a valid checkpoint name (1-200 characters of ",
         "[A-Za-z0-9._-], not starting with '.')");
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(root_, ec)) {
    std::filesystem::create_directories(root_, ec);
    if (ec) fail(root_.string(), ": create checkpoint root: ", ec.message());
    // The root's own entry must survive a crash too, or so would nothing committed in it.
    fsync_directory(std::filesystem::absolute(root_).parent_path());
  }
  if (std::filesystem::exists(root_ / name_, ec)) {
    fail((root_ / name_).string(),
         ": checkpoint already exists; refusing to overwrite a committed checkpoint");
  }
  const std::string dir_name = detail::make_staging_dir_name(name_);
  dir_ = root_ / dir_name;
  crash_point("staging: before mkdir");
  if (::mkdir(dir_.c_str(), 0755) != 0) fail_errno(dir_, "mkdir");
  detail::mark_owned(dir_name);
}

CheckpointStaging::~CheckpointStaging() {
  detail::unmark_owned(dir_.filename().string());
  if (committed_) return;
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);  // best effort; a leftover is cleaned up as stale
}

std::filesystem::path CheckpointStaging::file(std::string_view file_name) const {
  if (!is_valid_file_name(file_name)) {
    fail(dir_.string(), ": '", file_name, "' is not a valid file name in a checkpoint");
  }
  return dir_ / file_name;
}

void CheckpointStaging::write_file(std::string_view file_name, std::span<const std::byte> bytes) {
  const std::filesystem::path path = file(file_name);
  crash_point("file: before create");
  detail::UniqueFd fd = detail::open_file(path, O_WRONLY | O_CREAT | O_EXCL);
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
  if (committed_) fail(dir_.string(), ": commit() called twice");
  std::error_code ec;
  if (!std::filesystem::exists(dir_ / kManifestFileName, ec)) {
    fail(dir_.string(), ": no ", kManifestFileName, " written; refusing to commit");
  }
  // Re-fsync every file: writers other than write_file() (e.g. a caller's own) may not have,
  // and an unsynced file behind a durable rename is exactly the partial checkpoint we forbid.
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (!entry.is_regular_file()) {
      fail(entry.path().string(), ": only regular files may be in a checkpoint directory");
    }
    detail::UniqueFd fd = detail::open_file(entry.path(), O_RDONLY);
    detail::fsync_fd(fd.get(), entry.path());
  }
  if (ec) fail(dir_.string(), ": list: ", ec.message());
  crash_point("commit: before staging fsync");
  fsync_directory(dir_);
  crash_point("commit: before rename");
  const std::filesystem::path final_dir = root_ / name_;
  rename_no_replace(dir_, final_dir);
  committed_ = true;
  crash_point("commit: after rename");
  fsync_directory(root_);
  crash_point("commit: after root fsync");
  if (options.update_latest) write_latest(root_, name_);
  return final_dir;
}

}  // namespace mixprec::checkpoint
