#include "staging_dirs.h"

#include "fail.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "posix_file.h"

#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <mutex>
#include <set>

namespace mixprec::checkpoint::detail {
namespace {

constexpr std::string_view kPrefix = ".tmp-";

std::mutex owned_mutex;
std::set<std::string>& owned() {
  static auto* names = new std::set<std::string>();  // never destroyed: usable at exit
  return *names;
}

}  // namespace

std::string make_staging_dir_name(std::string_view name) {
  return concat(kPrefix, name, "-", static_cast<long>(::getpid()), "-", random_hex());
}

std::optional<long> staging_dir_pid(std::string_view dir_name) {
  if (!dir_name.starts_with(kPrefix)) return std::nullopt;
  // Parse from the right: the checkpoint name itself may contain '-'.
  const std::size_t random_dash = dir_name.rfind('-');
  if (random_dash == std::string_view::npos || dir_name.size() - random_dash - 1 != 16) {
    return std::nullopt;
  }
  const std::size_t pid_dash = dir_name.rfind('-', random_dash - 1);
  if (pid_dash == std::string_view::npos || pid_dash < kPrefix.size()) return std::nullopt;
  long pid = 0;
  const char* first = dir_name.data() + pid_dash + 1;
  const char* last = dir_name.data() + random_dash;
  auto [end, ec] = std::from_chars(first, last, pid);
  if (ec != std::errc() || end != last || pid <= 0) return std::nullopt;
  return pid;
}

void mark_owned(const std::string& dir_name) {
  std::lock_guard<std::mutex> lock(owned_mutex);
  owned().insert(dir_name);
}

void unmark_owned(const std::string& dir_name) {
  std::lock_guard<std::mutex> lock(owned_mutex);
  owned().erase(dir_name);
}

bool is_owned(const std::string& dir_name) {
  std::lock_guard<std::mutex> lock(owned_mutex);
  return owned().count(dir_name) != 0;
}

void remove_tree(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (ec) fail(dir.string(), ": remove: ", ec.message());
}

void remove_directory_atomically(const std::filesystem::path& root, const std::string& name) {
  const std::filesystem::path victim = root / name;
  const std::filesystem::path hidden = root / make_staging_dir_name(name);
  crash_point("retention: before rename aside");
  if (std::rename(victim.c_str(), hidden.c_str()) != 0) {
    fail_errno(victim, concat("rename to ", hidden.string()));
  }
  crash_point("retention: after rename aside");
  fsync_directory(root);
  crash_point("retention: after root fsync");
  remove_tree(hidden);
  crash_point("retention: after remove");
}

}  // namespace mixprec::checkpoint::detail
