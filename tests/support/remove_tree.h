// remove_tree: the tests' recursive delete, by path.
//
// Not std::filesystem::remove_all: PyTorch's pip wheels carry their own copy of libstdc++'s
// filesystem code and export it from LibTorch, so a test binary's calls can bind to that copy.
// The CUDA 13 wheel of torch 2.11 jumped to address 0 inside remove_all (seen on an H200
// machine, scripts/gpu-check.sh). The library's own removal serves instead.
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <exception>
#include <filesystem>

namespace mixprec::testing {

// Removes `path` and, for a directory, everything under it, without following symbolic links.
// Best effort (for cleanup): what cannot be removed stays; a missing path is no error.
inline void remove_tree(const std::filesystem::path& path) {
  const std::filesystem::path parent = path.has_parent_path() ? path.parent_path() : ".";
  try {
    checkpoint::Directory::open(parent, checkpoint::Directory::Last::kMayBeLink)
        .remove_tree(path.filename().string());
  } catch (const std::exception&) {
  }
}

}  // namespace mixprec::testing
