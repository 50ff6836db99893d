#include "mixprec/checkpoint/format/root_lock.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "posix_file.h"
#include "staging_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <thread>

namespace mixprec::checkpoint {

namespace {
// Polling interval while waiting for another holder (flock has no timed wait).
constexpr std::chrono::milliseconds kLockPoll{10};
}  // namespace

std::string RootFileLock::holder(int fd) {
  char buffer[256] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  std::string text(buffer, n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text;
}

RootFileLock::RootFileLock(const Directory& root, std::string_view name,
                           std::chrono::milliseconds timeout, std::string_view what) {
  const std::filesystem::path path = root / std::string(name);
  detail::crash_point("lock: before open");
  detail::UniqueFd fd =
      detail::open_regular_at(root.fd(), std::string(name), O_RDWR | O_CREAT, path);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) detail::fail_errno(path, "flock");
    if (std::chrono::steady_clock::now() >= deadline) {
      const std::string who = holder(fd.get());
      detail::fail(path.string(), ": held by ",
                   who.empty() ? std::string("an unknown holder") : who, " (", what, ")",
                   timeout.count() > 0
                       ? detail::concat("; waited ", timeout.count(), " ms")
                       : std::string("; wait for it, or set a lock timeout to wait"));
    }
    std::this_thread::sleep_for(kLockPoll);
  }
  detail::crash_point("lock: after acquire");
  // Who holds it, for the message of the next one that has to wait. Best effort.
  const detail::WriterIdentity self = detail::current_writer();
  const std::string note = detail::concat(self.host, " pid ", self.pid, "\n");
  if (::ftruncate(fd.get(), 0) == 0) {
    [[maybe_unused]] ssize_t n = ::pwrite(fd.get(), note.data(), note.size(), 0);
  }
  fd_ = fd.release();
}

RootFileLock::~RootFileLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace mixprec::checkpoint
