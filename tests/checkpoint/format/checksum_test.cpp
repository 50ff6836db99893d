#include "mixprec/checkpoint/format/checksum.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::pattern_bytes;

TEST(Checksum, KnownValueOfEmptyInput) {
  // xxHash's own sanity-check vector for XXH3_64bits with no input and seed 0.
  EXPECT_EQ(xxh3_64({}), 0x2D06800538D394C2ull);
  EXPECT_EQ(Xxh3Hasher().digest(), 0x2D06800538D394C2ull);
}

TEST(Checksum, StreamingMatchesOneShotForAnySplit) {
  // Sizes straddle XXH3's internal thresholds (16, 128, 240 bytes, 1 KiB stripes).
  for (std::size_t n : {0u, 1u, 15u, 17u, 129u, 241u, 1024u, 5000u}) {
    const auto bytes = pattern_bytes(n, 7);
    const std::uint64_t expected = xxh3_64(bytes);
    for (std::size_t piece : {1u, 3u, 64u, 1000u}) {
      Xxh3Hasher hasher;
      for (std::size_t at = 0; at < n; at += piece) {
        hasher.update(std::span(bytes).subspan(at, std::min(piece, n - at)));
      }
      EXPECT_EQ(hasher.digest(), expected) << "n=" << n << " piece=" << piece;
    }
  }
}

TEST(Checksum, ResetStartsOverAndMovedHasherKeepsState) {
  const auto bytes = pattern_bytes(300, 1);
  Xxh3Hasher a;
  a.update(pattern_bytes(10, 2));
  a.reset();
  a.update(bytes);
  EXPECT_EQ(a.digest(), xxh3_64(bytes));
  Xxh3Hasher b = std::move(a);
  EXPECT_EQ(b.digest(), xxh3_64(bytes));
}

TEST(Checksum, HexRoundTripIsExactlySixteenLowercaseDigits) {
  EXPECT_EQ(checksum_to_hex(0x0123456789abcdefull), "0123456789abcdef");
  EXPECT_EQ(checksum_to_hex(0), "0000000000000000");
  EXPECT_EQ(checksum_from_hex("0123456789abcdef"), 0x0123456789abcdefull);
  EXPECT_EQ(checksum_from_hex("ffffffffffffffff"), ~0ull);
  for (std::string_view bad : {"", "0123456789abcde", "0123456789abcdef0", "0123456789ABCDEF",
                               "0x23456789abcdef", "0123456789abcdeg"}) {
    EXPECT_FALSE(checksum_from_hex(bad).has_value()) << bad;
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
