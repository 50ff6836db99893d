// Helpers shared by the format-layer tests: scratch directories, deterministic bytes, file
// surgery for corruption tests, and a small but realistic sample checkpoint.
#pragma once

#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
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
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
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

// Writes, through the real API, a checkpoint with three keys spread over two data files:
//   "w" F32 [6, 4] as two row chunks (one per file), written in 8-byte pieces;
//   "b" BF16 [10] in one chunk; "s" I64 [] (a scalar); inline common state {"step": seed}.
// Commits it as <root>/<name> with the given sequence and returns the committed directory.
inline std::filesystem::path write_sample_checkpoint(const std::filesystem::path& root,
                                                     const std::string& name,
                                                     std::uint64_t sequence, std::uint32_t seed,
                                                     const CommitOptions& options = {}) {
  CheckpointStaging staging(root, name);
  Manifest manifest;
  manifest.sequence = sequence;
  manifest.common = nlohmann::json{{"step", seed}};
  auto write = [&](const std::string& file, const std::vector<TensorSpec>& specs) {
    SafetensorsWriter writer(staging.file(file), specs, {{"writer", "format_tests"}});
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
  return staging.commit(options);
}

}  // namespace mixprec::checkpoint::testing
