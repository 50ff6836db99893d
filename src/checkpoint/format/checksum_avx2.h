// The AVX2 build of XXH3's hot calls (checksum_avx2.cpp). Include after xxhash.h with
// XXH_INLINE_ALL defined, which names XXH3_state_t.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mixprec::checkpoint::detail::avx2 {

void xxh3_update(XXH3_state_t* state, const void* data, std::size_t size);
std::uint64_t xxh3_64(const void* data, std::size_t size);

}  // namespace mixprec::checkpoint::detail::avx2
