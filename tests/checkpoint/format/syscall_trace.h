// A record of the durability-relevant system calls this process makes while a SyscallTrace is
// alive: write, fsync, fdatasync, rename, renameat, renameat2 and unlinkat, each with the
// absolute paths it acted on (file descriptors resolved through /proc/self/fd).
//
// syscall_trace.cpp defines those functions in the test executable itself. The dynamic linker
// binds the format layer's calls to the executable's definitions before libc's, so every call
// is seen; each records (only while a trace is alive) and then calls libc's (dlsym RTLD_NEXT).
// Link syscall_trace.cpp into its own test binary only: every other test in that binary would
// go through these functions too.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mixprec::checkpoint::testing {

struct SyscallEvent {
  std::string call;            // "write", "fsync", "rename", "unlink", "rmdir"
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

  // The calls recorded so far, in the order they returned successfully.
  std::vector<SyscallEvent> events() const;
};

}  // namespace mixprec::checkpoint::testing
