// Thin, throwing wrappers over the POSIX file calls the format layer needs. std::fstream
// cannot fsync, cannot open with O_EXCL, and hides errno; these say which call failed on
// which path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

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

// open(2) with O_CLOEXEC added; throws FormatError "<path>: open: ..." on failure.
UniqueFd open_file(const std::filesystem::path& path, int flags, unsigned mode = 0644);

// Writes all of `bytes` (retrying short writes and EINTR).
void write_all(int fd, std::span<const std::byte> bytes, const std::filesystem::path& path);

// Reads exactly out.size() bytes at `offset`; a short file is reported as
// "<path>: unexpected end of file reading <n> bytes at offset <o>".
void pread_all(int fd, std::uint64_t offset, std::span<std::byte> out,
               const std::filesystem::path& path);

void fsync_fd(int fd, const std::filesystem::path& path);

// Size of an open file (fstat).
std::uint64_t file_size(int fd, const std::filesystem::path& path);

// The whole file as a string; throws if it is larger than `max_bytes`.
std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes);

// 16 random hex digits for unique temporary names.
std::string random_hex();

}  // namespace mixprec::checkpoint::detail
