#include "mixprec/checkpoint/format/latest.h"

#include "fail.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "posix_file.h"

#include <fcntl.h>

#include <cstdio>

namespace mixprec::checkpoint {
namespace {

using detail::crash_point;
using detail::fail;

// A valid name is at most 200 bytes; anything much longer is not a pointer file.
constexpr std::uint64_t kMaxLatestBytes = 4096;

}  // namespace

void write_latest(const std::filesystem::path& root, std::string_view name) {
  if (!is_valid_file_name(name)) fail(root.string(), ": '", name, "' is not a checkpoint name");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(root / name / kManifestFileName, ec)) {
    fail((root / name).string(), ": not a committed checkpoint (no ", kManifestFileName,
         "); refusing to point 'latest' at it");
  }
  const std::filesystem::path tmp = root / "latest.tmp";
  const std::filesystem::path latest = root / kLatestFileName;
  const std::string content = std::string(name) + "\n";
  crash_point("latest: before write");
  detail::UniqueFd fd = detail::open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC);
  detail::write_all(fd.get(), std::as_bytes(std::span(content)), tmp);
  crash_point("latest: after write");
  detail::fsync_fd(fd.get(), tmp);
  fd.close_checked(tmp);
  crash_point("latest: before rename");
  if (std::rename(tmp.c_str(), latest.c_str()) != 0) {
    detail::fail_errno(tmp, detail::concat("rename to ", latest.string()));
  }
  crash_point("latest: after rename");
  fsync_directory(root);
  crash_point("latest: after root fsync");
}

std::optional<std::string> read_latest(const std::filesystem::path& root) {
  const std::filesystem::path latest = root / kLatestFileName;
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(latest, ec))) return std::nullopt;
  std::string text = detail::read_whole_file(latest, kMaxLatestBytes);
  if (text.empty() || text.back() != '\n') {
    fail(latest.string(), ": expected a checkpoint name followed by a newline");
  }
  text.pop_back();
  if (!is_valid_file_name(text)) {
    fail(latest.string(), ": '", text, "' is not a valid checkpoint name (no '/', no leading '.')");
  }
  if (!std::filesystem::is_directory(root / text, ec)) {
    fail(latest.string(), ": names '", text, "' but ", (root / text).string(),
         " is not a directory");
  }
  return text;
}

}  // namespace mixprec::checkpoint
