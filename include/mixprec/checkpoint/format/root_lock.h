// An exclusive lock on a file in a checkpoint root, held while the object lives.
//
// flock(LOCK_EX) on <root>/<name>: the writer lock of every save (`lock`, root_writer.h) and
// a training run's lock on its root for the whole run (`.run-lock`, root_layout.h: a program's
// choice; saves never take it). The file holds "<host> pid <pid>" of the last holder, written
// once the lock is taken, for the message of the next one that has to wait; it is never
// deleted. The lock belongs to the open file (flock semantics): another RootFileLock on the
// same file, in this process or another, conflicts; a child forked while it is held shares it
// until both close it; exec closes it (O_CLOEXEC). It dies with the process, so a killed
// holder never leaves a stale lock.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <chrono>
#include <string>
#include <string_view>

namespace mixprec::checkpoint {

class RootFileLock {
 public:
  // Opens (creating) <root>/<name> and takes it, waiting up to `timeout` (0: fail at once).
  // Throws FormatError naming the file and its holder if another holds it after that, saying
  // `what` the lock is for ("one writer per root").
  RootFileLock(const Directory& root, std::string_view name, std::chrono::milliseconds timeout,
               std::string_view what);
  ~RootFileLock();
  RootFileLock(const RootFileLock&) = delete;
  RootFileLock& operator=(const RootFileLock&) = delete;

  // "<host> pid <pid>" of whoever holds (or last held) the lock file at `path`, "" if unknown.
  static std::string holder(int fd);

 private:
  int fd_ = -1;
};

}  // namespace mixprec::checkpoint
