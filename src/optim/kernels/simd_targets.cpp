// Test hooks over Highway's run-time target choice (declared in kernel_args.h).
#include <c10/util/Exception.h>
#include <hwy/targets.h>

#include "optim/kernels/kernel_args.h"

namespace mixprec::optim::detail {

std::vector<std::string> supported_simd_targets() {
  std::vector<std::string> names;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    names.emplace_back(hwy::TargetName(target));
  }
  return names;
}

void force_simd_target(const std::string& name) {
  // Enumerate with any previous mock removed, so every compiled target can be chosen again.
  hwy::SetSupportedTargetsForTest(0);
  if (!name.empty()) {
    int64_t chosen = 0;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      if (name == hwy::TargetName(target)) chosen = target;
    }
    TORCH_CHECK(chosen != 0, "[mixprec::force_simd_target] target '", name,
                "' is not compiled in or not supported by this CPU");
    hwy::SetSupportedTargetsForTest(chosen);
  }
  // Dispatch tables read the chosen target; refresh it now rather than on the next call.
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

}  // namespace mixprec::optim::detail
