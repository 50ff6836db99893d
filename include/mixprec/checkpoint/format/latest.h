// The `latest` pointer of a checkpoint root (layout: root_layout.h; protocol: commit.h).
//
// `<root>/latest` is a regular file holding the name of a committed checkpoint directory
// followed by one '\n'. It is replaced atomically: the new content goes to a uniquely named
// `<root>/latest.tmp-<owner>-<hex>` created with O_EXCL | O_NOFOLLOW (so a planted file or
// link at any name is never opened, truncated or written through), which is fsynced and
// renamed over `latest`, then <root> is fsynced. A reader therefore sees the old name or the
// new one, never a torn or empty file. A temporary file left by a crash is removed as stale
// staging (retention.h).
//
// Only the root's one writer may call write_latest (root_writer.h holds the lock).
#pragma once

#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/root_layout.h"

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace mixprec::checkpoint {

// Points `latest` at <root>/<name>, which must be a real directory holding a regular
// manifest.json. Throws FormatError naming the path and the failed step (the temporary file
// is removed again on failure).
void write_latest(const std::filesystem::path& root, std::string_view name);
void write_latest(const Directory& root, std::string_view name);

// The checkpoint name in <root>/latest, or nullopt when there is no `latest` entry. Throws
// FormatError naming the path if `latest` is not a regular file (a link, FIFO, …), is not
// "<valid name>\n" (manifest.h: is_valid_file_name — so no '/', "..", or hidden names),
// names a reserved name, or names something that is not a real directory. Does not
// validate the checkpoint itself (verify.h does).
std::optional<std::string> read_latest(const std::filesystem::path& root);
std::optional<std::string> read_latest(const Directory& root);

}  // namespace mixprec::checkpoint
