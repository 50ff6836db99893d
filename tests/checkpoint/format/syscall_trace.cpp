// The interposed system-call wrappers behind SyscallTrace (syscall_trace.h).
#include "syscall_trace.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <stdexcept>
#include <system_error>

namespace mixprec::checkpoint::testing {
namespace {

namespace fs = std::filesystem;

struct Recorder {
  std::atomic<bool> active{false};
  std::mutex mutex;
  fs::path under;
  std::vector<SyscallEvent> events;
  std::string broken;  // why a call could not be recorded (events() throws it)
};

// Constructed at first use: a wrapper may run before main().
Recorder& recorder() {
  static Recorder* r = new Recorder;  // never destroyed: wrappers may run during exit
  return *r;
}

// libc's definition of `name`, the next one after this executable's.
template <class Fn>
Fn real(const char* name) {
  void* symbol = ::dlsym(RTLD_NEXT, name);
  if (symbol == nullptr) std::abort();  // no libc function to forward to: nothing can work
  return reinterpret_cast<Fn>(symbol);
}

fs::path fd_path(int fd) {
  char buffer[4096];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(link.c_str(), buffer, sizeof(buffer));
  return n > 0 ? fs::path(std::string(buffer, static_cast<size_t>(n))) : fs::path();
}

// The path `name` names relative to `dir_fd`, its directory resolved as /proc/self/fd resolves
// a descriptor's (symbolic links followed), so that it compares with those.
fs::path at_path(int dir_fd, const char* name) {
  fs::path path;
  if (name[0] == '/') {
    path = name;
  } else if (dir_fd == AT_FDCWD) {
    std::error_code error;
    path = fs::current_path(error) / name;
  } else {
    return fd_path(dir_fd) / name;
  }
  std::error_code error;
  const fs::path parent = fs::weakly_canonical(path.parent_path(), error);
  return error ? path : parent / path.filename();
}

bool is_under(const fs::path& path, const fs::path& root) {
  const std::string p = path.string(), r = root.string();
  return p.size() >= r.size() && p.compare(0, r.size(), r) == 0 &&
         (p.size() == r.size() || p[r.size()] == '/');
}

bool tracing() { return recorder().active.load(std::memory_order_relaxed); }

// Records one call that succeeded, if a trace is alive and the call touched its tree. Never
// throws (some wrappers are noexcept): a failure to record marks the trace broken instead.
void record(const char* call, const fs::path& path, const fs::path& to = {}) noexcept {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.active.load() || !(is_under(path, r.under) || (!to.empty() && is_under(to, r.under)))) {
    return;
  }
  try {
    r.events.push_back({call, path, to});
  } catch (...) {
    if (r.broken.empty()) r.broken = std::string("a ") + call + " could not be recorded";
  }
}

// The paths of a wrapper's arguments, resolved before the call (a rename's source is gone
// after it); empty when nothing is traced, or when they cannot be resolved (the trace is then
// marked broken by record()).
template <class Fn>
fs::path resolved(const Fn& resolve) noexcept {
  if (!tracing()) return {};
  try {
    return resolve();
  } catch (...) {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.broken.empty()) r.broken = "a path could not be resolved";
    return {};
  }
}

}  // namespace

SyscallTrace::SyscallTrace(std::filesystem::path under) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.active.load()) throw std::logic_error("SyscallTrace: one trace at a time");
  r.under = fs::canonical(under);
  r.events.clear();
  r.broken.clear();
  r.active.store(true);
}

SyscallTrace::~SyscallTrace() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.active.store(false);
}

std::vector<SyscallEvent> SyscallTrace::events() const {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.broken.empty()) throw std::runtime_error("SyscallTrace: " + r.broken);
  return r.events;
}

}  // namespace mixprec::checkpoint::testing

// The wrappers: libc's signatures, exception specifications included (glibc marks the calls
// that are not cancellation points __THROW). errno is what libc's call left.
namespace trace = mixprec::checkpoint::testing;

// Every call that writes a file's data is a "write": the format layer uses write(), and a
// switch to another must not make the last write look earlier than it is. `libc` is the
// caller's own (each wrapper resolves its function once).
template <class Fn, class... Args>
static ssize_t traced_write(Fn libc, int fd, Args... args) {
  const ssize_t n = libc(fd, args...);
  if (n > 0 && trace::tracing()) {
    const int saved = errno;
    trace::record("write", trace::resolved([&] { return trace::fd_path(fd); }));
    errno = saved;
  }
  return n;
}

