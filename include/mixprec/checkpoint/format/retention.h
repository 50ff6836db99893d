// Listing committed checkpoints, keep-last-K retention, and cleanup of stale staging dirs.
//
// Commit order is the manifest's "sequence" field (manifest.h), not a timestamp or the name:
// next_sequence() returns one more than the largest sequence in the root, and the writer
// stores it in the manifest it commits. Clocks may jump; the sequence only grows.
//
// What counts as a committed checkpoint: a directory <root>/<name> with a valid name whose
// manifest.json parses. Anything else in the root — other files, directories without a
// parseable manifest — is never touched by retention.
//
// Deleting is itself crash-safe: a victim is first renamed to a hidden
// .tmp-<name>-<pid>-<hex> directory (and <root> fsynced), then removed; a crash mid-delete
// leaves a hidden directory, never a half-deleted one under a committed name.
//
// A .tmp-<name>-<pid>-<hex> directory is stale — safe to remove — when <pid> is not a live
// process, or is this process and no CheckpointStaging of this process owns it. (A live
// process of another pid namespace sharing the filesystem is indistinguishable from a dead
// one, which is why one writer per root is assumed: commit.h.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

struct CheckpointInfo {
  std::string name;
  std::uint64_t sequence = 0;
};

// Committed checkpoints under `root`, oldest first (by sequence, then name). A missing root
// is an empty list. Throws FormatError if the root cannot be listed.
std::vector<CheckpointInfo> list_checkpoints(const std::filesystem::path& root);

// 1 + the largest sequence among committed checkpoints (1 for an empty root).
std::uint64_t next_sequence(const std::filesystem::path& root);

struct RetentionOptions {
  // Throws FormatError if keep_last is 0 (retention must never delete everything).
  explicit RetentionOptions(std::size_t keep_last = 3, std::set<std::string> in_use = {});

  std::size_t keep_last;         // ≥ 1: this many newest checkpoints are kept
  std::set<std::string> in_use;  // names never deleted (e.g. the one a job resumed from)
};

// Deletes committed checkpoints beyond the newest `keep_last`, never the one `latest` names
// and never one in `in_use`. Returns the deleted names, oldest first. Throws FormatError if
// `latest` is malformed (before deleting anything) or a rename/remove fails (checkpoints
// deleted before the failure stay deleted; none is left half-deleted under its name).
std::vector<std::string> apply_retention(const std::filesystem::path& root,
                                         const RetentionOptions& options);

// Removes stale .tmp-* directories under `root` (rule above) and returns their names.
// Throws FormatError if one cannot be removed.
std::vector<std::string> clean_stale_staging(const std::filesystem::path& root);

}  // namespace mixprec::checkpoint
