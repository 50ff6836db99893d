// Private: the random generators' states a training checkpoint carries (state_keys.h:
// "rng.cpu", "rng.cuda.<index>"), checked before any is set.
#pragma once

#include "mixprec/sharded_state_dict.h"

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::checkpoint::detail {

// The default CPU generator's state, and each CUDA device's default generator's state where
// CUDA is available (nothing of CUDA is touched otherwise), under their keys.
std::map<std::string, at::Tensor> rng_states();

// RNG states read from the checkpoint at `dir`, checked against this process.
struct CheckedRng {
  at::Tensor cpu;
  std::vector<std::pair<int, at::Tensor>> cuda;  // device index, state
  LoadReport report;                             // notes: states ignored, devices left as they are
};

// Checks `states` (keys "rng.cpu", "rng.cuda.<index>"; "rng.rank.*" keys are ignored with a
// note): rng.cpu must be there and be a valid CPU generator state; a CUDA state is checked on a
// scratch generator of its device and restored there, or ignored with a note where this process has
// no CUDA or no such device. Throws c10::Error naming the key and `dir` otherwise.
CheckedRng check_rng(const std::map<std::string, at::Tensor>& states,
                     const std::filesystem::path& dir);

// Sets every checked state on its default generator. Cannot fail on the states' content.
void apply_rng(const CheckedRng& checked);

}  // namespace mixprec::checkpoint::detail
