// A record of the durability-relevant system calls this process makes while a SyscallTrace is
// alive: write, pwrite, writev, pwritev (all recorded as "write"), fsync, fdatasync, rename,
// renameat, renameat2 and unlinkat, each with the absolute paths it acted on (file descriptors
// resolved through /proc/self/fd, other paths' directories likewise).
//
// syscall_trace.cpp defines those functions in the test executable itself: the linker resolves
// the format layer's calls to them (statically linked, or through the executable's exported
// symbols for a shared library) before libc's, so every call is seen; each calls libc's
// (dlsym RTLD_NEXT) and records it, while a trace is alive, once it has returned. Link it into
// a test binary of its own only: every other test there would go through these functions too.
// Calls are recorded in the order they returned; across threads that is the order of their
// returns, not of their effects (a save's writes, fsyncs and renames run on one thread).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mixprec::checkpoint::testing {

struct SyscallEvent {
  std::string call;            // "write", "fsync", "fdatasync", "rename", "unlink", "rmdir"
  std::filesystem::path path;  // what it acted on (a rename's source)
  std::filesystem::path to;    // a rename's destination; empty otherwise
};

// Records the calls whose path lies under `under` while alive. One at a time per process.
class SyscallTrace {
 public:
  explicit SyscallTrace(std::filesystem::path under);
  ~SyscallTrace();
  SyscallTrace(const SyscallTrace&) = delete;
  SyscallTrace& operator=(const SyscallTrace&) = delete;

  // The calls recorded so far, in the order they returned successfully. Throws
  // std::runtime_error if a call could not be recorded (out of memory, a path unresolvable).
  std::vector<SyscallEvent> events() const;
};

}  // namespace mixprec::checkpoint::testing
