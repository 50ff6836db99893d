// Listing committed checkpoints, keep-last-K retention, and cleanup of stale staging.
//
// Commit order is the manifest's "sequence" field (manifest.h), not a timestamp or the name:
// next_sequence() returns one more than the largest sequence in the root, and the writer
// stores it in the manifest it commits. Clocks may jump; the sequence only grows.
//
// What counts as a committed checkpoint: a real directory (not a link, directory.h)
// <root>/<name> with a valid, unreserved name whose manifest.json is a regular file that
// parses. Anything else in the root — other files, links, directories without a parseable
// manifest — is never read beyond that and never touched by retention.
//
// Deleting is itself crash-safe: a victim is first renamed to a hidden staging name (and
// <root> fsynced), then removed; a crash mid-delete leaves a hidden directory, never a
// half-deleted one under a committed name.
//
// Stale staging. Staging directories and `latest` temporaries carry their writer's identity
// in their names (root_layout.h: host, boot id, pid). One left by a writer is stale — safe to
// remove — when
//   - its host is another host (or unknown: names of earlier versions) and nothing in it was
//     modified for `foreign_timeout` (mtime of the entry and of the files directly in it):
//     a writer on another host cannot be checked, only waited out;
//   - its host is this host but its boot id is not this boot's: that writer died with the
//     previous boot, even if its pid is in use again;
//   - it is from this boot and its pid is not a live process, or is a process that started
//     more than a second after the entry was last modified (the writer died and its pid was
//     given to another process: a pid from a container's small range soon is), or is this
//     process and no CheckpointStaging of this process owns it.
// This assumes host names are unique among the machines that share a root. The writer lock
// (root_writer.h) makes the question rare: a writer holds it for its whole save, so a lock
// holder only ever meets the leftovers of writers that are gone.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <chrono>
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
std::vector<CheckpointInfo> list_checkpoints(const Directory& root);

// 1 + the largest sequence among committed checkpoints (1 for an empty root).
std::uint64_t next_sequence(const std::filesystem::path& root);
std::uint64_t next_sequence(const Directory& root);

struct RetentionOptions {
  // Throws FormatError if keep_last is 0 (retention must never delete everything).
  explicit RetentionOptions(std::size_t keep_last = 3, std::set<std::string> in_use = {});

  std::size_t keep_last;         // ≥ 1: this many newest checkpoints are kept
  std::set<std::string> in_use;  // names never deleted (e.g. the one a job resumed from)
};

// Deletes committed checkpoints beyond the newest `keep_last`, never the one `latest` names
// and never one in `in_use`. Returns the deleted names, oldest first. Throws FormatError if
// `latest` is malformed (before deleting anything) or a rename/remove fails (checkpoints
// deleted before the failure stay deleted, and are listed in `deleted` when it is given;
// none is left half-deleted under its name). Only the root's one writer may call it.
std::vector<std::string> apply_retention(const std::filesystem::path& root,
                                         const RetentionOptions& options);
std::vector<std::string> apply_retention(const Directory& root, const RetentionOptions& options,
                                         std::vector<std::string>* deleted = nullptr);

struct StagingCleanupOptions {
  // Another host's (or an unknown writer's) leftover younger than this is kept.
  std::chrono::seconds foreign_timeout{3600};
};

// Removes the stale staging directories and `latest` temporaries under `root` (rule above)
// and returns their names, sorted. Links and anything else are never touched. Throws
// FormatError if one cannot be removed.
std::vector<std::string> clean_stale_staging(const std::filesystem::path& root,
                                             const StagingCleanupOptions& options = {});
std::vector<std::string> clean_stale_staging(const Directory& root,
                                             const StagingCleanupOptions& options = {});

}  // namespace mixprec::checkpoint
