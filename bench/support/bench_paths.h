// Where the benchmarks find their helpers on this machine: the source tree (Python peers), the
// project's Python and torchrun beside it. Compiled into one small generated file
// (bench/CMakeLists.txt, bench_paths.cpp.in): absolute paths in compile definitions would make
// every benchmark's object differ between two clones for the compiler cache. Empty strings
// where the build found none.
#pragma once

namespace mixprec::bench {

extern const char* const kSourceDir;
extern const char* const kPython;
extern const char* const kTorchrun;

}  // namespace mixprec::bench
