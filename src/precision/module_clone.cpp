#include "mixprec/precision/module_clone.h"

#include "mixprec/precision/keep_fp32.h"

#include "precision/keep_record.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace mixprec {

std::shared_ptr<torch::nn::Module> clone_module(const torch::nn::Module& module) {
  std::shared_ptr<torch::nn::Module> copy = module.clone();
  auto carry = [&](const auto& source, const auto& target) {
    for (const auto& item : source) {
      const bool marked = is_kept_in_fp32(item.value());
      KeptFp32 kept = kept_fp32_reason(item.value());
      if (!marked && kept.reason == KeepReason::kNone) continue;
      const at::Tensor* twin = target.find(item.key());
      TORCH_CHECK(twin && twin->defined(), "[mixprec::clone_module] the clone of ", module.name(),
                  " has no tensor '", item.key(), "' to carry its keep_in_fp32 mark or reason to");
      if (marked) keep_in_fp32(*twin);
      detail::record_conversion_keep(*twin, kept.reason, std::move(kept.rule));
    }
  };
  carry(module.named_parameters(), copy->named_parameters());
  carry(module.named_buffers(), copy->named_buffers());
  return copy;
}

}  // namespace mixprec
