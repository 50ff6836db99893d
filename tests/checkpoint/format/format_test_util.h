// Helpers shared by the format-layer tests: scratch directories, deterministic bytes, file
// surgery for corruption tests, and a small but realistic sample checkpoint.
#pragma once

#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "support/remove_tree.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace mixprec::checkpoint::testing {

// A fresh directory under $TMPDIR, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "mixprec-format-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() { mixprec::testing::remove_tree(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// n bytes that depend on `seed` and position, so a misplaced byte range is always noticed.
inline std::vector<std::byte> pattern_bytes(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> out(n);
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (auto& b : out) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 16);
  }
  return out;
}

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// What a test checks to prove that a file outside a checkpoint root was neither written nor
// read: its bytes, modification time and access time. age_and_stamp() sets both times into
// the past: with the usual relatime mount option a later read then moves the access time;
// with noatime it does not, so the check never fails falsely, it can only miss a read.
struct FileStamp {
  std::string bytes;
  std::int64_t mtime_ns = 0;
  std::int64_t atime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};

// Readable failures instead of gtest's byte dumps.
inline void PrintTo(const FileStamp& s, std::ostream* out) {
  *out << "{" << s.bytes.size() << " bytes, mtime " << s.mtime_ns << ", atime " << s.atime_ns
       << "}";
}

// The file's times (taken first: reading moves the access time), then its bytes.
inline FileStamp current_stamp(const std::filesystem::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) throw std::runtime_error("lstat " + path.string());
  FileStamp out;
  out.mtime_ns = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
  out.atime_ns = st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec;
  out.bytes = read_file(path);
  return out;
}

// Reads the file, then sets its access time to one day after the epoch and its modification
// time to two days after, and returns the stamp an untouched file keeps.
inline FileStamp age_and_stamp(const std::filesystem::path& path) {
  FileStamp out;
  out.bytes = read_file(path);
  const struct timespec times[2] = {{86400, 0}, {2 * 86400, 0}};
  if (::utimensat(AT_FDCWD, path.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0) {
    throw std::runtime_error("utimensat " + path.string());
  }
  out.atime_ns = 86400LL * 1000000000LL;
  out.mtime_ns = 2 * 86400LL * 1000000000LL;
  return out;
}

// age_and_stamp() for every regular file under `dir`, by path.
inline std::map<std::filesystem::path, FileStamp> age_and_stamp_tree(
    const std::filesystem::path& dir) {
  std::map<std::filesystem::path, FileStamp> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out[e.path()] = age_and_stamp(e.path());
  }
  return out;
}

// current_stamp() of the files in `stamps`: equal to `stamps` if none was read or written.
inline std::map<std::filesystem::path, FileStamp> current_stamps(
    const std::map<std::filesystem::path, FileStamp>& stamps) {
  std::map<std::filesystem::path, FileStamp> out;
  for (const auto& [path, s] : stamps) out[path] = current_stamp(path);
  return out;
}

// Replaces `path` (a file or directory) by a symbolic link to `target`.
inline void replace_with_symlink(const std::filesystem::path& path,
                                 const std::filesystem::path& target) {
  mixprec::testing::remove_tree(path);
  std::filesystem::create_symlink(target, path);
}

// Replaces `path` by a FIFO. A reader that opens it without O_NONBLOCK blocks forever.
inline void replace_with_fifo(const std::filesystem::path& path) {
  mixprec::testing::remove_tree(path);
  if (::mkfifo(path.c_str(), 0644) != 0) throw std::runtime_error("mkfifo " + path.string());
}

// Replaces `path` by a character device node like /dev/null (1, 3). Returns false where the
// process may not create device nodes (no CAP_MKNOD), so the caller can skip.
inline bool replace_with_char_device(const std::filesystem::path& path) {
  mixprec::testing::remove_tree(path);
  return ::mknod(path.c_str(), S_IFCHR | 0644, makedev(1, 3)) == 0;
}

// Kills the process with SIGALRM if it is still in scope after `seconds`: a test of something
// that used to block forever (a FIFO opened for reading) then fails instead of hanging.
class AlarmGuard {
 public:
  explicit AlarmGuard(unsigned seconds) { ::alarm(seconds); }
  ~AlarmGuard() { ::alarm(0); }
  AlarmGuard(const AlarmGuard&) = delete;
  AlarmGuard& operator=(const AlarmGuard&) = delete;
};

// Runs `fn`, which must throw FormatError (or a subclass); returns the message.
template <class Fn>
std::string format_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a FormatError";
  return {};
}

