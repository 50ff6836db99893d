// remove_tree: the tests' recursive delete.
//
// Not std::filesystem::remove_all: PyTorch's pip wheels carry their own copy of libstdc++'s
// filesystem code and export it from LibTorch, so a test binary's calls can bind to that copy.
// The CUDA 13 wheel of torch 2.11 jumped to address 0 inside remove_all (seen on an H200
// machine, scripts/gpu-check.sh). The library and its tools never call it
// (checkpoint::Directory::remove_tree).
#pragma once

#include <ftw.h>
#include <stdio.h>

#include <filesystem>

namespace mixprec::testing {

// Removes `path` and, for a directory, everything under it, without following symbolic links.
// Best effort: what cannot be removed stays; a missing path is no error.
inline void remove_tree(const std::filesystem::path& path) {
  constexpr int kOpenDescriptors = 16;
  ::nftw(
      path.c_str(),
      [](const char* entry, const struct stat*, int, struct FTW*) {
        ::remove(entry);
        return 0;  // go on with the rest
      },
      kOpenDescriptors, FTW_DEPTH | FTW_PHYS);
}

}  // namespace mixprec::testing
