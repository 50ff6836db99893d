// Layout of a checkpoint root, and the names reserved in it.
//
//   <root>/lock                          the writer lock: one writer per root (root_writer.h)
//   <root>/.run-lock                     a training run's lock on its root for the whole run
//                                        (root_lock.h; the program's choice, saves ignore it)
//   <root>/latest                        text file: the name of the newest committed
//                                        checkpoint and one '\n' (latest.h)
//   <root>/latest.tmp-<owner>-<hex>      the next `latest` while it is written; renamed
//                                        over `latest` (a leftover is stale staging)
//   <root>/<name>/                       committed checkpoints: manifest.json (manifest.h),
//                                        data files, common.json
//   <root>/.tmp-<name>@<owner>-<hex>/    staging (or being-deleted) checkpoint directories
//
// <owner> is "<host>@<boot>-<pid>": the writer's host name (characters outside
// [A-Za-z0-9._-] become '_', at most 64), the first 16 hex digits of its kernel's boot id
// (/proc/sys/kernel/random/boot_id) and its pid; <hex> is 16 random hex digits; <name> is cut
// to 64 characters in staging names. Which leftovers are stale: retention.h.
//
// Reserved names: `latest`, every name starting with "latest." (temporary names, and the
// `latest.tmp` earlier versions used) and `lock` are never checkpoint names. Names starting
// with '.' are never valid names (manifest.h: is_valid_file_name).
//
// Everything in a root is a real directory or a regular file (directory.h): a symbolic link,
// FIFO or device in it is refused, never followed.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <filesystem>
#include <string_view>

namespace mixprec::checkpoint {

inline constexpr std::string_view kLatestFileName = "latest";
inline constexpr std::string_view kLatestTempPrefix = "latest.tmp-";
inline constexpr std::string_view kLockFileName = "lock";
inline constexpr std::string_view kRunLockFileName = ".run-lock";
inline constexpr std::string_view kStagingPrefix = ".tmp-";

// True for `latest`, `latest.*` and `lock`.
constexpr bool is_reserved_name(std::string_view name) {
  return name == kLatestFileName || name.starts_with("latest.") || name == kLockFileName;
}

// Throws FormatError naming <root> unless `name` is a valid (manifest.h: is_valid_file_name)
// and unreserved checkpoint name.
void check_checkpoint_name(const std::filesystem::path& root, std::string_view name);

// Opens the root at `root` (it may be reached through symbolic links, directory.h). With
// `create`, a missing root and missing parents are created first, each new directory's entry
// fsynced (a trailing separator does not change which). Throws FormatError naming the path.
Directory open_root(const std::filesystem::path& root, bool create = false);

}  // namespace mixprec::checkpoint
