// manifest.json: the table of contents of one checkpoint directory.
//
// Format "mixprec-checkpoint", version 2 (UTF-8 JSON, one object):
//
//   {
//     "format": "mixprec-checkpoint",
//     "version": 2,
//     "sequence": 12,                       // commit order within a checkpoint root (≥ 1)
//     "block_bytes": 1048576,               // size of a checksum block (≥ 1), see block_xxh3
//     "common": { ... }                     // inline common state: any JSON object, or
//     "common_file": {"file": "common.json", "bytes": 311, "xxh3": "<16 hex>"},  // not both
//     "keys": {
//       "<key>": {
//         "dtype": "F32",                     // a safetensors dtype name (dtype.h)
//         "shape": [1024, 512],               // the global shape
//         "chunks": [
//           {"file": "data-00000.safetensors", // a file in the same directory
//            "tensor": "<name in that file>",
//            "offset": [0, 0],                // global offset of the chunk, per dim
//            "shape": [512, 512],             // local shape
//            "bytes": 1048576,                // product(shape) × element size
//            "xxh3": "0123456789abcdef",      // XXH3-64 of the chunk's bytes (checksum.h)
//            "block_xxh3": ["<16 hex>", ...]} // XXH3-64 of each block_bytes of those bytes
//         ]
//       }
//     }
//   }
//
// Version 2 adds "block_bytes" and each chunk's "block_xxh3": ceil(bytes / block_bytes)
// checksums, block i covering the chunk's bytes [i × block_bytes, (i + 1) × block_bytes) (the
// last one shorter). A reader that needs only part of a chunk (a resharded load) reads and
// verifies the blocks that part touches instead of the whole chunk. Version 1 is the same
// without those two fields; it is still read (a partial read then hashes the whole chunk) and
// written when a Manifest has block_bytes == 0.
//
// The common state (step, hyper-parameters, scaler, RNG state, user metadata) is opaque here.
// Parsing is strict: unknown or missing fields, wrong JSON types, duplicate member names,
// a different "format", or a version other than 1 or 2 are errors; a newer version is
// reported as such. Adding a field means bumping the version. Validation (also run by
// parse_manifest):
//   - key names non-empty; dtype known; dims ≥ 0 and element counts fit in 63 bits;
//   - file names are plain names in the checkpoint directory (see is_valid_file_name);
//   - every chunk has the key's rank, lies inside the global shape, has bytes equal to its
//     volume × element size, and no (file, tensor) pair is used by two chunks;
//   - with block_bytes > 0 every chunk has exactly ceil(bytes / block_bytes) block checksums;
//     with block_bytes == 0 none has any;
//   - the chunks of a key tile its global shape exactly: no gap, no overlap (box.h).
// The manifest is written last inside the staging directory; the directory rename commits it.
#pragma once

#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/dtype.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint {

inline constexpr std::string_view kManifestFormat = "mixprec-checkpoint";
// The newest version read and written. Version 1 (no block checksums) is still read, and
// written for a Manifest with block_bytes == 0.
inline constexpr int kManifestVersion = 2;
inline constexpr int kManifestVersionWithoutBlocks = 1;
inline constexpr std::string_view kManifestFileName = "manifest.json";
// The deepest nesting a reader accepts in manifest.json and common.json (the common state is
// opaque user JSON; the bound only stops pathological nesting). Saves refuse deeper states.
inline constexpr int kMaxJsonDepth = 256;

// One stored piece of a key: a tensor in a safetensors file and where it sits globally.
struct Chunk {
  std::string file;    // file name inside the checkpoint directory
  std::string tensor;  // tensor name inside that file
  Box box;             // global offset and local shape
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;  // XXH3-64 of the bytes
  // XXH3-64 of each Manifest::block_bytes of the bytes (empty when block_bytes == 0).
  std::vector<std::uint64_t> block_checksums = {};
};

// A logical tensor of the checkpoint (e.g. "optimizer.state.exp_avg.<fqn>").
struct KeyEntry {
  Dtype dtype = Dtype::F32;
  std::vector<std::int64_t> shape;  // global shape
  std::vector<Chunk> chunks;
  // The bytes of every chunk together: the key's size on disk.
  std::uint64_t bytes() const {
    std::uint64_t total = 0;
    for (const Chunk& chunk : chunks) total += chunk.bytes;
    return total;
  }
};

// A reference to the common state stored as its own file in the checkpoint directory.
struct CommonFileRef {
  std::string file;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;  // XXH3-64 of the whole file
};

struct Manifest {
  std::uint64_t sequence = 0;  // ≥ 1; assigned at save time, see retention.h
  // Size of the blocks of Chunk::block_checksums; 0: none (written as version 1).
  std::uint64_t block_bytes = 0;
  std::map<std::string, KeyEntry> keys;
  // Exactly one of the two: the common state inline (a JSON object), or a file reference.
  std::optional<nlohmann::json> common;
  std::optional<CommonFileRef> common_file;
};

// The version `manifest` is written as: kManifestVersion with block checksums, else
// kManifestVersionWithoutBlocks.
int manifest_version(const Manifest& manifest);

// True for a name that may appear as a file (or checkpoint directory) name: 1–200 characters
// from [A-Za-z0-9._-], not starting with '.', so never "", ".", "..", a hidden name or a path.
bool is_valid_file_name(std::string_view name);

// Checks everything listed above. Throws FormatError "<source>: key '<k>': chunk <i>: ...".
void validate_manifest(const Manifest& manifest, std::string_view source);

// Parses and validates manifest JSON text; `source` (a path or label) starts every error.
// Throws FormatError naming the source, key, chunk index and field at fault.
Manifest parse_manifest(std::string_view json_text, std::string_view source);

// Serializes a manifest (validated first; throws FormatError like validate_manifest).
// Output is deterministic: keys sorted, two-space indentation, trailing newline.
std::string manifest_to_json(const Manifest& manifest);

// Reads and parses <dir>/manifest.json. Throws FormatError naming the path. The directory
// and the file must be real (no links, FIFOs or devices: directory.h).
Manifest read_manifest(const std::filesystem::path& checkpoint_dir);
Manifest read_manifest(const Directory& checkpoint_dir);

// The common state of a checkpoint: the inline object, or <dir>/<common_file> read, checked
// against its recorded size and XXH3-64, and parsed. Throws FormatError/ChecksumError.
nlohmann::json read_common(const std::filesystem::path& checkpoint_dir, const Manifest& manifest);
nlohmann::json read_common(const Directory& checkpoint_dir, const Manifest& manifest);

}  // namespace mixprec::checkpoint
