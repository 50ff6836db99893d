#include "gemm_cache.h"

#include <cstdlib>

namespace train {

std::string limit_gemm_descriptor_cache() {
  if (const char* given = std::getenv("LRU_CACHE_CAPACITY"); given != nullptr) {
    return std::string("ideep's GEMM descriptor cache: ") + given +
           " entries (LRU_CACHE_CAPACITY from the environment)";
  }
  ::setenv("LRU_CACHE_CAPACITY", "1", 1);
  return "ideep's GEMM descriptor cache: 1 entry (oneDNN's primitive cache holds them; "
         "LRU_CACHE_CAPACITY overrides)";
}

}  // namespace train
