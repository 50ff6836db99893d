// Paths the build knows and a run may name: defined in a file examples/CMakeLists.txt generates
// (train/build_paths.cpp.in).
#pragma once

namespace train {

// The Python the build found (its venv's); "" if none.
extern const char* const kBuildPython;
// The source tree's scripts/plot_metrics.py, absolute: the summary's plot hint must work from
// any working directory.
extern const char* const kPlotScript;

}  // namespace train
