// What picks LibTorch's CPU kernels on this machine. oneDNN chooses its BF16 GEMM kernels by
// the instruction sets the CPU has (AMX, AVX-512 BF16, AVX-512, AVX2), and ATen and MKL choose
// theirs likewise: on another CPU model the same step sums in another order, so a run resumed
// there goes on within rounding, not bit for bit. The environment variables that cap those
// choices count too.
#pragma once

#include <string>

namespace train {

// "<model name> [<the instruction sets above it has>]" and any capping variable set
// ("ONEDNN_MAX_CPU_ISA=AVX2"), from /proc/cpuinfo's first processor and the environment.
std::string cpu_kernel_identity();

// The same from the text of a /proc/cpuinfo and the capping variables' values as given by
// `getenv` (tests pass their own).
std::string cpu_kernel_identity(const std::string& cpuinfo, const char* (*getenv)(const char*));

}  // namespace train
