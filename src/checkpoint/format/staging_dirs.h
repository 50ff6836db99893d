// Hidden working directories of a checkpoint root: naming, ownership, crash-safe removal.
// Shared by commit.cpp (which creates them) and retention.cpp (which cleans them up).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace mixprec::checkpoint::detail {

// ".tmp-<name>-<pid>-<16 hex>" for this process, with fresh random digits.
std::string make_staging_dir_name(std::string_view name);

// The pid in a name made by make_staging_dir_name, or nullopt for any other name.
std::optional<long> staging_dir_pid(std::string_view dir_name);

// Ownership by live CheckpointStaging objects of this process (thread-safe).
void mark_owned(const std::string& dir_name);
void unmark_owned(const std::string& dir_name);
bool is_owned(const std::string& dir_name);

// Removes <root>/<name> so that no crash leaves it half-deleted under its own name: rename to
// a fresh hidden staging name, fsync <root>, then delete recursively. Throws FormatError.
void remove_directory_atomically(const std::filesystem::path& root, const std::string& name);

// Recursive delete that reports the path and error instead of std::filesystem's exception.
void remove_tree(const std::filesystem::path& dir);

}  // namespace mixprec::checkpoint::detail
