// Reading a checkpoint directory back into a sharded state dict, resharding on the way.
//
// The reader decides, per key, which slice of the global tensor it needs (the whole tensor by
// default; a data-parallel rank asks for its own slice, see reshard.h). Only chunks that
// intersect the slice are touched, and from a chunk that is only partly needed only the
// byte ranges of the intersection are read: memory is bounded by the local slice.
//
// Checksums: every chunk read whole is verified against the manifest's XXH3-64 (a mismatch
// throws ChecksumError naming file, key and tensor). A chunk read only in part cannot be
// verified without reading all of it; `verify_checkpoint` (format/verify.h) checks everything.
#pragma once

#include "mixprec/checkpoint/format/box.h"
#include "mixprec/sharded_state_dict.h"

#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace mixprec::checkpoint {

struct ReadOptions {
  // The slice of key (global shape given) this reader needs; nullopt: the whole tensor.
  std::function<std::optional<Box>(const std::string& key, const std::vector<int64_t>& global_shape)>
      slice;
  // Keys to read; empty: every key in the manifest.
  std::set<std::string> keys;
};

// Which checkpoint a load of `path` reads, and why.
struct ResolvedCheckpoint {
  std::filesystem::path dir;
  // Empty normally. Otherwise why `dir` is not what <root>/latest names: a newer complete
  // checkpoint was found (a save ended between its commit and the `latest` update), or there
  // is no `latest`; plus newer checkpoints skipped because they do not verify.
  std::string note;
};

// The checkpoint directory `path` names: `path` itself if it holds a manifest.json (it must
// be a real directory, not a link); else `path` is a root and the result is its newest
// complete checkpoint (format/newest_checkpoint.h) — the one `latest` names, unless a newer
// one verifies. Never writes (the next save repairs `latest`). Throws FormatError naming the
// path if it is neither, or if `latest` is unusable (a link, FIFO, malformed, naming a link).
ResolvedCheckpoint find_checkpoint(const std::filesystem::path& path);

// find_checkpoint(path).dir.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// Reads the checkpoint in `dir` (manifest, common state, the requested slices): `dir` and
// every file in it must be real, not links, FIFOs or devices (format/directory.h). Throws
// FormatError / ChecksumError naming file and key, or c10::Error for a slice outside a key's
// global shape. Never returns partial data.
ShardedStateDict read_checkpoint(const std::filesystem::path& dir, const ReadOptions& options = {});

}  // namespace mixprec::checkpoint
