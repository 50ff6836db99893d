// Random-access reader of one safetensors file (layout: safetensors_header.h).
//
// Opening parses and strictly validates the header against the file's actual size; after
// that, reads use pread(2), so one reader can serve several threads and a resharding loader
// fetches only the byte ranges it needs. read() can verify a whole tensor's expected XXH3-64
// (from the manifest); read_verified() reads any set of byte ranges and verifies every byte
// it reads, using per-block checksums where the manifest has them (manifest.h, version 2).
#pragma once

#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/safetensors_header.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint {

// One contiguous range of a tensor's bytes wanted by read_verified: bytes
// [offset, offset + out.size()) of the tensor go to `out`.
struct ByteRun {
  std::uint64_t offset = 0;
  std::span<std::byte> out;
};

// The checksums a tensor's bytes are verified against: one XXH3-64 per `block_bytes` bytes
// (the last block may be shorter), or with block_bytes == 0 only the whole tensor's.
struct TensorChecksums {
  std::uint64_t whole = 0;
  std::uint64_t block_bytes = 0;
  std::span<const std::uint64_t> blocks;
};

// The digests of a tensor's bytes computed in one pass (for verification tools).
struct TensorDigests {
  std::uint64_t whole = 0;
  std::vector<std::uint64_t> blocks;  // one per block_bytes; empty when block_bytes == 0
};

class SafetensorsReader {
 public:
  // Opens `path` and validates its header. Throws FormatError naming the path (and tensor,
  // field or offset) if the file is missing, truncated, or fails any header check. `path`
  // itself must be a regular file, never a link, FIFO or device (directory.h); the directory
  // holding it is taken as given.
  explicit SafetensorsReader(std::filesystem::path path);
  // The file `file_name` (a plain name) of an open checkpoint directory, the same way.
  SafetensorsReader(const Directory& dir, std::string_view file_name);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  const std::filesystem::path& path() const { return path_; }

  // The tensor named `name`. Throws FormatError naming the file and the tensor if absent.
  const TensorEntry& tensor(std::string_view name) const;

  // Reads all of tensor `name` into `out`, whose size must equal the tensor's byte size.
  // With `expected_checksum`, hashes the bytes and throws ChecksumError naming the file, the
  // tensor and both checksums on mismatch (`out` then holds the corrupt bytes).
  void read(std::string_view name, std::span<std::byte> out,
            std::optional<std::uint64_t> expected_checksum = std::nullopt) const;

  // Reads bytes [offset, offset + out.size()) of tensor `name` (offset relative to the
  // tensor's first byte). Throws FormatError if the range is outside the tensor. No checksum.
  void read_range(std::string_view name, std::uint64_t offset, std::span<std::byte> out) const;

  // Fills the runs `next` produces (in increasing offset order, not overlapping, inside the
  // tensor; `next` returns false after the last) from tensor `name`, and verifies every byte
  // it reads. With sums.block_bytes > 0 it reads whole each checksum block the runs touch
  // and checks it against sums.blocks; with block_bytes == 0 it reads the whole tensor and
  // checks sums.whole. A mismatch throws ChecksumError naming the file, the tensor and, for a
  // block, its index and byte range; the runs' memory then holds unverified bytes (discard
  // it). Memory: two 4 MiB buffers besides the runs, however many runs there are. Reads of
  // 8 MiB or more hash on a second thread while the next slice is read. Returns the number of
  // tensor bytes read. Throws FormatError if a run is out of order or outside the
  // tensor, or if sums.blocks does not hold one checksum per block.
  std::uint64_t read_verified(std::string_view name, const std::function<bool(ByteRun&)>& next,
                              const TensorChecksums& sums) const;
  // The same for a list of runs.
  std::uint64_t read_verified(std::string_view name, std::span<const ByteRun> runs,
                              const TensorChecksums& sums) const;

  // XXH3-64 of tensor `name`'s bytes, streamed through a bounded buffer (for verify tools).
  std::uint64_t checksum(std::string_view name) const;

  // The whole-tensor XXH3-64 and, with block_bytes > 0, the per-block ones, in one pass
  // through two buffers of up to 4 MiB (hashing one on a second thread while reading the other
  // for tensors of 8 MiB or more).
  TensorDigests digests(std::string_view name, std::uint64_t block_bytes) const;

 private:
  // Validates the header of the open file `fd` (still owned by the caller) against its size.
  void parse_header(int fd);
  void pread_exact(std::uint64_t file_offset, std::span<std::byte> out,
                   std::string_view tensor_name) const;

  std::filesystem::path path_;
  SafetensorsHeader header_;
  int fd_ = -1;
};

}  // namespace mixprec::checkpoint
