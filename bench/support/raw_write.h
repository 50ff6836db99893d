// The disk's bound for a checkpoint save, written one way for every checkpoint benchmark
// (bench_checkpoint, bench_dist_checkpoint), so their "of raw" figures mean the same.
//
// raw_write(path, pieces) writes the pieces, in order, into one new file in write(2) calls of at
// most 64 MiB, asks the kernel to start writeback every 32 MiB (sync_file_range), then fsyncs
// and closes. The library's writer (src/checkpoint/format/safetensors_writer.cpp) starts
// writeback at the same interval, so that the disk works during the writes and the fsync waits
// for the tail only; a raw write that wrote everything first and then fsynced measured slower
// than the library's save (ours came out at 1.5x "raw"), which made the baseline no bound.
// Throws std::runtime_error naming the file and errno's message.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace mixprec::bench {

inline constexpr std::size_t kRawPiece = std::size_t{64} << 20;      // bytes per write(2)
inline constexpr std::size_t kRawWriteback = std::size_t{32} << 20;  // writeback started every

inline void raw_write(const std::filesystem::path& path,
                      const std::vector<std::span<const char>>& pieces) {
  // errno read before anything else can change it (the close on the way out).
  auto fail = [&](const char* what, int fd = -1, int error = errno) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error(std::string(what) + " " + path.string() + ": " +
                             (error != 0 ? std::strerror(error) : "wrote nothing"));
  };
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("open");
  std::size_t written = 0, writeback_from = 0;
  for (const std::span<const char> piece : pieces) {
    for (std::size_t done = 0; done < piece.size();) {
      const ssize_t n = ::write(fd, piece.data() + done, std::min(kRawPiece, piece.size() - done));
      if (n <= 0) fail("write", fd, n == 0 ? 0 : errno);
      done += static_cast<std::size_t>(n);
      written += static_cast<std::size_t>(n);
      if (written - writeback_from >= kRawWriteback) {
        ::sync_file_range(fd, static_cast<off64_t>(writeback_from),
                          static_cast<off64_t>(written - writeback_from), SYNC_FILE_RANGE_WRITE);
        writeback_from = written;
      }
    }
  }
  if (::fsync(fd) != 0) fail("fsync", fd);
  if (::close(fd) != 0) fail("close");
}

}  // namespace mixprec::bench
