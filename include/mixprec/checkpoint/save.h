// Saving sharded state dicts as a checkpoint directory (format: checkpoint/format/manifest.h,
// docs/checkpoint-format.md).
//
// Each data-parallel rank writes the shards it owns (replica_id 0) into its own safetensors
// file, data-<rank>.safetensors; tensor bytes stream from the tensors' own memory with their
// XXH3-64 computed on the way (no staging copy: peak extra memory is the writer's buffer).
// Rank 0's common state goes to common.json; manifest.json, written last, lists every chunk.
// The directory is committed durably (checkpoint/format/commit.h): a crash at any point
// leaves the previous checkpoint loadable and never publishes a partial one.
//
// Each save is the root's one writer (checkpoint/format/root_writer.h): it holds the lock
// file <root>/lock for the whole save (a concurrent save gets a FormatError, or waits up to
// `lock_timeout`), first removes stale staging left by killed saves, and repairs `latest`
// when a newer complete checkpoint exists (a save killed between its commit and the `latest`
// update); the result says what it cleaned and repaired. Once the commit is durable, a
// failing `latest` update or retention no longer fails the save: they are `warnings`.
#pragma once

#include "mixprec/sharded_state_dict.h"

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

// 1 MiB. A resharded load reads at most one block more than it needs at each end of each
// partly needed chunk: a 3 → 2 reshard of bench_checkpoint's 1.07 GB state reads 1.6% more
// than it uses (64 KiB blocks: 0.03%, 4 MiB: 6.3%, whole-chunk checksums only: 33%), while
// the manifest grows by 32 bytes per block (32 KB per GB of state; 64 KiB blocks would add
// 512 KB per GB).
inline constexpr std::uint64_t kDefaultChecksumBlockBytes = std::uint64_t{1} << 20;

struct SaveOptions {
  // Point <root>/latest at the new checkpoint. false leaves `latest` as it is, which is what a
  // save that crashed between its commit and the `latest` update leaves: a load of the root
  // (find_checkpoint) takes the newest complete checkpoint, this one, and the next save points
  // `latest` at it. A checkpoint that must never be resumed from (an evaluation snapshot)
  // belongs in a root of its own.
  TORCH_ARG(bool, update_latest) = true;
  // > 0: keep-last-K retention after the commit.
  TORCH_ARG(std::size_t, keep_last) = 0;
  // Names retention must not delete (e.g. the one resumed from).
  TORCH_ARG(std::set<std::string>, in_use);
  // How long to wait while another writer holds the root's lock; 0: fail at once.
  TORCH_ARG(std::chrono::milliseconds, lock_timeout) = std::chrono::milliseconds{0};
  // Staging of another host younger than this is never removed (format/retention.h).
  TORCH_ARG(std::chrono::seconds, stale_staging_timeout) = std::chrono::seconds{3600};
  // Besides each chunk's XXH3-64, one per this many bytes of it (manifest version 2), so that
  // a resharded load verifies exactly the blocks it reads: it reads at most one block more
  // than it needs at each end of a partly needed chunk. 0: no block checksums (manifest
  // version 1, readable by older mixprec; a partial read then reads the whole chunk).
  TORCH_ARG(std::uint64_t, checksum_block_bytes) = kDefaultChecksumBlockBytes;
};

struct SaveResult {
  std::filesystem::path dir;  // <root>/<name>
  std::uint64_t tensor_bytes = 0;
  std::size_t files = 0;                       // data files written
  std::vector<std::string> deleted;            // removed by retention
  std::vector<std::string> cleaned_staging;    // stale staging of killed saves, removed
  std::optional<std::string> repaired_latest;  // `latest` was stale and was pointed here
  // Problems that did not fail the save: a `latest` update or retention that failed after
  // the commit was durable, an unusable `latest` that was replaced, a newer checkpoint
  // that does not verify. Empty normally; worth logging when not.
  std::vector<std::string> warnings;
};

// Writes `ranks` (one state dict per data-parallel rank; with no data parallelism, one) as
// the checkpoint <root>/<name>. The common state is rank 0's. Tensors may live on any device
// (non-CPU ones are copied to the host one at a time).
// Throws c10::Error before writing anything if a tensor's dtype cannot be stored, if shards of
// a key disagree on dtype or global shape, or if the replica-0 shards of a key do not tile it
// exactly (a shard written twice, or a gap); FormatError for I/O failures, a held lock, an
// invalid or reserved name (`latest`, `latest.*`, `lock`), or an existing <root>/<name>: a
// committed checkpoint is never overwritten, and the message says when <name> is committed
// already (resume from it, or save under another name). On any failure before the commit the
// staging directory is removed and the checkpoints in <root> are as before.
SaveResult save_checkpoint(const std::filesystem::path& root, const std::string& name,
                           const std::vector<const ShardedStateDict*>& ranks,
                           const SaveOptions& options = {});
SaveResult save_checkpoint(const std::filesystem::path& root, const std::string& name,
                           const ShardedStateDict& state, const SaveOptions& options = {});

}  // namespace mixprec::checkpoint
