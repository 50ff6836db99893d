// Durable, atomic publication of one checkpoint directory in a root (layout: root_layout.h).
//
// Commit protocol, in order (every step is a crash point, see crash_point.h):
//   1. files are written into a fresh <root>/.tmp-<name>@<owner>-<hex>/ and each is fsynced;
//   2. commit() fsyncs every file again (cheap when already synced) and the staging directory;
//   3. renameat2(RENAME_NOREPLACE) moves it to <root>/<name>/ — the commit point: before it,
//      nothing named <name> exists; after it, the complete directory does. An existing
//      <root>/<name> is never replaced;
//   4. <root> is fsynced so the rename survives power loss: the checkpoint is now durable;
//   5. `latest` is replaced atomically (latest.h) unless CommitOptions say otherwise.
// A crash before 3 leaves only a hidden staging directory (cleaned by the next writer,
// retention.h); between 3 and 5, a committed checkpoint that `latest` does not name yet
// (found again by newest_checkpoint.h, and `latest` repaired by the next writer:
// root_writer.h); `latest` always names a complete checkpoint.
//
// Everything is created and opened relative to the root's directory descriptor, never
// through a symbolic link (directory.h). The caller must be the root's one writer: a
// RootWriter (root_writer.h) holds the lock and runs this protocol for a whole save.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace mixprec::checkpoint {

struct CommitOptions {
  bool update_latest = true;  // step 5; false leaves `latest` as it is
};

// A checkpoint under construction. Create it, write files into dir(), then commit().
class CheckpointStaging {
 public:
  // Creates <root> if missing (each new directory's entry fsynced) and a fresh staging
  // directory in it. Throws FormatError if `name` is not a valid or is a reserved name
  // (root_layout.h: check_checkpoint_name), if <root>/<name> already exists (checked again,
  // atomically, at commit), or if a system call fails.
  CheckpointStaging(const std::filesystem::path& root, std::string name);
  // The same in an open root.
  CheckpointStaging(const Directory& root, std::string name);
  // Uncommitted: removes the staging directory (best effort, never throws).
  ~CheckpointStaging();
  CheckpointStaging(const CheckpointStaging&) = delete;
  CheckpointStaging& operator=(const CheckpointStaging&) = delete;

  const std::filesystem::path& root() const { return root_.path(); }
  const std::string& name() const { return name_; }
  // The staging directory; write files here (e.g. with SafetensorsWriter's Directory form).
  const std::filesystem::path& dir() const { return dir_.path(); }
  const Directory& directory() const { return dir_; }
  // dir() / file_name, after checking that file_name is a valid plain name.
  std::filesystem::path file(std::string_view file_name) const;

  // Creates dir()/file_name (must not exist), writes `bytes`, fsyncs and closes it.
  void write_file(std::string_view file_name, std::span<const std::byte> bytes);
  void write_file(std::string_view file_name, std::string_view text);

  // Runs steps 2–5 and returns <root>/<name>. Only regular files may be in the staging
  // directory. Throws FormatError naming the path and the failed call; if <root>/<name>
  // appeared meanwhile the message says the checkpoint already exists and nothing is
  // overwritten. A throw before the rename leaves the staging directory to the destructor;
  // a throw after it (root fsync, `latest`) leaves committed() true: the checkpoint exists.
  std::filesystem::path commit(const CommitOptions& options = {});

  bool committed() const { return committed_; }

 private:
  Directory root_;
  std::string name_;
  std::string dir_name_;  // the staging directory's name in the root
  Directory dir_;
  bool committed_ = false;
};

}  // namespace mixprec::checkpoint
