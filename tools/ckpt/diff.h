// `mixprec-ckpt diff A B`: how two checkpoints differ, key by key.
//
// For every key in both: if dtype and global shape agree, the values are compared element by
// element — bitwise first (so NaN == NaN with the same bits, and -0.0 != +0.0), and the
// largest |a − b| over the differing elements is reported, computed in double (NaN if one
// side is NaN there). Keys only in A, only in B, and dtype/shape mismatches are listed, and
// the common state (step, hyper-parameters, scaler, user metadata) is compared as JSON.
// The manifests' sequence numbers and the chunk layout are not compared: two saves of the
// same state on different rank counts are identical.
//
// Memory: keys are read in batches of at most 256 MiB per side (one key at a time if larger),
// and compared in slices, so the tool needs about twice the largest key, not the checkpoint.
// Reading verifies each chunk's checksum (load.h): a corrupt side is an error, not a diff.
#pragma once

#include <filesystem>
#include <ostream>

namespace mixprec::tools {

// Compares checkpoints `a` and `b` (already resolved directories) and writes the report.
// Returns kExitOk if identical, kExitFailed if they differ. Throws FormatError /
// ChecksumError / ToolError naming the file and key if either cannot be read; writes nothing
// to `out` then.
int run_diff(const std::filesystem::path& a, const std::filesystem::path& b, std::ostream& out);

}  // namespace mixprec::tools
