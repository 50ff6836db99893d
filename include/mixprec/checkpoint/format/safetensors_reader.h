// Random-access reader of one safetensors file (layout: safetensors_header.h).
//
// Opening parses and strictly validates the header against the file's actual size; after
// that, reads use pread(2), so one reader can serve several threads and a resharding loader
// fetches only the byte ranges it needs. Whole-tensor reads can verify an expected XXH3-64
// (from the manifest); partial reads cannot and do not.
#pragma once

#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/safetensors_header.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string_view>

namespace mixprec::checkpoint {

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

  // XXH3-64 of tensor `name`'s bytes, streamed through a bounded buffer (for verify tools).
  std::uint64_t checksum(std::string_view name) const;

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
