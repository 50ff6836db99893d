// The process's memory as the operating system sees it: what glibc's malloc does with the
// memory a step frees, and the page faults that show what that costs.
//
// glibc gives freed memory back to the system: blocks above its mmap threshold are mapped and
// unmapped one by one, and free space at the top of its heap beyond the trim threshold is
// returned. Both thresholds start low (128 and 256 KiB) and rise only to the size of a mapped
// block once it is freed. A training step frees megabytes of activations and temporaries and
// asks for them again in the next step, so with glibc's defaults every step maps fresh pages
// and the kernel zeroes each one on first touch: about 1,400 page faults a step on
// mixprec-train's default model, 3–9% of the step on the 2-core development machine and 8–10%
// on a 16-core one. "keep" serves every block up to 32 MiB (glibc's largest mmap threshold)
// from the heap and never trims it, as a caching allocator would: a steady step then touches
// no new pages (0 faults in the median step). On the default model peak RSS is unchanged: the
// heap keeps what the worst step needed. With larger steps the kept heap fragments: at --batch 64
// --seq-len 256 (30 steps) peak RSS was 949 MiB against 835, for 2–8% more speed and 40 page
// faults in the median step against 23,795. Blocks over 32 MiB are still mapped per allocation.
#pragma once

#include <cstdint>
#include <string>

namespace train {

// Applies --malloc (`flag`: "keep", "system", or nullptr when not given, which means keep
// unless a GLIBC_TUNABLES in the environment sets a glibc.malloc threshold: that wins). Call
// it first thing in main, before the large allocations. Returns what is in force, for the
// start-up line. Invalid values are left to parse_args, which names them.
std::string set_malloc_policy(const char* flag);

// The GLIBC_TUNABLES value that gives another process "keep" (a benchmark's peer).
std::string keep_malloc_tunables();

// Minor page faults of this process so far, all threads: pages touched for the first time
// since they were mapped.
int64_t minor_page_faults();

}  // namespace train
