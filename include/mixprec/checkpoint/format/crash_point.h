// Crash-testing hook: kill the process at the n-th durability-relevant step.
//
// The commit path (file writes, fsyncs, renames, `latest` update, retention deletes) calls
// detail::crash_point("label") before and after each step. The environment variable
// MIXPREC_CRASH_POINT controls what happens:
//   unset, empty or "0"  nothing (the normal case; the cost is one relaxed atomic increment);
//   "<n>"                the n-th call (counting from 1) raises SIGKILL — no destructors, no
//                        flushing, exactly like a power cut from the process's point of view
//                        (the page cache survives, which the fsync ordering already covers);
//   "list"               every call prints "mixprec crash point <n>: <label>" to stderr;
//   "slow:<label>:<ms>"  every call with that label sleeps <ms> milliseconds first: storage
//                        that is slow at that step (a commit's fsync, retention's deletes).
// The variable is read at the first call, or again by reset_crash_points().
// Not for production use; it exists so tests can prove that every prefix of a commit leaves
// a loadable checkpoint root, and that a slow step does not time a collective save out.
#pragma once

#include <cstdint>

namespace mixprec::checkpoint::detail {

// Counts one crash point and acts as configured above. Thread-safe. `label` must be a string
// literal (it is printed, never stored).
void crash_point(const char* label);

// Number of crash points reached since the start of the process or the last reset.
std::uint64_t crash_points_reached();

// Re-reads MIXPREC_CRASH_POINT and zeroes the counter (for a child after fork()).
void reset_crash_points();

}  // namespace mixprec::checkpoint::detail
