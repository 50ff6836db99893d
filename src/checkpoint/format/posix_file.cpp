#include "posix_file.h"

#include "fail.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>

namespace mixprec::checkpoint::detail {

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

UniqueFd open_file(const std::filesystem::path& path, int flags, unsigned mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, static_cast<mode_t>(mode));
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(path, "open");
  return UniqueFd(fd);
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

std::uint64_t file_size(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(path, "fstat");
  if (!S_ISREG(st.st_mode)) fail(path.string(), ": not a regular file");
  return static_cast<std::uint64_t>(st.st_size);
}

std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  UniqueFd fd = open_file(path, O_RDONLY);
  std::uint64_t size = file_size(fd.get(), path);
  if (size > max_bytes) {
    fail(path.string(), ": file is ", size, " bytes, more than the ", max_bytes, " allowed");
  }
  std::string text(size, '\0');
  pread_all(fd.get(), 0, std::as_writable_bytes(std::span(text)), path);
  return text;
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
