// The `latest` pointer of a checkpoint root (layout and protocol: commit.h).
//
// `<root>/latest` holds the name of a committed checkpoint directory followed by one '\n'.
// It is replaced atomically: the new content goes to `<root>/latest.tmp`, which is fsynced and
// renamed over `latest`, then <root> is fsynced. A reader therefore sees the old name or the
// new one, never a torn or empty file (a leftover latest.tmp is ignored and overwritten).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace mixprec::checkpoint {

inline constexpr std::string_view kLatestFileName = "latest";

// Points `latest` at <root>/<name>, which must be an existing directory with a manifest.json.
// Throws FormatError naming the path and the failed step.
void write_latest(const std::filesystem::path& root, std::string_view name);

// The checkpoint name in <root>/latest, or nullopt when there is no `latest` file. Throws
// FormatError if the file is unreadable, not "<valid name>\n" (manifest.h:
// is_valid_file_name — so no '/', "..", or hidden names), or names a directory that does not
// exist. Does not validate the checkpoint itself (verify.h does).
std::optional<std::string> read_latest(const std::filesystem::path& root);

}  // namespace mixprec::checkpoint
