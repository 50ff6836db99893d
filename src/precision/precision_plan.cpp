#include "mixprec/precision/precision_plan.h"

#include "detail/name_match.h"
#include "mixprec/precision/keep_fp32.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <unordered_map>
#include <unordered_set>

namespace mixprec {
namespace {

// What the plan can keep in FP32: floating tensors that are not FP8 primary weights (those
// are quantized on purpose; keeping one in FP32 is a contradiction the plan reports).
bool keepable(const at::Tensor& t) {
  const auto type = t.scalar_type();
  return at::isFloatingType(type) && !at::isFloat8Type(type);
}

// LibTorch's named_parameters() skips a parameter registered undefined (a bias-less layer's
// "bias"); the protected registry, read through a derived type, still holds its name.
// Undefined buffers stay out of reach (their registry is private).
struct UndefinedParameterNames : torch::nn::Module {
  static void append(const torch::nn::Module& module, const std::string& prefix,
                     std::vector<std::string>& names) {
    for (const auto& item : module.*(&UndefinedParameterNames::parameters_)) {
      if (!item.value().defined()) names.push_back(prefix + item.key());
    }
  }
};

}  // namespace

const char* to_string(TensorKind kind) {
  return kind == TensorKind::kParameter ? "parameter" : "buffer";
}

const char* to_string(KeepReason reason) {
  switch (reason) {
    case KeepReason::kNone:
      return "-";
    case KeepReason::kTensorMark:
      return "marked on tensor";
    case KeepReason::kName:
      return "by name";
    case KeepReason::kPattern:
      return "by pattern";
  }
  return "?";
}

PrecisionPlan& PrecisionPlan::keep_fp32_name(std::string fqn) {
  TORCH_CHECK(!fqn.empty(), "[mixprec::PrecisionPlan::keep_fp32_name] the name is empty");
  names_.push_back(std::move(fqn));
  return *this;
}

PrecisionPlan& PrecisionPlan::keep_fp32_pattern(std::string glob) {
  TORCH_CHECK(!glob.empty(), "[mixprec::PrecisionPlan::keep_fp32_pattern] the pattern is empty");
  patterns_.push_back(std::move(glob));
  return *this;
}

PrecisionPlan& PrecisionPlan::strict(bool on) {
  strict_ = on;
  return *this;
}

PrecisionPlan::Resolved PrecisionPlan::resolve(const torch::nn::Module& module) const {
  Resolved out;
  std::vector<std::string> all_names;  // including undefined tensors, for messages
  std::unordered_set<const c10::TensorImpl*> seen;
  auto collect = [&](const auto& named, TensorKind kind) {
    for (const auto& item : named) {
      all_names.push_back(item.key());
      const at::Tensor& t = item.value();
      if (!t.defined()) continue;
      PlannedTensor planned{item.key(), kind, t, KeepReason::kNone, {}};
      planned.shared = !seen.insert(t.unsafeGetTensorImpl()).second;
      out.tensors.push_back(std::move(planned));
    }
  };
  collect(module.named_parameters(/*recurse=*/true), TensorKind::kParameter);
  collect(module.named_buffers(/*recurse=*/true), TensorKind::kBuffer);
  UndefinedParameterNames::append(module, "", all_names);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    UndefinedParameterNames::append(*item.value(), item.key() + ".", all_names);
  }

  std::vector<std::string> problems;
  auto describe = [](const PlannedTensor& p) {
    return std::string(to_string(p.kind)) + " '" + p.name + "'";
  };
  auto keep = [](PlannedTensor& p, KeepReason reason, const std::string& rule) {
    if (p.reason != KeepReason::kNone) return;  // the first reason (mark > name > pattern) wins
    p.reason = reason;
    p.rule = rule;
    if (reason != KeepReason::kTensorMark) p.matched = p.name;
  };

  for (auto& p : out.tensors) {
    if (!is_kept_in_fp32(p.tensor)) continue;
    if (!keepable(p.tensor)) {
      problems.push_back(describe(p) + " is marked keep_in_fp32 but is now " +
                         std::string(c10::toString(p.tensor.scalar_type())));
      continue;
    }
    keep(p, KeepReason::kTensorMark, {});
  }

