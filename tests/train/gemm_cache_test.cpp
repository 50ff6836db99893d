// The one-entry GEMM descriptor cache: set unless the environment decides, and said so.
#include "gemm_cache.h"

#include "support/test_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::test::ScopedEnvironmentVariable;

TEST(GemmCache, OneEntryUnlessTheEnvironmentSetsIt) {
  {
    // Whatever the test's own environment holds, restored after; unset for the first case.
    const ScopedEnvironmentVariable saved("LRU_CACHE_CAPACITY", "");
    ::unsetenv("LRU_CACHE_CAPACITY");
    const std::string said = limit_gemm_descriptor_cache();
    ASSERT_NE(std::getenv("LRU_CACHE_CAPACITY"), nullptr);
    EXPECT_STREQ(std::getenv("LRU_CACHE_CAPACITY"), "1");
    EXPECT_NE(said.find("1 entry"), std::string::npos) << said;
  }
  {
    const ScopedEnvironmentVariable given("LRU_CACHE_CAPACITY", "64");
    const std::string said = limit_gemm_descriptor_cache();
    EXPECT_STREQ(std::getenv("LRU_CACHE_CAPACITY"), "64") << "the environment's value wins";
    EXPECT_NE(said.find("64 entries (LRU_CACHE_CAPACITY from the environment)"), std::string::npos)
        << said;
  }
  // What the benchmark gives a peer for the same setting.
  EXPECT_STREQ(kGemmDescriptorCacheEnv, "LRU_CACHE_CAPACITY=1");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
