#include "mixprec/checkpoint/format/safetensors_reader.h"

#include "fail.h"
#include "hash_lane.h"
#include "mixprec/checkpoint/format/checksum.h"
#include "posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <vector>

namespace mixprec::checkpoint {
namespace {

using detail::fail;
using detail::HashLane;

// Streaming checksums read through a buffer of this size, so verifying a multi-GB tensor
// needs no more memory than this.
constexpr std::size_t kChecksumChunk = 4 << 20;
// Reads of at least this many bytes, in slices of kChecksumChunk, hash each slice on a second
// thread while the next one is read (hash_lane.h). Smaller ones would not repay the thread.
constexpr std::uint64_t kOverlapReadBytes = 2 * kChecksumChunk;
// Bytes read straight into the caller's memory are read in slices up to this size: the kernel
// keeps more of the disk busy for one large pread(2) than for a series of small ones.
constexpr std::size_t kInPlaceSlice = std::size_t{64} << 20;

}  // namespace

SafetensorsReader::SafetensorsReader(std::filesystem::path path) : path_(std::move(path)) {
  const Directory dir =
      Directory::open(detail::parent_directory(path_), Directory::Last::kMayBeLink);
  detail::UniqueFd fd =
      detail::open_regular_at(dir.fd(), path_.filename().string(), O_RDONLY, path_);
  parse_header(fd.get());
  fd_ = fd.release();
}

SafetensorsReader::SafetensorsReader(const Directory& dir, std::string_view file_name)
    : path_(dir / file_name) {
  detail::UniqueFd fd = detail::open_regular_at(dir.fd(), file_name, O_RDONLY, path_);
  parse_header(fd.get());
  fd_ = fd.release();
}

void SafetensorsReader::parse_header(int fd) {
  const std::uint64_t size = detail::file_size(fd, path_);
  if (size < 8) fail(path_.string(), ": ", size, " bytes is too short for a safetensors file");
  std::array<std::byte, 8> prefix;
  detail::pread_all(fd, 0, prefix, path_);
  const std::uint64_t n = decode_header_length(prefix);
  // Both checks come before allocating n bytes: a corrupt length must not become a huge
  // allocation.
  if (n > kMaxSafetensorsHeaderSize) {
    fail(path_.string(), ": header length ", n, " (bytes 0-7) exceeds the limit of ",
         kMaxSafetensorsHeaderSize);
  }
  if (n > size - 8) {
    fail(path_.string(), ": header length ", n, " (bytes 0-7) runs past the end of the ", size,
         "-byte file");
  }
  std::vector<std::byte> header_json(n);
  detail::pread_all(fd, 8, header_json, path_);
  header_ = parse_safetensors_header(header_json, size - 8 - n, path_.string());
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)), header_(std::move(other.header_)), fd_(other.fd_) {
  other.fd_ = -1;
}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    header_ = std::move(other.header_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

const TensorEntry& SafetensorsReader::tensor(std::string_view name) const {
  const TensorEntry* entry = header_.find(name);
  if (entry == nullptr) fail(path_.string(), ": no tensor '", name, "' in the file");
  return *entry;
}

void SafetensorsReader::pread_exact(std::uint64_t file_offset, std::span<std::byte> out,
                                    std::string_view tensor_name) const {
  if (fd_ < 0)
    fail(path_.string(), ": read of tensor '", tensor_name, "' from a moved-from reader");
  detail::pread_all(fd_, file_offset, out, path_);
}

void SafetensorsReader::read(std::string_view name, std::span<std::byte> out,
                             std::optional<std::uint64_t> expected_checksum) const {
  const TensorEntry& t = tensor(name);
  if (out.size() != t.byte_size()) {
    fail(path_.string(), ": tensor '", name, "' holds ", t.byte_size(),
         " bytes but the destination holds ", out.size());
  }
  if (!expected_checksum) {
    pread_exact(header_.data_offset() + t.begin, out, name);
    return;
  }
  // Hash each slice right after reading it, while it is still in cache: one trip through
  // memory instead of two for tensors larger than the cache.
  constexpr std::size_t kSlice = std::size_t{4} << 20;
  Xxh3Hasher hasher;
  for (std::size_t done = 0; done < out.size(); done += kSlice) {
    const std::span<std::byte> slice = out.subspan(done, std::min(kSlice, out.size() - done));
    pread_exact(header_.data_offset() + t.begin + done, slice, name);
    hasher.update(slice);
  }
  {
    const std::uint64_t actual = hasher.digest();
    if (actual != *expected_checksum) {
      throw ChecksumError(detail::concat("[mixprec::checkpoint] ", path_.string(), ": tensor '",
                                         name, "': checksum mismatch: expected xxh3 ",
                                         checksum_to_hex(*expected_checksum), ", got ",
                                         checksum_to_hex(actual), " (data corrupt)"));
    }
  }
}

void SafetensorsReader::read_range(std::string_view name, std::uint64_t offset,
                                   std::span<std::byte> out) const {
  const TensorEntry& t = tensor(name);
  if (offset > t.byte_size() || out.size() > t.byte_size() - offset) {
    fail(path_.string(), ": tensor '", name, "': range [", offset, ", +", out.size(),
         ") is outside its ", t.byte_size(), " bytes");
  }
  pread_exact(header_.data_offset() + t.begin + offset, out, name);
}

std::uint64_t SafetensorsReader::read_verified(std::string_view name,
                                               const std::function<bool(ByteRun&)>& next,
                                               const TensorChecksums& sums) const {
  const TensorEntry& t = tensor(name);
  const std::uint64_t size = t.byte_size();
  if (sums.block_bytes > 0 && sums.blocks.size() != block_count(size, sums.block_bytes)) {
    fail(path_.string(), ": tensor '", name, "': ", sums.blocks.size(), " block checksums for ",
         size, " bytes in blocks of ", sums.block_bytes);
  }
  const std::uint64_t block = sums.block_bytes > 0 ? sums.block_bytes : size;
  const std::uint64_t base = header_.data_offset() + t.begin;

  // `cur` is the first run not completely filled yet; runs are pulled one at a time, so a
  // read of millions of tiny runs needs no list of them.
  ByteRun cur;
  bool have = false;
  std::uint64_t pulled_end = 0;
  std::size_t pulled = 0;
  auto advance = [&] {
    have = false;
    for (ByteRun run; next(run); ++pulled) {
      if (run.offset < pulled_end || run.offset > size || run.out.size() > size - run.offset) {
        fail(path_.string(), ": tensor '", name, "': range ", pulled, " [", run.offset, ", +",
             run.out.size(), ") overlaps the one before it or is outside its ", size, " bytes");
      }
      pulled_end = run.offset + run.out.size();
      if (!run.out.empty()) {
        cur = run;
        have = true;
        ++pulled;
        return;
      }
    }
  };
  auto end_of = [](const ByteRun& run) { return run.offset + run.out.size(); };

  // Slices that are not wholly inside one run are read into scratch: two buffers, so that the
  // next slice is read into one while the lane hashes the other.
  std::array<std::vector<std::byte>, 2> scratch;
  std::size_t next_scratch = 0;
  Xxh3Hasher hasher;
  std::string mismatch;              // the first block whose digest differs, found by the lane
  std::atomic<bool> corrupt{false};  // set (after `mismatch`) by the lane: stop reading
  std::uint64_t bytes_read = 0;
  advance();
  // Hashing overlaps reading where slices are large: a whole-chunk read, or blocks of at least
  // a slice. (Small blocks would hand the lane one tiny job each.)
  const bool overlap =
      have && block >= kChecksumChunk && size - cur.offset / block * block >= kOverlapReadBytes;
  HashLane lane(overlap);  // after everything its jobs touch: destroyed (joined) first
  try {
    for (std::uint64_t b = have ? cur.offset / block : 0; have && !corrupt.load();) {
      const std::uint64_t begin = b * block, end = std::min(size, begin + block);
      lane.run([&hasher] { hasher.reset(); });
      for (std::uint64_t pos = begin; pos < end;) {
        std::size_t len =
            static_cast<std::size_t>(std::min<std::uint64_t>(kChecksumChunk, end - pos));
        std::span<std::byte> slice;
        if (have && cur.offset <= pos && pos + len <= end_of(cur)) {
          // Entirely wanted: read straight into place, in large pieces. With the lane, at most
          // half of what is left of the tensor (at least a checksum slice): each piece is
          // hashed while the next is read, and the last piece of a whole read, whose hash
          // nothing hides, is one checksum slice rather than all of a tensor under
          // kInPlaceSlice. (Block and run ends need no short piece: the lane goes on hashing
          // while the next block or run is read.)
          const std::uint64_t piece =
              overlap ? std::clamp<std::uint64_t>((size - pos) / 2, kChecksumChunk, kInPlaceSlice)
                      : kInPlaceSlice;
          len = static_cast<std::size_t>(std::min({piece, end - pos, end_of(cur) - pos}));
          slice = cur.out.subspan(static_cast<std::size_t>(pos - cur.offset), len);
          pread_exact(base + pos, slice, name);
          if (end_of(cur) == pos + len) advance();
        } else {
          // The lane is done with this buffer: run() waited for the job before the last one.
          std::vector<std::byte>& buffer = scratch[next_scratch];
          next_scratch ^= 1;
          if (buffer.size() < len) buffer.resize(len);
          slice = std::span(buffer).first(len);
          pread_exact(base + pos, slice, name);
          while (have && cur.offset < pos + len) {
            const std::uint64_t lo = std::max(pos, cur.offset);
            const std::uint64_t hi = std::min<std::uint64_t>(pos + len, end_of(cur));
            std::memcpy(cur.out.data() + (lo - cur.offset), slice.data() + (lo - pos),
                        static_cast<std::size_t>(hi - lo));
            if (hi < end_of(cur)) break;  // continues in the next slice
            advance();
          }
        }
        lane.run([&hasher, slice] { hasher.update(slice); });
        bytes_read += len;
        pos += len;
      }
      const std::uint64_t expected = sums.block_bytes > 0 ? sums.blocks[b] : sums.whole;
      lane.run([&, b, begin, end, expected] {
        const std::uint64_t actual = hasher.digest();
        if (actual == expected || !mismatch.empty()) return;
        const std::string which =
            sums.block_bytes > 0
                ? detail::concat(" in block ", b, " (bytes [", begin, ", ", end, ") of ", size, ")")
                : std::string();
        mismatch = detail::concat("[mixprec::checkpoint] ", path_.string(), ": tensor '", name,
                                  "': checksum mismatch", which, ": expected xxh3 ",
                                  checksum_to_hex(expected), ", got ", checksum_to_hex(actual),
                                  " (data corrupt)");
        corrupt.store(true);
      });
      if (have) b = std::max(b + 1, cur.offset / block);
    }
    lane.drain();
  } catch (...) {
    // A corrupt block found before a later read failed is the error to report.
    try {
      lane.drain();
    } catch (...) {
    }
    if (corrupt.load()) throw ChecksumError(mismatch);
    throw;
  }
  if (corrupt.load()) throw ChecksumError(mismatch);
  return bytes_read;
}

std::uint64_t SafetensorsReader::read_verified(std::string_view name, std::span<const ByteRun> runs,
                                               const TensorChecksums& sums) const {
  std::size_t i = 0;
  return read_verified(
      name,
      [&](ByteRun& run) {
        if (i == runs.size()) return false;
        run = runs[i++];
        return true;
      },
      sums);
}

TensorDigests SafetensorsReader::digests(std::string_view name, std::uint64_t block_bytes) const {
  const TensorEntry& t = tensor(name);
  Xxh3Hasher hasher;
  std::optional<BlockHasher> blocks;
  if (block_bytes > 0) blocks.emplace(block_bytes);
  const std::size_t slice =
      static_cast<std::size_t>(std::min<std::uint64_t>(t.byte_size(), kChecksumChunk));
  // Two buffers: the next slice is read into one while the lane hashes the other.
  const bool overlap = t.byte_size() >= kOverlapReadBytes;
  std::array<std::vector<std::byte>, 2> buffers{std::vector<std::byte>(slice),
                                                std::vector<std::byte>(overlap ? slice : 0)};
  HashLane lane(overlap);  // joined before the buffers go
  std::size_t which = 0;
  for (std::uint64_t done = 0; done < t.byte_size();) {
    std::span<std::byte> piece(buffers[which].data(),
                               std::min<std::uint64_t>(slice, t.byte_size() - done));
    if (overlap) which ^= 1;  // without the lane each slice is hashed before the next is read
    pread_exact(header_.data_offset() + t.begin + done, piece, name);
    lane.run([&hasher, &blocks, piece] {
      hasher.update(piece);
      if (blocks) blocks->update(piece);
    });
    done += piece.size();
  }
  lane.drain();
  TensorDigests out;
  out.whole = hasher.digest();
  if (blocks) out.blocks = blocks->finish();
  return out;
}

std::uint64_t SafetensorsReader::checksum(std::string_view name) const {
  return digests(name, 0).whole;
}

}  // namespace mixprec::checkpoint