  // A name is a parameter or buffer, or a submodule: then it covers every tensor below it.
  for (const auto& name : names_) {
    bool found = false;
    const std::string prefix = name + ".";
    for (auto& p : out.tensors) {
      const bool exact = p.name == name;
      if (!exact && p.name.rfind(prefix, 0) != 0) continue;
      found = true;
      if (keepable(p.tensor)) {
        keep(p, KeepReason::kName, name);
      } else if (exact) {
        problems.push_back("name '" + name + "' is a " + c10::toString(p.tensor.scalar_type()) +
                           " " + to_string(p.kind) +
                           "; only floating, non-FP8 tensors can be kept in FP32");
      }
    }
    if (found) continue;
    if (std::find(all_names.begin(), all_names.end(), name) != all_names.end()) {
      problems.push_back("name '" + name + "' is registered but undefined");
      continue;
    }
    bool is_submodule = false;
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
      if (item.key() == name) is_submodule = true;
    }
    if (is_submodule) {
      problems.push_back("name '" + name + "' is a submodule without parameters or buffers");
      continue;
    }
    auto near = detail::close_matches(name, all_names);
    problems.push_back("name '" + name + "' matches no parameter, buffer or submodule" +
                       (near.empty() ? std::string(" (the module has none like it)")
                                     : " (close matches: " + detail::join(near) + ")"));
  }

  for (const auto& pattern : patterns_) {
    size_t hits = 0;
    std::vector<std::string> fp8_matches;  // quantized primary weights: never kept
    bool non_floating_match = false;
    for (auto& p : out.tensors) {
      if (!detail::glob_match(pattern, p.name)) continue;
      if (at::isFloat8Type(p.tensor.scalar_type())) {
        fp8_matches.push_back(describe(p) + " (" + c10::toString(p.tensor.scalar_type()) + ")");
        continue;
      }
      if (!keepable(p.tensor)) {
        non_floating_match = true;
        continue;
      }
      ++hits;
      keep(p, KeepReason::kPattern, pattern);
    }
    if (hits > 0) continue;
    if (strict_) {
      // A pattern that matches FP8 tensors says so, as a name does: "matches no floating
      // parameter" would send the reader looking for a typo in a pattern that does match.
      const std::string what = fp8_matches.empty()
                                   ? std::string("matches no floating parameter or buffer")
                                   : std::string("matches only FP8 (quantized) ") +
                                         (non_floating_match ? "and non-floating " : "") +
                                         "tensors: " + detail::join(fp8_matches) +
                                         "; only floating, non-FP8 tensors can be kept in FP32";
      problems.push_back("pattern '" + pattern + "' " + what +
                         " (the plan is strict; call strict(false) to allow it)");
    } else {
      out.unmatched_patterns.push_back(pattern);
    }
  }

  detail::check_no_problems(
      problems, "[mixprec::PrecisionPlan::resolve] cannot apply the plan to " + module.name());

  // Tied tensors: if any name of a tensor is kept, every name of it is, for the strongest
  // reason any of its names has (mark > name > pattern; the first name's at equal strength).
  // A name kept at that strength by a rule of its own keeps it; the others take the rule and
  // record which name it matched, so the report does not credit a rule to a name it does not
  // apply to.
  struct Strongest {
    KeepReason reason;
    std::string rule;
    std::string matched;
  };
  // KeepReason is declared in precedence order after kNone.
  auto stronger = [](KeepReason a, KeepReason b) {
    return static_cast<int>(a) < static_cast<int>(b);
  };
  std::unordered_map<const c10::TensorImpl*, Strongest> strongest;
  for (const auto& p : out.tensors) {
    if (p.reason == KeepReason::kNone) continue;
    auto [it, inserted] = strongest.try_emplace(p.tensor.unsafeGetTensorImpl(),
                                                Strongest{p.reason, p.rule, p.matched});
    if (!inserted && stronger(p.reason, it->second.reason)) {
      it->second = Strongest{p.reason, p.rule, p.matched};
    }
  }
  for (auto& p : out.tensors) {
    auto it = strongest.find(p.tensor.unsafeGetTensorImpl());
    if (it == strongest.end() || p.reason == it->second.reason) continue;
    p.reason = it->second.reason;
    p.rule = it->second.rule;
    p.matched = it->second.matched;
  }
  return out;
}

}  // namespace mixprec
