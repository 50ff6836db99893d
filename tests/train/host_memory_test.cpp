// --malloc: the kept thresholds serve a freed block again without page faults, and who decides
// (the flag, else a GLIBC_TUNABLES threshold, else keep).
#include "host_memory.h"

#include "support/test_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

constexpr const char* kKept = "freed memory kept for the next step (--malloc keep)";

// Allocates `bytes`, writes every page, frees them; returns the page faults that took.
int64_t faults_to_fill(size_t bytes) {
  const int64_t before = minor_page_faults();
  char* block = static_cast<char*>(std::malloc(bytes));
  EXPECT_NE(block, nullptr);
  if (block == nullptr) return 0;
  std::memset(block, 1, bytes);
  asm volatile("" : : "g"(block) : "memory");  // the writes happen: no elided malloc/free pair
  std::free(block);
  return minor_page_faults() - before;
}

// With glibc's defaults the second of these rounds maps (or grows the heap by) 24 MiB afresh:
// the first block was above the 128 KiB mmap threshold, so it was mapped, and unmapped when
// freed. Kept, the heap serves it and holds it after free: the next round touches no new page.
TEST(HostMemory, KeepServesAFreedBlockAgainWithoutPageFaults) {
  ASSERT_EQ(set_malloc_policy("keep"), kKept);
  constexpr size_t kBytes = size_t{24} << 20;  // 6,144 pages, under keep's 32 MiB
  faults_to_fill(kBytes);                      // the heap grows once
  const int64_t again = faults_to_fill(kBytes);
  EXPECT_LT(again, 64) << "a freed block came back from the system";
  EXPECT_LT(faults_to_fill(kBytes), 64);
}

using EnvironmentVariable = mixprec::test::ScopedEnvironmentVariable;

TEST(HostMemory, AnEnvironmentThresholdWinsUnlessTheFlagIsGiven) {
  EXPECT_EQ(set_malloc_policy("system"), "glibc's defaults (--malloc system)");
  {
    const EnvironmentVariable tunables("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=4096");
    EXPECT_EQ(set_malloc_policy(nullptr), "thresholds from GLIBC_TUNABLES (--malloc not given)");
    EXPECT_EQ(set_malloc_policy("keep"), kKept);
  }
  {
    const EnvironmentVariable tunables("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0");
    EXPECT_EQ(set_malloc_policy(nullptr), kKept) << "only a threshold there decides";
  }
  // What the benchmarks give a peer for the same policy.
  EXPECT_EQ(keep_malloc_tunables(),
            "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
