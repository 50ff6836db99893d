// The safetensors container: layout, header encoding and strict header validation.
//
// File layout (https://github.com/huggingface/safetensors, format as of safetensors 0.4):
//
//   offset 0      u64 little-endian N: length of the JSON header in bytes
//   offset 8      N bytes of UTF-8 JSON, padded with trailing spaces (0x20) so that 8 + N is a
//                 multiple of 8 (the data section then starts 8-byte aligned)
//   offset 8 + N  the data section: every tensor's bytes, row-major, little-endian, packed
//                 back to back with no gaps, to the end of the file
//
// The JSON header is one object. Each member except "__metadata__" describes one tensor:
//   "<name>": {"dtype": "BF16", "shape": [4, 8], "data_offsets": [begin, end]}
// with begin/end relative to the start of the data section. The optional "__metadata__"
// member is an object of string → string.
//
// What the parser accepts (stricter than the Python package, never looser):
//   - N ≤ kMaxSafetensorsHeaderSize (100 MB) and 8 + N ≤ file size; the header starts with '{';
//   - well-formed JSON with no NUL byte, no duplicate member names at any level, nesting
//     depth ≤ 8;
//   - every tensor entry has exactly the three fields above; tensor names are non-empty;
//   - dtype is one of Dtype (dtype.h); every dimension is an integer in [0, 2^63);
//   - end − begin == product(shape) × element_size(dtype), with no overflow;
//   - sorted by offset, the tensors tile the data section exactly: the first starts at 0,
//     each starts where the previous ends, the last ends at the data section's size.
// Checksums are not stored in safetensors files; they live in the manifest (manifest.h).
#pragma once

#include "mixprec/checkpoint/format/dtype.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint {

// Header lengths above this are rejected before any allocation (the Python package's limit).
inline constexpr std::uint64_t kMaxSafetensorsHeaderSize = 100'000'000;

// What a writer is told about a tensor up front.
struct TensorSpec {
  std::string name;  // non-empty, not "__metadata__", unique within a file
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;  // each dim ≥ 0; {} is a scalar (one element)

  // product(shape) × element_size(dtype). Throws FormatError naming the tensor if a dim is
  // negative or the product overflows 64 bits.
  std::uint64_t byte_size() const;
};

// One tensor as laid out in a file.
struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // data_offsets[0], relative to the data section
  std::uint64_t end = 0;    // data_offsets[1]

  std::uint64_t byte_size() const { return end - begin; }
};

// A parsed, validated header.
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by name (so find() can binary-search)
  std::map<std::string, std::string> metadata;
  std::uint64_t header_size = 0;  // N
  std::uint64_t data_size = 0;    // bytes in the data section

  // Absolute file offset of the data section (8 + N).
  std::uint64_t data_offset() const { return 8 + header_size; }
  // The entry named `name`, or nullptr. O(log n).
  const TensorEntry* find(std::string_view name) const;
};

// Builds the first bytes of a file holding `tensors` in the given order: the 8-byte length,
// the JSON header and its space padding. The data section follows immediately and must be
// exactly sum(byte_size()) bytes. Throws FormatError "<source>: tensor '<name>': ..." for an
// invalid spec (empty or duplicate name, negative dim, overflow, invalid UTF-8) or a header
// over the size limit.
std::string encode_safetensors_header(const std::vector<TensorSpec>& tensors,
                                      const std::map<std::string, std::string>& metadata = {},
                                      std::string_view source = "safetensors header");

// Decodes the 8-byte little-endian header length at the start of a file.
std::uint64_t decode_header_length(std::span<const std::byte, 8> prefix);

// Parses and validates the JSON header text (the N bytes after the length prefix) of a file
// whose data section holds `data_size` bytes. `source` (a path or a label) starts every error
// message. Throws FormatError naming the source, the tensor and the field or byte offset.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> header_json,
                                           std::uint64_t data_size, std::string_view source);

// Parses a complete in-memory safetensors file: length prefix, header, and the data section's
// size (the rest of the buffer). Same checks as opening the file with SafetensorsReader.
SafetensorsHeader parse_safetensors_buffer(std::span<const std::byte> file_bytes,
                                           std::string_view source);

}  // namespace mixprec::checkpoint
