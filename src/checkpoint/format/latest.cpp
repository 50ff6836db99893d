#include "mixprec/checkpoint/format/latest.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "posix_file.h"
#include "staging_dirs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mixprec::checkpoint {
namespace {

using detail::crash_point;
using detail::fail;

// A valid name is at most 200 bytes; anything much longer is not a pointer file.
constexpr std::uint64_t kMaxLatestBytes = 4096;

// Removes the temporary file unless dismissed (after the rename took it).
class TempFileGuard {
 public:
  TempFileGuard(const Directory& root, std::string name) : root_(root), name_(std::move(name)) {}
  ~TempFileGuard() {
    if (!name_.empty()) ::unlinkat(root_.fd(), name_.c_str(), 0);
  }
  void dismiss() { name_.clear(); }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;

 private:
  const Directory& root_;
  std::string name_;
};

}  // namespace

void write_latest(const std::filesystem::path& root, std::string_view name) {
  write_latest(Directory::open(root, Directory::Last::kMayBeLink), name);
}

void write_latest(const Directory& root, std::string_view name) {
  if (!is_valid_file_name(name) || is_reserved_name(name)) {
    fail(root.path().string(), ": '", detail::printable(name), "' is not a checkpoint name");
  }
  const std::filesystem::path target = root / name;
  const auto st = detail::stat_entry(root.fd(), name, target);
  if (!st) {
    fail(target.string(), ": not a committed checkpoint (no such directory); refusing to point ",
         "'latest' at it");
  }
  const Directory dir = root.subdirectory(name);  // refuses a link or a non-directory
  const auto manifest = detail::stat_entry(dir.fd(), kManifestFileName, dir / kManifestFileName);
  if (!manifest || !S_ISREG(manifest->st_mode)) {
    fail(target.string(), ": not a committed checkpoint (no regular ", kManifestFileName,
         "); refusing to point 'latest' at it");
  }
  const std::string tmp_name = detail::make_latest_temp_name();
  const std::filesystem::path tmp = root / tmp_name;
  const std::string content = std::string(name) + "\n";
  crash_point("latest: before temp create");
  detail::UniqueFd fd =
      detail::open_regular_at(root.fd(), tmp_name, O_WRONLY | O_CREAT | O_EXCL, tmp);
  TempFileGuard guard(root, tmp_name);
  crash_point("latest: after temp create");
  detail::write_all(fd.get(), std::as_bytes(std::span(content)), tmp);
  crash_point("latest: after write");
  detail::fsync_fd(fd.get(), tmp);
  fd.close_checked(tmp);
  crash_point("latest: before rename");
  if (::renameat(root.fd(), tmp_name.c_str(), root.fd(), std::string(kLatestFileName).c_str()) !=
      0) {
    detail::fail_errno(tmp, detail::concat("rename to ", (root / kLatestFileName).string()));
  }
  guard.dismiss();
  crash_point("latest: after rename");
  detail::fsync_fd(root.fd(), root.path());
  crash_point("latest: after root fsync");
}

std::optional<std::string> read_latest(const std::filesystem::path& root) {
  std::error_code ec;
  if (!std::filesystem::exists(root, ec)) return std::nullopt;  // no root, so no `latest`
  return read_latest(Directory::open(root, Directory::Last::kMayBeLink));
}

std::optional<std::string> read_latest(const Directory& root) {
  const std::filesystem::path latest = root / kLatestFileName;
  if (!detail::stat_entry(root.fd(), kLatestFileName, latest)) return std::nullopt;
  std::string text =
      detail::read_whole_file_at(root.fd(), kLatestFileName, kMaxLatestBytes, latest);
  if (text.empty() || text.back() != '\n') {
    fail(latest.string(), ": expected a checkpoint name followed by a newline");
  }
  text.pop_back();
  if (!is_valid_file_name(text) || is_reserved_name(text)) {
    fail(latest.string(), ": '", detail::printable(text),
         "' is not a valid checkpoint name (no '/', no leading '.', not a reserved name)");
  }
  const std::filesystem::path target = root / text;
  const auto st = detail::stat_entry(root.fd(), text, target);
  if (!st) {
    fail(latest.string(), ": names '", text, "' but ", target.string(),
         " is not a directory (no such entry)");
  }
  if (!S_ISDIR(st->st_mode)) {
    fail(latest.string(), ": names '", text, "' but ", target.string(), " is ",
         detail::file_type_name(st->st_mode), ", not a real directory; a checkpoint is read only ",
         "from real directories and regular files inside its root");
  }
  return text;
}

}  // namespace mixprec::checkpoint
