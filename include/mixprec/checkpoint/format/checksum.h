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
#include <vector>

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

// XXH3-64 of each consecutive `block_bytes` of a byte stream (the last block may be shorter),
// so that a reader of part of the stream can verify exactly the blocks it reads
// (manifest.h: "block_xxh3"). Feeding bytes in any number of pieces gives the same digests.
class BlockHasher {
 public:
  // Throws std::invalid_argument if block_bytes is 0.
  explicit BlockHasher(std::uint64_t block_bytes);

  void update(std::span<const std::byte> bytes);
  // The digests of every block so far, the unfinished last one included (none for an empty
  // stream); then starts over for a new stream.
  std::vector<std::uint64_t> finish();

  std::uint64_t block_bytes() const { return block_bytes_; }

 private:
  std::uint64_t block_bytes_;
  std::uint64_t in_block_ = 0;  // bytes of the current block fed so far
  Xxh3Hasher hasher_;
  std::vector<std::uint64_t> digests_;
};

// Number of blocks of `block_bytes` (≥ 1) that cover `bytes` bytes: ceil(bytes / block_bytes).
constexpr std::uint64_t block_count(std::uint64_t bytes, std::uint64_t block_bytes) {
  return bytes / block_bytes + (bytes % block_bytes != 0 ? 1 : 0);
}

// One-shot XXH3-64 of `bytes`.
std::uint64_t xxh3_64(std::span<const std::byte> bytes);

// 16 lowercase hex digits.
std::string checksum_to_hex(std::uint64_t checksum);

// Inverse of checksum_to_hex: exactly 16 hex digits (lowercase only, as written);
// nullopt otherwise.
std::optional<std::uint64_t> checksum_from_hex(std::string_view hex);

}  // namespace mixprec::checkpoint
