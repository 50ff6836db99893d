#include "posix_file.h"

#include "fail.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <deque>
#include <random>

namespace mixprec::checkpoint::detail {
namespace {

constexpr std::string_view kRefusal =
    "a checkpoint is read and written only through real directories and regular files inside "
    "its root (no symbolic links, FIFOs or devices)";

[[noreturn]] void fail_type(const std::filesystem::path& shown, mode_t mode,
                            std::string_view wanted) {
  fail(shown.string(), ": is ", file_type_name(mode), ", not ", wanted, "; ", kRefusal);
}

int retry_openat(int dir_fd, const char* name, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::openat(dir_fd, name, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Opens `name` in `dir_fd` and checks what it is before and after. `want_dir` selects a
// directory, else a regular file.
UniqueFd open_checked_at(int dir_fd, std::string_view name, int flags,
                         const std::filesystem::path& shown, unsigned mode, bool want_dir) {
  check_entry_name(name, shown);
  const std::string entry(name);
  const std::string_view wanted = want_dir ? "a directory" : "a regular file";
  const bool creating = (flags & O_CREAT) != 0;
  // Look first: a device node is never opened (opening some has side effects), and the
  // error says what the entry is rather than "Too many levels of symbolic links".
  if (!(creating && (flags & O_EXCL))) {
    if (auto st = stat_entry(dir_fd, entry, shown)) {
      if (want_dir ? !S_ISDIR(st->st_mode) : !S_ISREG(st->st_mode)) {
        fail_type(shown, st->st_mode, wanted);
      }
    } else if (!creating) {
      fail_errno(shown, "open", ENOENT);
    }
  }
  flags |= O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | (want_dir ? O_DIRECTORY : 0);
  UniqueFd fd(retry_openat(dir_fd, entry.c_str(), flags, static_cast<mode_t>(mode)));
  if (fd.get() < 0) {
    const int err = errno;
    // Swapped for a link (or another type) between the look and the open.
    if (err == ELOOP || err == ENOTDIR || err == ENXIO) {
      if (auto st = stat_entry(dir_fd, entry, shown)) fail_type(shown, st->st_mode, wanted);
    }
    fail_errno(shown, "open", err);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail_errno(shown, "fstat");
  if (want_dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) fail_type(shown, st.st_mode, wanted);
  // O_NONBLOCK only kept open() from waiting on a FIFO; reads of the file should block.
  const int status = ::fcntl(fd.get(), F_GETFL);
  if (status < 0 || ::fcntl(fd.get(), F_SETFL, status & ~O_NONBLOCK) != 0) {
    fail_errno(shown, "fcntl");
  }
  return fd;
}

}  // namespace

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

void UniqueFd::close_checked(const std::filesystem::path& path) {
  int fd = release();
  // Linux closes the descriptor even when close() reports EINTR; retrying could close a
  // descriptor another thread just opened.
  if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail_errno(path, "close");
}

std::string_view file_type_name(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISREG(mode)) return "a regular file";
  return "a special file";
}

std::filesystem::path without_trailing_separators(const std::filesystem::path& path) {
  std::string text = path.string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

std::filesystem::path parent_directory(const std::filesystem::path& path) {
  const std::filesystem::path parent = without_trailing_separators(path).parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}

void check_entry_name(std::string_view name, const std::filesystem::path& shown) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos) {
    fail(shown.string(), ": '", name, "' is not a single directory entry name");
  }
}

UniqueFd open_file(const std::filesystem::path& path, int flags, unsigned mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, static_cast<mode_t>(mode));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(path, "open");
  return UniqueFd(fd);
}

UniqueFd open_directory(const std::filesystem::path& path, bool follow_last) {
  const std::filesystem::path trimmed = without_trailing_separators(path);
  const std::string last = trimmed.filename().string();
  if (follow_last || last.empty() || last == "." || last == "..") {
    // "." and ".." cannot be links; "/" has no entry to check.
    UniqueFd fd = open_file(trimmed, O_RDONLY | O_DIRECTORY);
    return fd;
  }
  UniqueFd parent = open_file(parent_directory(trimmed), O_RDONLY | O_DIRECTORY);
  return open_directory_at(parent.get(), last, trimmed);
}

UniqueFd open_regular_at(int dir_fd, std::string_view name, int flags,
                         const std::filesystem::path& shown, unsigned mode) {
  return open_checked_at(dir_fd, name, flags, shown, mode, /*want_dir=*/false);
}

UniqueFd open_directory_at(int dir_fd, std::string_view name, const std::filesystem::path& shown) {
  return open_checked_at(dir_fd, name, O_RDONLY, shown, 0, /*want_dir=*/true);
}

std::optional<struct stat> stat_entry(int dir_fd, std::string_view name,
                                      const std::filesystem::path& shown) {
  struct stat st {};
  if (::fstatat(dir_fd, std::string(name).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return st;
  if (errno == ENOENT) return std::nullopt;
  fail_errno(shown, "stat");
}

std::vector<std::string> list_directory(int dir_fd, const std::filesystem::path& shown) {
  // fdopendir takes ownership of the descriptor it is given: hand it a duplicate, and rewind,
  // since the duplicate shares the original's position.
  UniqueFd copy(::fcntl(dir_fd, F_DUPFD_CLOEXEC, 0));
  if (copy.get() < 0) fail_errno(shown, "dup");
  DIR* dir = ::fdopendir(copy.get());
  if (dir == nullptr) fail_errno(shown, "fdopendir");
  copy.release();
  ::rewinddir(dir);
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  const int err = errno;
  ::closedir(dir);
  if (err != 0) fail_errno(shown, "readdir", err);
  return names;
}

void write_all(int fd, std::span<const std::byte> bytes, const std::filesystem::path& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "write");
    }
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
}

void pread_all(int fd, std::uint64_t offset, std::span<std::byte> out,
               const std::filesystem::path& path) {
  const std::size_t wanted = out.size();
  const std::uint64_t start = offset;
  while (!out.empty()) {
    ssize_t n = ::pread(fd, out.data(), out.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, concat("pread of ", wanted, " bytes at offset ", start));
    }
    if (n == 0) {
      fail(path.string(), ": unexpected end of file reading ", wanted, " bytes at offset ", start,
           " (the file was truncated?)");
    }
    out = out.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
}

void fsync_fd(int fd, const std::filesystem::path& path) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) fail_errno(path, "fsync");
}

