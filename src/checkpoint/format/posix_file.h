// Thin, throwing wrappers over the POSIX file calls the format layer needs. std::fstream
// cannot fsync, cannot open with O_EXCL or relative to a directory descriptor, and hides
// errno; these say which call failed on which path.
//
// Entries of a checkpoint root are opened relative to an open directory (openat) and never
// through a symbolic link: open_regular_at / open_directory_at add O_NOFOLLOW | O_NONBLOCK |
// O_CLOEXEC, look at the entry with fstatat(AT_SYMLINK_NOFOLLOW) before opening it (so a
// device node is never opened) and check the open descriptor with fstat (so an entry swapped
// in between is caught). A link, FIFO, device or socket is a FormatError
// "<path>: is a symbolic link, not a regular file; ...".
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint::detail {

// Owns a file descriptor; closes it (ignoring errors) unless close_checked() was called.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // close(2) with its error reported: on some filesystems (NFS) close is where a deferred
  // write error surfaces.
  void close_checked(const std::filesystem::path& path);

 private:
  int fd_ = -1;
};

// "a symbolic link", "a FIFO", "a character device", ... for error messages.
std::string_view file_type_name(mode_t mode);

// `path` without trailing separators ("a/b/" → "a/b"; "/" stays "/").
std::filesystem::path without_trailing_separators(const std::filesystem::path& path);

// The directory holding `path`'s entry: its parent, "." for a bare name. Trailing
// separators are ignored ("a/b/" → "a").
std::filesystem::path parent_directory(const std::filesystem::path& path);

// Throws FormatError unless `name` is one entry name: not empty, ".", "..", and no '/'.
void check_entry_name(std::string_view name, const std::filesystem::path& shown);

// open(2) of a path the caller chose, symbolic links followed, O_CLOEXEC added.
UniqueFd open_file(const std::filesystem::path& path, int flags, unsigned mode = 0644);

// Opens the directory at `path`. With follow_last false the last component must itself be a
// real directory (its parent is opened as given, then the entry with O_NOFOLLOW); with true
// symbolic links are followed all the way, for a root the caller chose to put behind one.
UniqueFd open_directory(const std::filesystem::path& path, bool follow_last);

// The regular file `name` in directory `dir_fd` (see the top of this file). `flags` is
// O_RDONLY, O_WRONLY or O_RDWR, optionally with O_CREAT (and O_EXCL). `shown` names it in
// errors. O_NONBLOCK is cleared again on the returned descriptor.
UniqueFd open_regular_at(int dir_fd, std::string_view name, int flags,
                         const std::filesystem::path& shown, unsigned mode = 0644);

// The real directory `name` in directory `dir_fd`; never a link.
UniqueFd open_directory_at(int dir_fd, std::string_view name, const std::filesystem::path& shown);

// fstatat(AT_SYMLINK_NOFOLLOW) of `name` in `dir_fd`; nullopt if there is no such entry.
std::optional<struct stat> stat_entry(int dir_fd, std::string_view name,
                                      const std::filesystem::path& shown);

// The names in an open directory, except "." and "..", unsorted.
std::vector<std::string> list_directory(int dir_fd, const std::filesystem::path& shown);

// Writes all of `bytes` (retrying short writes and EINTR).
void write_all(int fd, std::span<const std::byte> bytes, const std::filesystem::path& path);

// Reads exactly out.size() bytes at `offset`; a short file is reported as
// "<path>: unexpected end of file reading <n> bytes at offset <o>".
void pread_all(int fd, std::uint64_t offset, std::span<std::byte> out,
               const std::filesystem::path& path);

void fsync_fd(int fd, const std::filesystem::path& path);

// fsyncs the directory `dir` so that entries created, renamed or removed in it are durable.
// Throws FormatError naming the directory.
void fsync_directory(const std::filesystem::path& dir);

// Creates `dir` and its missing parents (trailing separators allowed). After each directory
// it creates it fsyncs the directory holding it, so the new entry survives power loss.
// Returns the directories fsynced, outermost first (empty if `dir` existed). Throws
// FormatError if a component exists but is not a directory, or a call fails.
std::vector<std::filesystem::path> create_directories_durably(const std::filesystem::path& dir);

// Size of an open file (fstat); throws unless it is a regular file.
std::uint64_t file_size(int fd, const std::filesystem::path& path);

// The whole regular file `name` of `dir_fd`; throws if it is larger than `max_bytes`.
std::string read_whole_file_at(int dir_fd, std::string_view name, std::uint64_t max_bytes,
                               const std::filesystem::path& shown);

// Removes the entry `name` of `dir_fd` and, for a directory, everything under it. Symbolic
// links are removed, never followed. A missing entry is not an error. Throws FormatError.
void remove_tree_at(int dir_fd, std::string_view name, const std::filesystem::path& shown);

// 16 random hex digits for unique temporary names.
std::string random_hex();

}  // namespace mixprec::checkpoint::detail
