// Reading a checkpoint directory back into a sharded state dict, resharding on the way.
//
// The reader decides, per key, which slice of the global tensor it needs (the whole tensor by
// default; a data-parallel rank asks for its own slice, see reshard.h). Only chunks that
// intersect the slice are touched, and from a chunk that is only partly needed only the
// byte ranges of the intersection are read: memory is bounded by the local slice.
//
// Checksums: every byte a read uses is verified before the read returns. A chunk needed
// whole is checked against its XXH3-64. From a chunk needed only in part, the reader reads
// whole each checksum block the part touches (manifest version 2: blocks of
// SaveOptions::checksum_block_bytes, 1 MiB by default) and checks each block's XXH3-64, so it
// reads at most one block more than it needs at each end of each contiguous range; with a
// version-1 manifest (no block checksums) it reads and checks the whole chunk. A mismatch
// throws ChecksumError naming file, tensor (and key, where they differ) and the block. A
// corrupt byte that the read does not need is not read, so it is not noticed unless it shares
// a block with needed bytes; `verify_checkpoint` (format/verify.h) checks every byte.
//
// Before allocating any result tensor, every requested key's slice (or flat range) and the
// chunks it touches are checked (slice inside the shape, chunk tensors present with the manifest's
// dtype and shape, chunks covering the slice), so a damaged manifest fails on what it says,
// not on an allocation of the size it claims. BOOL data must hold only bytes 0 and 1.
#pragma once

#include "mixprec/checkpoint/format/box.h"
#include "mixprec/sharded_state_dict.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

// What a read cost: all tensor bytes read from data files were verified against checksums.
struct ReadStats {
  std::uint64_t bytes_read = 0;  // tensor bytes read from data files (all verified)
  std::uint64_t bytes_used = 0;  // of those, bytes that went into the result
};

struct ReadOptions {
  // The slice of key (global shape given) this reader needs; nullopt: the whole tensor.
  std::function<std::optional<Box>(const std::string& key,
                                   const std::vector<int64_t>& global_shape)>
      slice;
  // A flat range of key this reader needs instead (asked first; nullopt: `slice` decides):
  // the result is a flat ShardedTensor (sharded_state_dict.h) whose 1-D local tensor holds
  // elements [begin, end) of the key's row-major flattening, read as the boxes the range
  // decomposes into (format/box.h: flat_range_boxes), each verified as any slice is. An empty
  // range reads nothing and still checks the key's entry. A ZeRO-1 rank reads its pieces of
  // the optimizer state so (distributed/collective_checkpoint.h).
  std::function<std::optional<FlatRange>(const std::string& key,
                                         const std::vector<int64_t>& global_shape)>
      flat_range;
  // Keys to read; empty: every key in the manifest.
  std::set<std::string> keys;
  // If set, receives what the read cost (on success).
  ReadStats* stats = nullptr;
};

// Which checkpoint a load of `path` reads, and why.
struct ResolvedCheckpoint {
  std::filesystem::path dir;
  // Empty normally. Otherwise why `dir` is not what <root>/latest names: a newer complete
  // checkpoint was found (a save ended between its commit and the `latest` update), or there
  // is no `latest`; plus newer checkpoints skipped because they do not verify.
  std::string note;
  // The names of those skipped checkpoints, newest first (empty normally): `dir` is then the
  // newest but these.
  std::vector<std::string> skipped = {};
};

// The checkpoint directory `path` names: `path` itself if it holds a manifest.json (it must
// be a real directory, not a link); else `path` is a root and the result is its newest
// complete checkpoint (format/newest_checkpoint.h) — the one `latest` names, unless a newer
// one verifies. Never writes (the next save repairs `latest`). Throws FormatError naming the
// path if it is neither, or if `latest` is unusable (a link, FIFO, malformed, naming a link);
// NoIntactCheckpointError naming each checkpoint and why if the root has no `latest` and none
// of its committed checkpoints verifies.
ResolvedCheckpoint find_checkpoint(const std::filesystem::path& path);

// find_checkpoint(path).dir.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// Reads the checkpoint in `dir` (manifest, common state, the requested slices): `dir` and
// every file in it must be real, not links, FIFOs or devices (format/directory.h); a root is
// refused with an error that says so (resolve_checkpoint gives its checkpoint). Throws
// FormatError / ChecksumError naming file and key (FormatError for BOOL data other than 0/1),
// or c10::Error for a slice or flat range outside a key's global shape. Never returns partial data.
ShardedStateDict read_checkpoint(const std::filesystem::path& dir, const ReadOptions& options = {});

}  // namespace mixprec::checkpoint