void fsync_directory(const std::filesystem::path& dir) {
  UniqueFd fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  fsync_fd(fd.get(), dir);
  fd.close_checked(dir);
}

std::vector<std::filesystem::path> create_directories_durably(const std::filesystem::path& dir) {
  // The missing components, outermost first. A trailing separator must not make the
  // directory itself count as its own parent (it once did: the root's entry went unsynced).
  std::deque<std::filesystem::path> missing;
  for (std::filesystem::path p = without_trailing_separators(dir); !p.empty();) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode) && !(S_ISLNK(st.st_mode) && std::filesystem::is_directory(p))) {
        fail(p.string(), ": is ", file_type_name(st.st_mode), ", not a directory");
      }
      break;
    }
    if (errno != ENOENT && errno != ENOTDIR) fail_errno(p, "stat");  // ENOTDIR: see the parent
    missing.push_front(p);
    const std::filesystem::path parent = p.parent_path();
    if (parent == p) break;
    p = parent;
  }
  std::vector<std::filesystem::path> synced;
  for (const std::filesystem::path& p : missing) {
    if (::mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) fail_errno(p, "mkdir");
    synced.push_back(parent_directory(p));
    fsync_directory(synced.back());
  }
  return synced;
}

std::uint64_t file_size(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(path, "fstat");
  if (!S_ISREG(st.st_mode)) fail_type(path, st.st_mode, "a regular file");
  return static_cast<std::uint64_t>(st.st_size);
}

std::string read_whole_file_at(int dir_fd, std::string_view name, std::uint64_t max_bytes,
                               const std::filesystem::path& shown) {
  UniqueFd fd = open_regular_at(dir_fd, name, O_RDONLY, shown);
  std::uint64_t size = file_size(fd.get(), shown);
  if (size > max_bytes) {
    fail(shown.string(), ": file is ", size, " bytes, more than the ", max_bytes, " allowed");
  }
  std::string text(size, '\0');
  pread_all(fd.get(), 0, std::as_writable_bytes(std::span(text)), shown);
  return text;
}

void remove_tree_at(int dir_fd, std::string_view name, const std::filesystem::path& shown) {
  check_entry_name(name, shown);
  const std::string entry(name);
  const std::optional<struct stat> st = stat_entry(dir_fd, entry, shown);
  if (!st) return;
  if (S_ISDIR(st->st_mode)) {
    UniqueFd sub = open_directory_at(dir_fd, entry, shown);
    for (const std::string& child : list_directory(sub.get(), shown)) {
      remove_tree_at(sub.get(), child, shown / child);
    }
    if (::unlinkat(dir_fd, entry.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      fail_errno(shown, "remove");
    }
  } else if (::unlinkat(dir_fd, entry.c_str(), 0) != 0 && errno != ENOENT) {
    fail_errno(shown, "remove");
  }
}

std::string random_hex() {
  static thread_local std::mt19937_64 engine = [] {
    std::random_device device;
    std::seed_seq seed{device(), device(), device(), device(), static_cast<unsigned>(::getpid())};
    return std::mt19937_64(seed);
  }();
  static constexpr char kDigits[] = "0123456789abcdef";
  std::uint64_t value = engine();
  std::string hex(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) hex[static_cast<std::size_t>(i)] = kDigits[value & 15];
  return hex;
}

}  // namespace mixprec::checkpoint::detail
