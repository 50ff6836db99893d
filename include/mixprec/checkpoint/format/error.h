// The one exception type of the checkpoint format layer.
//
// Every failure of this layer — a malformed header or manifest, a checksum mismatch, a failed
// system call — throws FormatError (or its subclasses ChecksumError, NoIntactCheckpointError,
// UnsupportedVersionError). The
// message always starts with "[mixprec::checkpoint]" and names what is at fault: the file path (or
// the in-memory source name the caller passed), the key or tensor, the JSON field or byte offset,
// and for system calls the call that failed with strerror(errno).
//
// Nothing in this layer calls exit() or abort() on bad input; the only deliberate process kill
// is the opt-in crash-testing hook (crash_point.h).
#pragma once

#include <stdexcept>
#include <string>

namespace mixprec::checkpoint {

// A checkpoint file, directory or pointer is malformed, missing, or could not be read/written.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bytes were read successfully but their XXH3-64 differs from the recorded checksum: the data
// is corrupt (bit rot, torn write, wrong file). Distinct so callers can report corruption
// differently from I/O errors or format bugs.
class ChecksumError : public FormatError {
 public:
  using FormatError::FormatError;
};

// A checkpoint root holds committed checkpoints, but none a load can take: no `latest` names
// one, and every one fails verification (the message names each and why). Distinct so that a
// tool reports damaged checkpoints as damage, not as a path that holds no checkpoint.
class NoIntactCheckpointError : public FormatError {
 public:
  using FormatError::FormatError;
};

// The checkpoint was written in a newer format version than this reader knows: it may well be
// intact, but nothing past its version field can be read. Distinct so that a tool does not
// call such a checkpoint corrupt.
class UnsupportedVersionError : public FormatError {
 public:
  using FormatError::FormatError;
};

}  // namespace mixprec::checkpoint
