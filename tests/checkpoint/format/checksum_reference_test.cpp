// Our XXH3 (compiled in, and on x86-64 dispatched to an AVX2 build: checksum_avx2.cpp) against
// the system's libxxhash, built by Debian from xxHash's own sources with its own vector code:
// every checkpoint's checksums must be XXH3's, whichever code computed them.
#include "mixprec/checkpoint/format/checksum.h"

#include "format_test_util.h"

#ifdef XXH_INLINE_ALL
#error "the reference must be libxxhash.a's XXH3_64bits, not the header's inlined code"
#endif
#include <xxhash.h>  // without XXH_INLINE_ALL: the library's XXH3_64bits (libxxhash.a)

#if defined(__x86_64__)
namespace mixprec::checkpoint::detail::avx2 {  // checksum_avx2.cpp, which x86-64 builds compile
std::uint64_t xxh3_64(const void* data, std::size_t size);
}
#endif

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::pattern_bytes;

TEST(ChecksumReference, EqualsTheSystemLibxxhashAtEveryLengthAndSplit) {
  // Every length up to a few stripes' blocks (XXH3's long path starts at 241 bytes and works
  // in 1 KiB stripes and 64-byte lanes), then a few large ones.
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 4200; ++n) lengths.push_back(n);
  for (std::size_t n : {65536u + 17u, (1u << 20) + 123u, (9u << 20) + 5u}) lengths.push_back(n);
  const auto all = pattern_bytes(lengths.back(), 11);
  for (std::size_t n : lengths) {
    const std::span<const std::byte> bytes = std::span(all).first(n);
    const std::uint64_t reference = XXH3_64bits(bytes.data(), bytes.size());
    ASSERT_EQ(xxh3_64(bytes), reference) << "n=" << n;
#if defined(__x86_64__)
    // The AVX2 build itself, whether or not the dispatch picks it here.
    if (__builtin_cpu_supports("avx2")) {
      ASSERT_EQ(detail::avx2::xxh3_64(bytes.data(), bytes.size()), reference) << "n=" << n;
    }
#endif
    if (n % 97 != 0 && n < 4200) continue;  // streaming: a sample of lengths
    for (std::size_t piece : {1u, 63u, 1000u, 1u << 16}) {
      if (piece == 1 && n > 5000) continue;
      Xxh3Hasher hasher;
      for (std::size_t at = 0; at < n; at += piece) {
        hasher.update(bytes.subspan(at, std::min(piece, n - at)));
      }
      ASSERT_EQ(hasher.digest(), reference) << "n=" << n << " piece=" << piece;
    }
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
