// XXH3 compiled for AVX2, which checksum.cpp calls where the CPU has it: twice the baseline
// (SSE2) build's speed on this project's machine, 10 against 5 GB/s hashing from memory and 25
// against 15 from cache. XXH3's result does not depend on the vector code that computes it.
//
// This file is compiled with -mavx2 (CMakeLists.txt) and includes nothing but xxhash.h, whose
// functions XXH_INLINE_ALL makes static: no AVX2 code can end up in a function another file
// links to, so nothing runs it on a CPU without AVX2.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checksum_avx2.h"

namespace mixprec::checkpoint::detail::avx2 {

void xxh3_update(XXH3_state_t* state, const void* data, std::size_t size) {
  (void)XXH3_64bits_update(state, data, size);
}

std::uint64_t xxh3_64(const void* data, std::size_t size) { return XXH3_64bits(data, size); }

}  // namespace mixprec::checkpoint::detail::avx2