// Expects `stmt` to throw FormatError whose message contains every listed fragment.
#define EXPECT_FORMAT_ERROR(stmt, ...)                                                       \
  do {                                                                                       \
    const std::string _msg = ::mixprec::checkpoint::testing::format_error_of([&] { stmt; }); \
    for (const std::string& _frag : std::vector<std::string>{__VA_ARGS__}) {                 \
      EXPECT_NE(_msg.find(_frag), std::string::npos)                                         \
          << "message lacks '" << _frag << "': " << _msg;                                    \
    }                                                                                        \
  } while (0)

// Writes, through the real API, a checkpoint with three keys spread over two data files
// into `staging`:
//   "w" F32 [6, 4] as two row chunks (one per file), written in 8-byte pieces;
//   "b" BF16 [10] in one chunk; "s" I64 [] (a scalar); common state {"step": seed}, inline or
//   (with `common_in_file`) in common.json; the manifest (with `sequence`) last.
inline void write_sample_files(CheckpointStaging& staging, std::uint64_t sequence,
                               std::uint32_t seed, bool common_in_file = false) {
  Manifest manifest;
  manifest.sequence = sequence;
  if (common_in_file) {
    const std::string common = nlohmann::json{{"step", seed}}.dump() + "\n";
    staging.write_file("common.json", common);
    manifest.common_file = CommonFileRef{"common.json", common.size(), xxh3_64(as_bytes(common))};
  } else {
    manifest.common = nlohmann::json{{"step", seed}};
  }
  auto write = [&](const std::string& file, const std::vector<TensorSpec>& specs) {
    SafetensorsWriter writer(staging.directory(), file, specs, {{"writer", "format_tests"}});
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto bytes = pattern_bytes(specs[i].byte_size(), seed * 31 + static_cast<std::uint32_t>(i));
      for (std::size_t at = 0; at < bytes.size(); at += 8) {
        writer.write(specs[i].name,
                     std::span(bytes).subspan(at, std::min<std::size_t>(8, bytes.size() - at)));
      }
    }
    return writer.close();
  };
  auto w0 = write("data-0.safetensors", {{"w.0", Dtype::F32, {3, 4}}, {"b", Dtype::BF16, {10}}});
  auto w1 = write("data-1.safetensors", {{"w.1", Dtype::F32, {3, 4}}, {"s", Dtype::I64, {}}});
  manifest.keys["w"] = {Dtype::F32,
                        {6, 4},
                        {{"data-0.safetensors", "w.0", {{0, 0}, {3, 4}}, 48, w0[0].checksum},
                         {"data-1.safetensors", "w.1", {{3, 0}, {3, 4}}, 48, w1[0].checksum}}};
  manifest.keys["b"] = {
      Dtype::BF16, {10}, {{"data-0.safetensors", "b", {{0}, {10}}, 20, w0[1].checksum}}};
  manifest.keys["s"] = {Dtype::I64, {}, {{"data-1.safetensors", "s", {{}, {}}, 8, w1[1].checksum}}};
  staging.write_file(kManifestFileName, manifest_to_json(manifest));
}

// The sample checkpoint committed directly as <root>/<name> with the given sequence (no lock,
// no cleanup: the bare commit protocol of commit.h). Returns the committed directory.
inline std::filesystem::path write_sample_checkpoint(const std::filesystem::path& root,
                                                     const std::string& name,
                                                     std::uint64_t sequence, std::uint32_t seed,
                                                     const CommitOptions& options = {},
                                                     bool common_in_file = false) {
  CheckpointStaging staging(root, name);
  write_sample_files(staging, sequence, seed, common_in_file);
  return staging.commit(options);
}

// PublishOptions with keep-last-K retention.
inline PublishOptions keep_last(std::size_t k) {
  PublishOptions options;
  options.keep_last = k;
  return options;
}

// A whole save of the sample checkpoint the way a training job does it: RootWriter (lock,
// stale staging, `latest` repair), stage, write, next sequence, publish. `opened`, if given,
// receives what opening the root reported.
inline PublishReport save_sample(const std::filesystem::path& root, const std::string& name,
                                 std::uint32_t seed, const PublishOptions& publish = {},
                                 const WriterOptions& writer_options = {},
                                 OpenReport* opened = nullptr) {
  RootWriter writer(root, writer_options);
  if (opened != nullptr) *opened = writer.report();
  auto staging = writer.stage(name);
  write_sample_files(*staging, writer.next_sequence(), seed);
  return writer.publish(*staging, publish);
}

}  // namespace mixprec::checkpoint::testing
