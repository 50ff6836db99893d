// Full verification of one checkpoint directory: manifest, every data file, every checksum.
//
// This is what `latest` must always point at, what the crash test checks after every kill,
// and what the `verify` command runs. It reads every byte once, in bounded memory.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <cstdint>
#include <filesystem>

namespace mixprec::checkpoint {

struct VerifyReport {
  std::size_t keys = 0;
  std::size_t files = 0;  // safetensors files opened (plus the common file, if any)
  std::size_t chunks = 0;
  std::uint64_t bytes = 0;  // tensor bytes hashed
};

// Parses <dir>/manifest.json, opens each referenced safetensors file once and checks that each
// chunk's tensor exists with the key's dtype, the chunk's shape and byte length, and that its
// XXH3-64 matches, and so does each block checksum (manifest version 2); that every tensor in
// those files is referenced by exactly one chunk; and the common file's size and checksum.
// Throws FormatError (ChecksumError for a mismatch) naming the file, key and tensor at fault.
// The directory and every file must be real: a link, FIFO or device is refused (directory.h).
VerifyReport verify_checkpoint(const std::filesystem::path& dir);
VerifyReport verify_checkpoint(const Directory& dir);

}  // namespace mixprec::checkpoint
