#include "mixprec/checkpoint/format/checksum.h"

// Compiled in from the header (XXH_INLINE_ALL) rather than linked: the format library then
// needs no extra link dependency, and sanitizer/fuzzer builds instrument the hash code too.
#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef MIXPREC_XXH3_AVX2
#include "checksum_avx2.h"
#endif

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace mixprec::checkpoint {
namespace {

#ifdef MIXPREC_XXH3_AVX2
// Whether to run the AVX2 build (checksum_avx2.cpp): checked once, on first use. Initialising
// the CPU model first makes the check safe in a static initializer that runs before libgcc's.
bool use_avx2() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return avx2;
}
#endif

void update_xxh3(XXH3_state_t* state, std::span<const std::byte> bytes) {
#ifdef MIXPREC_XXH3_AVX2
  if (use_avx2()) return detail::avx2::xxh3_update(state, bytes.data(), bytes.size());
#endif
  // Only fails on a null state, which the callers rule out.
  (void)XXH3_64bits_update(state, bytes.data(), bytes.size());
}

}  // namespace

struct Xxh3Hasher::State {
  XXH3_state_t xxh;
};

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) { reset(); }
Xxh3Hasher::~Xxh3Hasher() = default;
Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&&) noexcept = default;

void Xxh3Hasher::update(std::span<const std::byte> bytes) { update_xxh3(&state_->xxh, bytes); }

std::uint64_t Xxh3Hasher::digest() const { return XXH3_64bits_digest(&state_->xxh); }

void Xxh3Hasher::reset() { (void)XXH3_64bits_reset(&state_->xxh); }

BlockHasher::BlockHasher(std::uint64_t block_bytes) : block_bytes_(block_bytes) {
  if (block_bytes == 0) throw std::invalid_argument("BlockHasher: block_bytes must be > 0");
}

void BlockHasher::update(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const std::size_t take =
        static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), block_bytes_ - in_block_));
    hasher_.update(bytes.first(take));
    bytes = bytes.subspan(take);
    in_block_ += take;
    if (in_block_ == block_bytes_) {
      digests_.push_back(hasher_.digest());
      hasher_.reset();
      in_block_ = 0;
    }
  }
}

std::vector<std::uint64_t> BlockHasher::finish() {
  if (in_block_ > 0) digests_.push_back(hasher_.digest());
  hasher_.reset();
  in_block_ = 0;
  return std::exchange(digests_, {});
}

std::uint64_t xxh3_64(std::span<const std::byte> bytes) {
#ifdef MIXPREC_XXH3_AVX2
  if (use_avx2()) return detail::avx2::xxh3_64(bytes.data(), bytes.size());
#endif
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string checksum_to_hex(std::uint64_t checksum) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(16, '0');
  for (int i = 15; i >= 0; --i, checksum >>= 4) {
    hex[static_cast<std::size_t>(i)] = kDigits[checksum & 15];
  }
  return hex;
}

std::optional<std::uint64_t> checksum_from_hex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  std::uint64_t value = 0;
  for (char c : hex) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    value = (value << 4) | static_cast<std::uint64_t>(digit);
  }
  return value;
}

}  // namespace mixprec::checkpoint
