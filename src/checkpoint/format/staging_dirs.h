// Hidden working entries of a checkpoint root: their names (root_layout.h), who wrote them,
// which this process owns, and crash-safe removal of a directory. Shared by commit.cpp and
// latest.cpp (which create them) and retention.cpp (which cleans them up).
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <optional>
#include <string>
#include <string_view>

namespace mixprec::checkpoint::detail {

// Who writes a staging entry: host name (sanitized, ≤ 64 characters), the first 16 hex
// digits of the kernel's boot id, and the pid.
struct WriterIdentity {
  std::string host;
  std::string boot;
  long pid = 0;
  bool operator==(const WriterIdentity&) const = default;
};

// This process (the pid is read on every call, so a forked child is itself).
WriterIdentity current_writer();

// "<host>@<boot>-<pid>".
std::string owner_tag(const WriterIdentity& writer);

// ".tmp-<name cut to 64>@<owner>-<16 hex>" for this process, with fresh random digits.
std::string make_staging_dir_name(std::string_view name);

// "latest.tmp-<owner>-<16 hex>" for this process.
std::string make_latest_temp_name();

// A name made by the two functions above (or a staging directory of an earlier version,
// ".tmp-<name>-<pid>-<16 hex>", whose writer is unknown).
struct LeftoverName {
  bool directory = true;                 // staging directory, else a `latest` temporary file
  std::optional<WriterIdentity> writer;  // nullopt for the earlier, host-less names
};
std::optional<LeftoverName> parse_leftover_name(std::string_view name);

// Ownership by live CheckpointStaging objects of this process (thread-safe).
void mark_owned(const std::string& dir_name);
void unmark_owned(const std::string& dir_name);
bool is_owned(const std::string& dir_name);

// Removes <root>/<name> so that no crash leaves it half-deleted under its own name: rename to
// a fresh hidden staging name, fsync <root>, then delete recursively. Throws FormatError.
void remove_directory_atomically(const Directory& root, const std::string& name);

}  // namespace mixprec::checkpoint::detail
