#include "mixprec/checkpoint/format/verify.h"

#include "fail.h"
#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"

#include <cstddef>
#include <map>
#include <set>
#include <vector>

namespace mixprec::checkpoint {

VerifyReport verify_checkpoint(const std::filesystem::path& dir) {
  return verify_checkpoint(Directory::open(dir));
}

VerifyReport verify_checkpoint(const Directory& dir) {
  using detail::fail;
  const Manifest manifest = read_manifest(dir);
  VerifyReport report;
  report.keys = manifest.keys.size();
  std::map<std::string, SafetensorsReader> readers;
  std::map<std::string, std::set<std::string>> referenced;  // file → tensors used by chunks
  for (const auto& [key, entry] : manifest.keys) {
    for (std::size_t i = 0; i < entry.chunks.size(); ++i) {
      const Chunk& chunk = entry.chunks[i];
      auto it = readers.find(chunk.file);
      if (it == readers.end()) {
        it = readers.try_emplace(chunk.file, dir, chunk.file).first;  // opened in `dir`
      }
      const SafetensorsReader& reader = it->second;
      const std::string where = detail::concat(reader.path().string(), ": key '", key, "' chunk ",
                                               i, " (tensor '", chunk.tensor, "')");
      const TensorEntry* t = reader.header().find(chunk.tensor);
      if (t == nullptr) fail(where, ": tensor not found in the file");
      if (t->dtype != entry.dtype) {
        fail(where, ": dtype is ", dtype_name(t->dtype), ", the manifest says ",
             dtype_name(entry.dtype));
      }
      if (t->shape != chunk.box.shape) {
        fail(where, ": shape is ", dims_to_string(t->shape), ", the manifest says ",
             dims_to_string(chunk.box.shape));
      }
      const TensorDigests actual = reader.digests(chunk.tensor, manifest.block_bytes);
      if (actual.whole != chunk.checksum) {
        throw ChecksumError(detail::concat("[mixprec::checkpoint] ", where,
                                           ": checksum mismatch: expected xxh3 ",
                                           checksum_to_hex(chunk.checksum), ", got ",
                                           checksum_to_hex(actual.whole), " (data corrupt)"));
      }
      // A resharded load trusts the block checksums alone: they must agree with the data too.
      for (std::size_t b = 0; b < actual.blocks.size(); ++b) {
        if (actual.blocks[b] != chunk.block_checksums.at(b)) {
          throw ChecksumError(detail::concat("[mixprec::checkpoint] ", where,
                                             ": checksum mismatch in block ", b, ": expected xxh3 ",
                                             checksum_to_hex(chunk.block_checksums[b]), ", got ",
                                             checksum_to_hex(actual.blocks[b]), " (data corrupt)"));
        }
      }
      // What a load refuses, verify refuses: a BOOL byte that is neither 0 nor 1 (a lookup of
      // the newest complete checkpoint trusts verify to say the checkpoint loads).
      if (entry.dtype == Dtype::BOOL) {
        std::vector<std::byte> bytes(t->byte_size());
        reader.read(chunk.tensor, bytes);
        for (std::size_t b = 0; b < bytes.size(); ++b) {
          if (std::to_integer<unsigned>(bytes[b]) > 1) {
            fail(where, ": BOOL element ", b, " (flat) holds byte ",
                 std::to_integer<unsigned>(bytes[b]), "; a bool must be 0 or 1");
          }
        }
      }
      referenced[chunk.file].insert(chunk.tensor);
      report.bytes += t->byte_size();
      ++report.chunks;
    }
  }
  // A tensor no chunk refers to means the manifest and the data disagree about what was saved.
  for (const auto& [file, reader] : readers) {
    for (const TensorEntry& t : reader.header().tensors) {
      if (referenced[file].count(t.name) == 0) {
        fail(reader.path().string(), ": tensor '", t.name, "' is not referenced by the manifest");
      }
    }
  }
  report.files = readers.size();
  if (manifest.common_file) {
    (void)read_common(dir, manifest);
    ++report.files;
  }
  return report;
}

}  // namespace mixprec::checkpoint
