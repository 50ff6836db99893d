#include "mixprec/precision/convert.h"

#include "precision/keep_record.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <iomanip>
#include <sstream>
#include <unordered_map>

namespace mixprec {

const char* to_string(ConversionAction action) {
  switch (action) {
    case ConversionAction::kCast:
      return "cast";
    case ConversionAction::kKeptFp32:
      return "kept fp32";
    case ConversionAction::kUpcastFp32:
      return "made fp32";
    case ConversionAction::kLeftAlone:
      return "left alone";
  }
  return "?";
}

namespace {

bool is_fp8(c10::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fnuz ||
         t == at::kFloat8_e5m2fnuz || t == at::kFloat8_e8m0fnu;
}

// set_data keeps the TensorImpl, which is what makes the conversion identity-preserving.
void cast_in_place(at::Tensor& tensor, c10::ScalarType dtype) {
  at::NoGradGuard no_grad;
  tensor.set_data(tensor.to(dtype));
  // Frozen or not: a parameter frozen after a backward still holds its gradient, which must
  // keep matching its dtype.
  if (tensor.grad().defined() && tensor.grad().scalar_type() != dtype) {
    tensor.mutable_grad() = tensor.grad().to(dtype);
  }
}

std::string keep_description(const PlannedTensor& p) {
  // A tied tensor kept through another of its names says which: the rule does not apply to
  // this name.
  const std::string via =
      p.matched.empty() || p.matched == p.name ? std::string() : " via tied '" + p.matched + "'";
  switch (p.reason) {
    case KeepReason::kTensorMark:
      return "keep_in_fp32 mark";
    case KeepReason::kName:
      return "name '" + p.rule + "'" + via;
    case KeepReason::kPattern:
      return "pattern '" + p.rule + "'" + via;
    case KeepReason::kNone:
      break;
  }
  return {};
}

}  // namespace

KeptFp32 kept_fp32_reason(const at::Tensor& tensor) { return detail::conversion_keep(tensor); }

int64_t ConversionReport::count(ConversionAction action) const {
  int64_t n = 0;
  for (const auto& e : entries) n += (e.action == action && !e.shared) ? 1 : 0;
  return n;
}

std::string ConversionReport::to_string() const {
  size_t width = 4;
  for (const auto& e : entries) width = std::max(width, e.name.size());
  std::ostringstream out;
  out << std::left << std::setw(static_cast<int>(width)) << "name"
      << "  " << std::setw(9) << "kind"
      << "  " << std::setw(22) << "dtype"
      << "  " << std::setw(13) << "action"
      << "  why\n";
  for (const auto& e : entries) {
    std::string dtypes = std::string(c10::toString(e.before)) + " -> " + c10::toString(e.after);
    out << std::setw(static_cast<int>(width)) << e.name << "  " << std::setw(9)
        << mixprec::to_string(e.kind) << "  " << std::setw(22) << dtypes << "  " << std::setw(13)
        << mixprec::to_string(e.action) << "  " << e.why << (e.shared ? " (tied)" : "") << "\n";
  }
  for (const auto& pattern : unmatched_patterns) {
    out << "note: pattern '" << pattern << "' matched nothing\n";
  }
  const double ratio = bytes_before ? static_cast<double>(bytes_after) / bytes_before : 1.0;
  out << "bytes: " << bytes_before << " -> " << bytes_after << " (" << std::fixed
      << std::setprecision(1) << 100.0 * ratio << "%)\n";
  return out.str();
}

ConversionReport convert_module_to_dtype_except_fp32_marked(torch::nn::Module& module,
                                                            c10::ScalarType dtype,
                                                            const PrecisionPlan& plan) {
  RECORD_USER_SCOPE("mixprec::convert");  // a named range in profiler traces
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "[mixprec::convert_module_to_dtype_except_fp32_marked] target dtype must be Half "
              "or BFloat16, got ",
              dtype, " (module ", module.name(), ")");
  // Validation happens entirely inside resolve(); nothing below can fail on the caller's input.
  PrecisionPlan::Resolved resolved = plan.resolve(module);

  ConversionReport report;
  report.target = dtype;
  report.unmatched_patterns = std::move(resolved.unmatched_patterns);
  std::unordered_map<const c10::TensorImpl*, size_t> first_entry;  // tied tensors
  for (auto& p : resolved.tensors) {
    if (p.shared) {
      ConversionEntry tied = report.entries.at(first_entry.at(p.tensor.unsafeGetTensorImpl()));
      tied.name = p.name;
      tied.kind = p.kind;
      tied.shared = true;
      // Same strength of reason as the first name (resolve() makes it so), but this name's
      // own rule, or the name the rule matched.
      if (tied.reason != KeepReason::kNone) {
        tied.reason = p.reason;
        tied.why = keep_description(p);
      }
      report.entries.push_back(std::move(tied));
      continue;
    }
    first_entry.emplace(p.tensor.unsafeGetTensorImpl(), report.entries.size());
    ConversionEntry entry{p.name,
                          p.kind,
                          p.tensor.scalar_type(),
                          p.tensor.scalar_type(),
                          ConversionAction::kLeftAlone,
                          p.reason,
                          {},
                          p.tensor.numel(),
                          p.shared};
    const c10::ScalarType before = p.tensor.scalar_type();
    report.bytes_before += static_cast<int64_t>(p.tensor.nbytes());

    if (!at::isFloatingType(before)) {
      entry.why = std::string(c10::toString(before)) + " " + mixprec::to_string(p.kind);
    } else if (is_fp8(before)) {
      entry.why = "quantized primary weight";
    } else if (p.reason != KeepReason::kNone) {
      entry.why = keep_description(p);
      if (before == at::kFloat) {
        entry.action = ConversionAction::kKeptFp32;
      } else {
        entry.action = ConversionAction::kUpcastFp32;
        cast_in_place(p.tensor, at::kFloat);
      }
    } else if (before == dtype) {
      entry.why = "already target dtype";
    } else {
      entry.action = ConversionAction::kCast;
      entry.why = "not in plan";
      cast_in_place(p.tensor, dtype);
    }
    // Kept tensors remember why; every other tensor loses a reason an earlier conversion gave.
    const bool kept = entry.action == ConversionAction::kKeptFp32 ||
                      entry.action == ConversionAction::kUpcastFp32;
    detail::record_conversion_keep(p.tensor, kept ? p.reason : KeepReason::kNone,
                                   kept ? p.rule : std::string());
    entry.after = p.tensor.scalar_type();
    report.bytes_after += static_cast<int64_t>(p.tensor.nbytes());
    report.entries.push_back(std::move(entry));
  }
  return report;
}

}  // namespace mixprec
