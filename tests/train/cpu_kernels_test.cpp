// What picks the CPU kernels, as a resumed run compares it: the model, the instruction sets
// the kernels dispatch on, and the variables that cap them.
#include "cpu_kernels.h"

#include <gtest/gtest.h>

#include <cstring>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

constexpr const char* kCpuinfo =
    "processor\t: 0\n"
    "model name\t: Test CPU 9000\n"
    "flags\t\t: fpu sse avx2 avx512f avx512_bf16x amx_bf16 amx_tile\n"
    "\n"
    "processor\t: 1\n"
    "model name\t: Another CPU\n"
    "flags\t\t: fpu\n";

const char* nothing_set(const char*) { return nullptr; }
const char* onednn_capped(const char* name) {
  return std::strcmp(name, "ONEDNN_MAX_CPU_ISA") == 0 ? "AVX2" : nullptr;
}

TEST(CpuKernels, NamesTheModelTheKernelFlagsAndTheCaps) {
  // The first processor's; flags in a fixed order, whole words only ("avx512_bf16x" is not
  // avx512_bf16).
  EXPECT_EQ(cpu_kernel_identity(kCpuinfo, nothing_set),
            "Test CPU 9000 [avx2 avx512f amx_tile amx_bf16]");
  EXPECT_EQ(cpu_kernel_identity(kCpuinfo, onednn_capped),
            "Test CPU 9000 [avx2 avx512f amx_tile amx_bf16] ONEDNN_MAX_CPU_ISA=AVX2");
  EXPECT_EQ(cpu_kernel_identity("", nothing_set), "unknown CPU []");
  EXPECT_FALSE(cpu_kernel_identity().empty());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
