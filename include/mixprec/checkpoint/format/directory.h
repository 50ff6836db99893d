// An open directory of a checkpoint root, and the rule for links and special files.
//
// Everything in a checkpoint root is opened relative to an open directory's descriptor
// (openat), never again through a path: renaming a path component, or swapping it for a
// symbolic link, after the open cannot redirect a later read or write.
//
// The rule (SPEC §4): a checkpoint root may be reached through symbolic links — where to keep
// checkpoints is the user's choice — but nothing inside a root is. `latest`, the lock file,
// each checkpoint directory and every file in it must be a real directory or a regular file.
// Entries are opened with O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC after a look with
// fstatat(AT_SYMLINK_NOFOLLOW) and checked again with fstat, so a symbolic link (even to a
// valid copy elsewhere), a FIFO, a device node or a socket is refused with a FormatError
// naming the path and what it is ("…/data-00000.safetensors: is a FIFO, not a regular file;
// …"), nothing outside the root is opened, and a FIFO never blocks.
#pragma once

#include <filesystem>
#include <string_view>

namespace mixprec::checkpoint {

class Directory {
 public:
  enum class Last {
    kMayBeLink,  // a root: `path` may be, or pass through, symbolic links
    kReal,       // a checkpoint directory: its last component must be a real directory
  };

  // Opens the directory at `path` (trailing separators allowed). Leading components are
  // always resolved as the system does; `last` says whether the last may be a link.
  // Throws FormatError naming the path (and what it is, if it is not a directory).
  static Directory open(const std::filesystem::path& path, Last last = Last::kReal);

  // The entry `name` (one plain name) of this directory, which must be a real directory.
  Directory subdirectory(std::string_view name) const;

  // A second handle on the same directory (dup(2)).
  Directory duplicate() const;

  // Removes the entry `name` (one plain name) and, for a directory, everything under it;
  // symbolic links are removed, never followed; a missing entry is no error. Throws
  // FormatError naming what could not be removed. (Unlike std::filesystem::remove_all, which
  // in programs linked against PyTorch's pip wheels can bind to the wheel's own copy of
  // libstdc++'s filesystem code: the CUDA 13 build of torch 2.11 crashed in it.)
  void remove_tree(std::string_view name) const;

  const std::filesystem::path& path() const { return path_; }
  // path() / name, for messages and for callers that need a path.
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }
  int fd() const { return fd_; }

  ~Directory();
  Directory(Directory&& other) noexcept;
  Directory& operator=(Directory&& other) noexcept;
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

 private:
  Directory(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}

  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace mixprec::checkpoint
