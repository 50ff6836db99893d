// The precision plan: which parameters and buffers of a module stay FP32.
//
// Three ways to say it, all honoured by convert_module_to_dtype_except_fp32_marked and
// Float16Module:
//   * on the tensor, `keep_in_fp32(t)` (keep_fp32.h) — travels with the tensor object;
//   * by fully qualified name, `plan.keep_fp32_name("layers.0.router.weight")`;
//   * by glob pattern over names, `plan.keep_fp32_pattern("*norm*")` (fnmatch(3) rules,
//     where `*` also crosses dots, as in Hugging Face's `_keep_in_fp32_modules`).
// Names and patterns live in the plan, not in the module, so they survive any copy, move,
// clone or reload of the module by construction.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace mixprec {

enum class TensorKind { kParameter, kBuffer };

// Why a tensor is kept in FP32 (kNone: it is not). After kNone, in precedence order: a tensor
// several rules keep is reported kept by the first of them here.
enum class KeepReason { kNone, kTensorMark, kName, kPattern };

const char* to_string(TensorKind kind);
const char* to_string(KeepReason reason);

// One tensor of a module as the plan sees it.
struct PlannedTensor {
  std::string name;   // fully qualified name, e.g. "blocks.0.norm.weight"
  TensorKind kind;    // parameter or buffer
  at::Tensor tensor;  // the module's own tensor (same TensorImpl)
  KeepReason reason;  // why it stays FP32, kNone for tensors the plan may cast
  std::string rule;   // the name or pattern that matched, empty otherwise
  // The name `rule` matched: this entry's own, or for a tied tensor kept through another of
  // its names, that name. Empty for a mark and for tensors not kept.
  std::string matched;
  bool shared = false;  // true if an earlier entry holds the same tensor (tied weights)
};

class PrecisionPlan {
 public:
  // Keeps the parameter or buffer with this fully qualified name in FP32. Checked when the
  // plan is resolved: a name that matches nothing is an error listing close matches.
  PrecisionPlan& keep_fp32_name(std::string fqn);

  // Keeps every floating parameter or buffer whose name matches `glob` in FP32.
  PrecisionPlan& keep_fp32_pattern(std::string glob);

  // Strict (the default): a pattern that matches no floating tensor is an error.
  // Non-strict: such patterns are listed in `unmatched_patterns` of resolve's result.
  PrecisionPlan& strict(bool on);

  const std::vector<std::string>& names() const { return names_; }
  const std::vector<std::string>& patterns() const { return patterns_; }
  bool is_strict() const { return strict_; }

  struct Resolved {
    std::vector<PlannedTensor> tensors;           // parameters first, then buffers, in order
    std::vector<std::string> unmatched_patterns;  // only ever non-empty when not strict
  };

  // Applies the plan to `module`'s parameters and buffers (undefined ones are skipped). A
  // tensor under several names (tied) is kept if any name is, every name with the strongest
  // reason of any (mark > name > pattern; see PlannedTensor::matched).
  // Throws c10::Error, naming every culprit at once, if a name matches nothing, a name or
  // tensor mark points at a non-floating tensor, or (strict) a pattern matches no tensor it
  // can keep (none, or only FP8 ones: the message names them).
  // Never modifies the module.
  Resolved resolve(const torch::nn::Module& module) const;

 private:
  std::vector<std::string> names_;
  std::vector<std::string> patterns_;
  bool strict_ = true;
};

}  // namespace mixprec
