#include "staging_dirs.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "posix_file.h"

#include <stdio.h>
#include <unistd.h>

#include <charconv>
#include <fstream>
#include <mutex>
#include <set>

namespace mixprec::checkpoint::detail {
namespace {

constexpr std::size_t kMaxHostChars = 64;
constexpr std::size_t kMaxNameChars = 64;  // keeps staging names far below NAME_MAX (255)

std::mutex owned_mutex;
std::set<std::string>& owned() {
  static auto* names = new std::set<std::string>();  // never destroyed: usable at exit
  return *names;
}

bool is_hex(std::string_view s, std::size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::optional<long> parse_pid(std::string_view s) {
  long pid = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), pid);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || pid <= 0) return std::nullopt;
  return pid;
}

std::string host_name() {
  char buffer[256] = {};
  if (::gethostname(buffer, sizeof(buffer) - 1) != 0 || buffer[0] == '\0') return "unknown-host";
  std::string host(buffer);
  if (host.size() > kMaxHostChars) host.resize(kMaxHostChars);
  for (char& c : host) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  return host;
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string text, hex;
  std::getline(in, text);
  for (char c : text) {
    if (is_hex(std::string_view(&c, 1), 1)) hex += c;
    if (hex.size() == 16) return hex;
  }
  return std::string(16, '0');  // no boot id: every writer on this host shares "boot 0"
}

// "<host>@<boot>-<pid>-<16 hex>" → the writer; nullopt if malformed.
std::optional<WriterIdentity> parse_owner(std::string_view s) {
  const std::size_t random_dash = s.rfind('-');
  if (random_dash == std::string_view::npos || !is_hex(s.substr(random_dash + 1), 16)) {
    return std::nullopt;
  }
  const std::size_t pid_dash = s.rfind('-', random_dash - 1);
  const std::size_t at = s.rfind('@');
  if (pid_dash == std::string_view::npos || at == std::string_view::npos || at == 0 ||
      at > pid_dash || s.substr(0, at).find('@') != std::string_view::npos) {
    return std::nullopt;
  }
  const std::optional<long> pid = parse_pid(s.substr(pid_dash + 1, random_dash - pid_dash - 1));
  const std::string_view boot = s.substr(at + 1, pid_dash - at - 1);
  if (!pid || !is_hex(boot, 16)) return std::nullopt;
  return WriterIdentity{std::string(s.substr(0, at)), std::string(boot), *pid};
}

}  // namespace

WriterIdentity current_writer() {
  static const std::string host = host_name();
  static const std::string boot = boot_id();
  return {host, boot, static_cast<long>(::getpid())};
}

std::string owner_tag(const WriterIdentity& writer) {
  return concat(writer.host, "@", writer.boot, "-", writer.pid);
}

std::string make_staging_dir_name(std::string_view name) {
  return concat(kStagingPrefix, name.substr(0, kMaxNameChars), "@", owner_tag(current_writer()),
                "-", random_hex());
}

std::string make_latest_temp_name() {
  return concat(kLatestTempPrefix, owner_tag(current_writer()), "-", random_hex());
}

std::optional<LeftoverName> parse_leftover_name(std::string_view name) {
  if (name.starts_with(kLatestTempPrefix)) {
    auto writer = parse_owner(name.substr(kLatestTempPrefix.size()));
    if (!writer) return std::nullopt;
    return LeftoverName{false, std::move(writer)};
  }
  if (!name.starts_with(kStagingPrefix)) return std::nullopt;
  const std::string_view rest = name.substr(kStagingPrefix.size());
  const std::size_t at = rest.find('@');
  if (at != std::string_view::npos) {
    auto writer = at > 0 ? parse_owner(rest.substr(at + 1)) : std::nullopt;
    if (!writer) return std::nullopt;
    return LeftoverName{true, std::move(writer)};
  }
  // The earlier ".tmp-<name>-<pid>-<16 hex>", parsed from the right (names may hold '-').
  const std::size_t random_dash = rest.rfind('-');
  if (random_dash == std::string_view::npos || random_dash == 0 ||
      !is_hex(rest.substr(random_dash + 1), 16)) {
    return std::nullopt;
  }
  const std::size_t pid_dash = rest.rfind('-', random_dash - 1);
  if (pid_dash == std::string_view::npos || pid_dash == 0 ||
      !parse_pid(rest.substr(pid_dash + 1, random_dash - pid_dash - 1))) {
    return std::nullopt;
  }
  return LeftoverName{true, std::nullopt};
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

void remove_directory_atomically(const Directory& root, const std::string& name) {
  const std::string hidden = make_staging_dir_name(name);
  crash_point("retention: before rename aside");
  if (::renameat(root.fd(), name.c_str(), root.fd(), hidden.c_str()) != 0) {
    fail_errno(root / name, concat("rename to ", (root / hidden).string()));
  }
  crash_point("retention: after rename aside");
  fsync_fd(root.fd(), root.path());
  crash_point("retention: after root fsync");
  remove_tree_at(root.fd(), hidden, root / hidden);
  crash_point("retention: after remove");
}

}  // namespace mixprec::checkpoint::detail
