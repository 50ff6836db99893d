#include "mixprec/checkpoint/format/safetensors_writer.h"

#include "fail.h"
#include "hash_lane.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

namespace mixprec::checkpoint {
namespace {

using detail::crash_point;
using detail::fail;

// Pieces smaller than this are gathered before write(2): optimizer state has many tiny
// tensors (biases, norm scales), and one syscall each would dominate their cost.
constexpr std::size_t kBufferSize = 1 << 20;
// Hashing runs over slices of this size, so that with block checksums both hashers read each
// slice while it is in cache: one trip through memory for both.
constexpr std::size_t kHashSlice = 256 << 10;
// A piece at least this large is hashed on a second thread while this one writes it: the
// hash and the copy into the page cache overlap instead of adding up.
constexpr std::size_t kOverlapHashBytes = 4 << 20;
// Every this many bytes written, the kernel is asked to start writing them to disk
// (sync_file_range, Linux): the disk works while later bytes are written, and close()'s
// fsync waits only for the tail instead of the whole file.
constexpr std::uint64_t kWritebackBytes = 32 << 20;

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::vector<TensorSpec> tensors,
                                     std::map<std::string, std::string> metadata)
    : SafetensorsWriter(
          Directory::open(detail::parent_directory(path), Directory::Last::kMayBeLink),
          path.filename().string(), std::move(tensors), std::move(metadata)) {
  path_ = std::move(path);
}

SafetensorsWriter::SafetensorsWriter(const Directory& dir, std::string_view file_name,
                                     std::vector<TensorSpec> tensors,
                                     std::map<std::string, std::string> metadata)
    : path_(dir / file_name), file_name_(file_name), specs_(std::move(tensors)) {
  const std::string header = encode_safetensors_header(specs_, metadata, path_.string());
  written_.reserve(specs_.size());
  for (const TensorSpec& spec : specs_) written_.push_back({spec.name, spec.byte_size(), 0});

  crash_point("safetensors: before create");
  detail::UniqueFd fd =
      detail::open_regular_at(dir.fd(), file_name, O_WRONLY | O_CREAT | O_EXCL, path_);
  detail::UniqueFd dir_copy(::fcntl(dir.fd(), F_DUPFD_CLOEXEC, 0));
  if (dir_copy.get() < 0) {
    ::unlinkat(dir.fd(), file_name_.c_str(), 0);
    detail::fail_errno(dir.path(), "dup");
  }
  fd_ = fd.release();
  dir_fd_ = dir_copy.release();
  buffer_.reserve(kBufferSize);
  try {
    crash_point("safetensors: before header write");
    write_out(std::as_bytes(std::span(header)));
    flush_buffer();
    crash_point("safetensors: after header write");
    advance_past_complete();
  } catch (...) {
    remove_partial_file();
    ::close(std::exchange(dir_fd_, -1));  // the destructor does not run after a throw here
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!closed_) remove_partial_file();
  if (dir_fd_ >= 0) ::close(dir_fd_);
}

void SafetensorsWriter::remove_partial_file() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlinkat(dir_fd_, file_name_.c_str(), 0);
}

void SafetensorsWriter::advance_past_complete() {
  while (current_ < specs_.size() && current_written_ == written_[current_].byte_size) {
    written_[current_].checksum = hasher_.digest();
    hasher_.reset();
    if (block_hasher_) written_[current_].block_checksums = block_hasher_->finish();
    current_written_ = 0;
    ++current_;
  }
}

void SafetensorsWriter::checksum_blocks(std::uint64_t block_bytes) {
  if (any_written_) {
    fail(path_.string(), ": checksum_blocks() after the first write");
  }
  if (block_bytes == 0) fail(path_.string(), ": checksum_blocks(0): block size must be > 0");
  block_hasher_.emplace(block_bytes);
  // Tensors completed at construction (zero bytes) have no blocks: nothing to recompute.
}

void SafetensorsWriter::write(std::string_view name, std::span<const std::byte> piece) {
  if (closed_ || fd_ < 0) fail(path_.string(), ": write to tensor '", name, "' after close()");
  if (piece.empty() && std::any_of(written_.begin(), written_.end(), [&](const WrittenTensor& t) {
        return t.name == name && t.byte_size == 0;
      })) {
    return;  // a zero-byte tensor, complete from the start
  }
  if (current_ >= specs_.size()) {
    fail(path_.string(), ": write to tensor '", name, "' but every declared tensor is complete");
  }
  const WrittenTensor& target = written_[current_];
  if (name != target.name) {
    fail(path_.string(), ": write to tensor '", name, "' but tensor '", target.name,
         "' (declared #", current_,
         ") is not complete yet; tensors must be written in the "
         "declared order");
  }
  if (piece.size() > target.byte_size - current_written_) {
    fail(path_.string(), ": tensor '", name, "': ", piece.size(), "-byte write at byte ",
         current_written_, " runs past its declared size of ", target.byte_size, " bytes");
  }
  if (piece.empty()) return;
  any_written_ = true;
  {
    // The hashers are this tensor's alone and the bytes stay put until write() returns (the
    // lane is drained, or on an error joined, before it does).
    detail::HashLane lane(piece.size() >= kOverlapHashBytes);
    lane.run([this, piece] { hash(piece); });
    write_out(piece);
    lane.drain();
  }
  current_written_ += piece.size();
  crash_point("safetensors: after tensor piece");
  advance_past_complete();
}

void SafetensorsWriter::hash(std::span<const std::byte> piece) {
  for (std::size_t at = 0; at < piece.size(); at += kHashSlice) {
    const auto slice = piece.subspan(at, std::min(kHashSlice, piece.size() - at));
    hasher_.update(slice);
    if (block_hasher_) block_hasher_->update(slice);
  }
}

void SafetensorsWriter::write_through(std::span<const std::byte> bytes) {
  detail::write_all(fd_, bytes, path_);
  file_bytes_ += bytes.size();
#ifdef __linux__
  if (file_bytes_ - writeback_from_ >= kWritebackBytes) {
    // A hint: where the filesystem cannot (or need not) do it, close()'s fsync does it all.
    ::sync_file_range(fd_, static_cast<off64_t>(writeback_from_),
                      static_cast<off64_t>(file_bytes_ - writeback_from_), SYNC_FILE_RANGE_WRITE);
    writeback_from_ = file_bytes_;
  }
#endif
}

void SafetensorsWriter::write_out(std::span<const std::byte> bytes) {
  if (buffer_.size() + bytes.size() <= kBufferSize) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return;
  }
  flush_buffer();
  if (bytes.size() >= kBufferSize) {
    write_through(bytes);
  } else {
    buffer_.assign(bytes.begin(), bytes.end());
  }
}

void SafetensorsWriter::flush_buffer() {
  if (buffer_.empty()) return;
  write_through(buffer_);
  buffer_.clear();
}

std::vector<WrittenTensor> SafetensorsWriter::close() {
  if (closed_ || fd_ < 0) fail(path_.string(), ": close() called twice");
  if (current_ < specs_.size()) {
    fail(path_.string(), ": close() before tensor '", written_[current_].name, "' is complete (",
         current_written_, " of ", written_[current_].byte_size, " bytes written)");
  }
  flush_buffer();
  crash_point("safetensors: before fsync");
  detail::fsync_fd(fd_, path_);
  crash_point("safetensors: after fsync");
  detail::UniqueFd fd(fd_);
  fd_ = -1;
  closed_ = true;  // from here on the file is complete; never unlink it
  fd.close_checked(path_);
  return written_;
}

}  // namespace mixprec::checkpoint
