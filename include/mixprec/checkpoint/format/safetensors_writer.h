// Streaming writer of one safetensors file (layout: safetensors_header.h).
//
// The caller declares every tensor up front, so the header — which precedes the data — is
// written first and the data can then be streamed without holding the whole file in memory.
// Tensors are written in the declared order; each tensor's bytes may come in any number of
// pieces. The XXH3-64 of each tensor — and, after checksum_blocks(), of each fixed-size block
// of it — is computed while its bytes go out, so verifying a checkpoint later never needs a
// second pass at save time.
//
// Durability: close() fsyncs the file before closing it. Making the file's directory entry
// durable is the job of the directory commit (commit.h), which fsyncs the directory.
//
//   SafetensorsWriter w(dir / "data-00000.safetensors", {{"a", Dtype::F32, {2, 3}}});
//   w.write("a", bytes_part1);
//   w.write("a", bytes_part2);
//   std::vector<WrittenTensor> written = w.close();   // checksums, for the manifest
#pragma once

#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/safetensors_header.h"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint {

// A tensor as written: its name and the XXH3-64 of its bytes.
struct WrittenTensor {
  std::string name;
  std::uint64_t byte_size = 0;
  std::uint64_t checksum = 0;
  std::vector<std::uint64_t> block_checksums = {};  // after checksum_blocks(), else empty
};

class SafetensorsWriter {
 public:
  // Validates `tensors` (see encode_safetensors_header), creates `path` — which must not exist
  // (O_EXCL: a writer never clobbers a file) — and writes the header.
  // Throws FormatError naming the path or the offending tensor; on throw no file is left.
  // The file is created with O_NOFOLLOW in the directory holding `path`, taken as given.
  SafetensorsWriter(std::filesystem::path path, std::vector<TensorSpec> tensors,
                    std::map<std::string, std::string> metadata = {});
  // The same for the file `file_name` (a plain name) in an open directory, e.g. a staging
  // directory (commit.h: CheckpointStaging::directory()): created relative to it, so no
  // rename or link swap of a path can redirect the write.
  SafetensorsWriter(const Directory& dir, std::string_view file_name,
                    std::vector<TensorSpec> tensors,
                    std::map<std::string, std::string> metadata = {});
  // Without a successful close(), the destructor closes and deletes the partial file
  // (best effort, never throws): a half-written file is never left looking complete.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Also computes the XXH3-64 of every `block_bytes` (> 0) of each tensor (BlockHasher in
  // checksum.h). Call before the first write(); throws FormatError otherwise.
  void checksum_blocks(std::uint64_t block_bytes);

  // Appends `piece` to tensor `name`, which must be the tensor currently being written: the
  // first declared tensor whose bytes are not all written yet (zero-byte tensors are complete
  // from the start: an empty write to one, as a loop over every tensor makes, does nothing).
  // Throws FormatError if `name` is out of order or unknown, if the piece would run past the
  // tensor's declared size, or if the write fails.
  void write(std::string_view name, std::span<const std::byte> piece);

  // Index into the declared tensors of the tensor currently being written; == tensor count
  // when all bytes are written.
  std::size_t current_tensor() const { return current_; }

  // Checks that every declared byte was written, flushes, fsyncs and closes the file.
  // Returns one entry per declared tensor, in declared order. Throws FormatError naming the
  // first incomplete tensor, or the failed system call. Call once.
  std::vector<WrittenTensor> close();

  const std::filesystem::path& path() const { return path_; }

 private:
  void advance_past_complete();
  void flush_buffer();
  void hash(std::span<const std::byte> piece);
  void write_out(std::span<const std::byte> bytes);
  void write_through(std::span<const std::byte> bytes);  // write(2), then start its writeback

  void remove_partial_file();

  std::filesystem::path path_;
  std::string file_name_;
  int dir_fd_ = -1;  // the directory holding the file, to remove a partial file again
  std::vector<TensorSpec> specs_;
  std::vector<WrittenTensor> written_;
  std::vector<std::byte> buffer_;  // coalesces small pieces into large write(2) calls
  std::size_t current_ = 0;
  std::uint64_t current_written_ = 0;
  Xxh3Hasher hasher_;
  std::optional<BlockHasher> block_hasher_;
  bool any_written_ = false;
  int fd_ = -1;
  std::uint64_t file_bytes_ = 0;      // written to the file so far
  std::uint64_t writeback_from_ = 0;  // where the writeback not yet started begins
  bool closed_ = false;
};

}  // namespace mixprec::checkpoint
