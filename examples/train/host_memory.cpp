#include "host_memory.h"

#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace train {
namespace {

constexpr int kMmapThreshold = 32 << 20;  // glibc's maximum on 64-bit systems
constexpr int kTrimThreshold = 1 << 30;   // in effect never: the heap holds the worst step

bool environment_sets_malloc_thresholds() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables == nullptr) return false;
  const std::string_view t = tunables;
  return t.find("glibc.malloc.trim_threshold") != std::string_view::npos ||
         t.find("glibc.malloc.mmap_threshold") != std::string_view::npos;
}

}  // namespace

std::string set_malloc_policy(const char* flag) {
  const std::string_view choice = flag != nullptr ? flag : "keep";
  if (choice == "system") return "glibc's defaults (--malloc system)";
  if (choice != "keep") return "";  // parse_args names the bad value
  if (flag == nullptr && environment_sets_malloc_thresholds())
    return "thresholds from GLIBC_TUNABLES (--malloc not given)";
#if defined(__GLIBC__)
  // Setting either threshold also stops glibc from moving them itself.
  if (::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 &&
      ::mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1) {
    return "freed memory kept for the next step (--malloc keep)";
  }
  return "glibc's defaults (it refused --malloc keep's thresholds)";
#else
  return "the C library's defaults (--malloc keep needs glibc)";
#endif
}

std::string keep_malloc_tunables() {
  char tunables[96];  // formatted, not concatenated: GCC 12 warns falsely (-Warray-bounds) there
  std::snprintf(tunables, sizeof tunables,
                "glibc.malloc.mmap_threshold=%d:glibc.malloc.trim_threshold=%d", kMmapThreshold,
                kTrimThreshold);
  return tunables;
}

int64_t minor_page_faults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

}  // namespace train