// fsync and fdatasync, recorded under their own names.
static int traced_sync(int (*libc)(int), const char* call, int fd) {
  const int rc = libc(fd);
  if (rc == 0 && trace::tracing()) {
    trace::record(call, trace::resolved([&] { return trace::fd_path(fd); }));
  }
  return rc;
}

extern "C" ssize_t write(int fd, const void* buffer, size_t count) {
  static const auto libc = trace::real<ssize_t (*)(int, const void*, size_t)>("write");
  return traced_write(libc, fd, buffer, count);
}

extern "C" ssize_t pwrite(int fd, const void* buffer, size_t count, off_t offset) {
  static const auto libc = trace::real<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite");
  return traced_write(libc, fd, buffer, count, offset);
}

extern "C" ssize_t pwrite64(int fd, const void* buffer, size_t count, off64_t offset) {
  static const auto libc = trace::real<ssize_t (*)(int, const void*, size_t, off64_t)>("pwrite64");
  return traced_write(libc, fd, buffer, count, offset);
}

extern "C" ssize_t writev(int fd, const struct iovec* pieces, int count) {
  static const auto libc = trace::real<ssize_t (*)(int, const struct iovec*, int)>("writev");
  return traced_write(libc, fd, pieces, count);
}

extern "C" ssize_t pwritev(int fd, const struct iovec* pieces, int count, off_t offset) {
  static const auto libc =
      trace::real<ssize_t (*)(int, const struct iovec*, int, off_t)>("pwritev");
  return traced_write(libc, fd, pieces, count, offset);
}

extern "C" int fsync(int fd) {
  static const auto libc = trace::real<int (*)(int)>("fsync");
  return traced_sync(libc, "fsync", fd);
}

extern "C" int fdatasync(int fd) {
  static const auto libc = trace::real<int (*)(int)>("fdatasync");
  return traced_sync(libc, "fdatasync", fd);
}

extern "C" int rename(const char* from, const char* to) noexcept {
  static const auto libc_rename = trace::real<int (*)(const char*, const char*)>("rename");
  const auto from_path = trace::resolved([&] { return trace::at_path(AT_FDCWD, from); });
  const auto to_path = trace::resolved([&] { return trace::at_path(AT_FDCWD, to); });
  const int rc = libc_rename(from, to);
  if (rc == 0 && trace::tracing()) trace::record("rename", from_path, to_path);
  return rc;
}

extern "C" int renameat(int from_dir, const char* from, int to_dir, const char* to) noexcept {
  static const auto libc_renameat =
      trace::real<int (*)(int, const char*, int, const char*)>("renameat");
  const auto from_path = trace::resolved([&] { return trace::at_path(from_dir, from); });
  const auto to_path = trace::resolved([&] { return trace::at_path(to_dir, to); });
  const int rc = libc_renameat(from_dir, from, to_dir, to);
  if (rc == 0 && trace::tracing()) trace::record("rename", from_path, to_path);
  return rc;
}

extern "C" int renameat2(int from_dir, const char* from, int to_dir, const char* to,
                         unsigned int flags) noexcept {
  static const auto libc_renameat2 =
      trace::real<int (*)(int, const char*, int, const char*, unsigned int)>("renameat2");
  const auto from_path = trace::resolved([&] { return trace::at_path(from_dir, from); });
  const auto to_path = trace::resolved([&] { return trace::at_path(to_dir, to); });
  const int rc = libc_renameat2(from_dir, from, to_dir, to, flags);
  if (rc == 0 && trace::tracing()) trace::record("rename", from_path, to_path);
  return rc;
}

extern "C" int unlinkat(int dir, const char* name, int flags) noexcept {
  static const auto libc_unlinkat = trace::real<int (*)(int, const char*, int)>("unlinkat");
  const auto path = trace::resolved([&] { return trace::at_path(dir, name); });
  const int rc = libc_unlinkat(dir, name, flags);
  if (rc == 0 && trace::tracing()) {
    trace::record((flags & AT_REMOVEDIR) != 0 ? "rmdir" : "unlink", path);
  }
  return rc;
}
