// Checksums of checkpoint bytes: XXH3-64 (xxHash's XXH3_64bits, seed 0).
//
// XXH3-64 runs at memory bandwidth, so hashing while writing and while reading costs almost
// nothing next to the I/O; it detects corruption, it is not a cryptographic signature.
// On disk a checksum is written as exactly 16 lowercase hex digits (most significant first),
// the same digits as Python's `xxhash.xxh3_64_hexdigest(data)`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace mixprec::checkpoint {

// Streaming XXH3-64. Feeding bytes in any number of pieces gives the same digest as hashing
// them at once. Movable, not copyable.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  ~Xxh3Hasher();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;
  Xxh3Hasher(const Xxh3Hasher&) = delete;
  Xxh3Hasher& operator=(const Xxh3Hasher&) = delete;

  void update(std::span<const std::byte> bytes);
  // Digest of everything fed so far; does not reset, more bytes may follow.
  std::uint64_t digest() const;
  // Starts over as if newly constructed.
  void reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// One-shot XXH3-64 of `bytes`.
std::uint64_t xxh3_64(std::span<const std::byte> bytes);

// 16 lowercase hex digits.
std::string checksum_to_hex(std::uint64_t checksum);

// Inverse of checksum_to_hex: exactly 16 hex digits (lowercase only, as written);
// nullopt otherwise.
std::optional<std::uint64_t> checksum_from_hex(std::string_view hex);

}  // namespace mixprec::checkpoint
