// Durable, atomic publication of a checkpoint directory.
//
// Layout of a checkpoint root:
//
//   <root>/<name>/                     committed checkpoints (manifest.json + data files)
//   <root>/latest                      text file: the name of the newest committed checkpoint
//                                      and a newline; replaced atomically (latest.h)
//   <root>/.tmp-<name>-<pid>-<hex>/    staging (or being-deleted) directories; never loaded
//
// Commit protocol, in order (every step is a crash point, see crash_point.h):
//   1. files are written into <root>/.tmp-<name>-<pid>-<random>/ and each is fsynced;
//   2. commit() fsyncs every file again (cheap when already synced) and the staging directory;
//   3. renameat2(RENAME_NOREPLACE) moves it to <root>/<name>/ — the commit point: before it,
//      nothing named <name> exists; after it, the complete directory does. An existing
//      <root>/<name> is never replaced;
//   4. <root> is fsynced so the rename survives power loss;
//   5. `latest` is replaced atomically (write latest.tmp, fsync, rename, fsync <root>).
// A crash before 3 leaves only a hidden .tmp- directory; between 3 and 5, a committed
// checkpoint that `latest` does not name yet; `latest` always names a complete checkpoint.
//
// One writer per root at a time is assumed (one process, e.g. rank 0, commits); readers may
// run concurrently and see either the old or the new state.
#pragma once

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
  // Creates <root> if missing and a fresh staging directory in it. Throws FormatError if
  // `name` is not a valid name (manifest.h: is_valid_file_name), if <root>/<name> already
  // exists (checked again, atomically, at commit), or if a system call fails.
  CheckpointStaging(std::filesystem::path root, std::string name);
  // Uncommitted: removes the staging directory (best effort, never throws).
  ~CheckpointStaging();
  CheckpointStaging(const CheckpointStaging&) = delete;
  CheckpointStaging& operator=(const CheckpointStaging&) = delete;

  const std::filesystem::path& root() const { return root_; }
  const std::string& name() const { return name_; }
  // The staging directory; write files here (e.g. with SafetensorsWriter).
  const std::filesystem::path& dir() const { return dir_; }
  // dir() / file_name, after checking that file_name is a valid plain name.
  std::filesystem::path file(std::string_view file_name) const;

  // Creates dir()/file_name (must not exist), writes `bytes`, fsyncs and closes it.
  void write_file(std::string_view file_name, std::span<const std::byte> bytes);
  void write_file(std::string_view file_name, std::string_view text);

  // Runs steps 2–5 and returns <root>/<name>. Only regular files may be in the staging
  // directory. Throws FormatError naming the path and the failed call; if <root>/<name>
  // appeared meanwhile the message says the checkpoint already exists and nothing is
  // overwritten. After a throw the staging directory is still removed by the destructor.
  std::filesystem::path commit(const CommitOptions& options = {});

  bool committed() const { return committed_; }

 private:
  std::filesystem::path root_;
  std::string name_;
  std::filesystem::path dir_;
  bool committed_ = false;
};

// fsyncs the directory `dir` so that entries created, renamed or removed in it are durable.
// Throws FormatError naming the directory.
void fsync_directory(const std::filesystem::path& dir);

}  // namespace mixprec::checkpoint
