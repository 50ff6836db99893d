// Applying a loaded state: both state-dict forms parse into one per-parameter picture
// (Float16Optimizer::Loaded), which is checked completely here before anything is written —
// so a failed load leaves the optimizer and the model exactly as they were.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace mixprec::optim {
namespace {

// Checks one saved tensor against the parameter it belongs to.
void check_tensor(const at::Tensor& t, const at::Tensor& param, const std::string& what,
                  bool must_be_fp32, std::vector<std::string>& problems) {
  if (!t.defined()) {
    problems.push_back(what + " is undefined");
    return;
  }
  if (t.sizes() != param.sizes()) {
    problems.push_back(what + ": shape " + c10::str(t.sizes()) + ", the parameter has " +
                       c10::str(param.sizes()));
  }
  if (!at::isFloatingType(t.scalar_type()) || (must_be_fp32 && t.scalar_type() != at::kFloat)) {
    problems.push_back(what + ": dtype " + c10::toString(t.scalar_type()) +
                       (must_be_fp32 ? ", expected Float (an FP32 value is never taken from a "
                                       "lower precision)"
                                     : ", expected a floating dtype"));
  }
}

}  // namespace
LoadReport Float16Optimizer::apply_loaded(Loaded&& saved, const LoadOptions& options) {
  auto& problems = saved.problems;
  const bool adam = algorithm_ != Algorithm::kSgd;
  for (size_t k = 0; k < slots_.size(); ++k) {
    const ParamInfo& info = info_[k];
    auto& p = saved.params[k];
    const at::Tensor& param = slots_[k]->param;
    for (const auto& [kind, t] : p.moments) {
      check_tensor(t, param, "'" + info.fqn + "' " + kind, /*must_be_fp32=*/false, problems);
    }
    if (p.fp32.defined()) {
      check_tensor(p.fp32, param, p.fp32_source, /*must_be_fp32=*/true, problems);
    }
    if (info.role == ParamRole::kFrozen) continue;
    // The moments this parameter's state needs, by the hyper-parameters being loaded (they
    // replace the current ones): Adam's two (three with amsgrad), SGD's buffer if momentum.
    const nlohmann::json* group = saved.groups.is_array() && info.group < saved.groups.size()
                                      ? &saved.groups[info.group]
                                      : nullptr;
    std::vector<std::string> need;
    if (adam) {
      need = {"exp_avg", "exp_avg_sq"};
      const bool amsgrad = group ? group->value("amsgrad", false)
                                 : detail::adam_hyper_params(
                                       param_groups()[info.group].options(), algorithm_).amsgrad;
      if (amsgrad) need.push_back("max_exp_avg_sq");
    } else {
      const double momentum = group ? group->value("momentum", 0.0)
                                    : detail::sgd_hyper_params(
                                          param_groups()[info.group].options()).momentum;
      if (momentum != 0) need.push_back("momentum_buffer");
    }
    p.needs_moments = !need.empty();
    const bool has_state = !p.moments.empty() || (p.step > 0 && !p.fresh_ok);
    if (!has_state) continue;
    std::vector<std::string> missing;
    for (const auto& kind : need) {
      if (!p.moments.count(kind)) missing.push_back(kind);
    }
    for (const auto& kind : missing) {
      saved.report.missing_keys.push_back(std::string(detail::kStatePrefix) + kind + "." + info.fqn);
    }
    if (!missing.empty()) {
      // Non-strict: a partial state is no state; the parameter starts fresh.
      p.moments.clear();
      p.step = 0;
      saved.report.notes.push_back("'" + info.fqn + "': incomplete optimizer state, starts fresh");
      continue;
    }
    if (p.step <= 0) {
      problems.push_back("'" + info.fqn + "' has optimizer state but step " +
                         std::to_string(p.step));
    }
  }
  if (!saved.scaler.is_object()) problems.push_back("no loss scaler state");
  LossScaler scaler_copy = scaler_;
  const bool scaler_mode_differs = saved.scaler.is_object() && saved.scaler.contains("dynamic") &&
                                   saved.scaler["dynamic"] != scaler_.is_dynamic();
  if (scaler_mode_differs) {
    // e.g. FP16 with a dynamic scale resumed as BF16: the saved scale means nothing here.
    saved.report.notes.push_back(std::string("loss scaler: the state is ") +
                                 (scaler_.is_dynamic() ? "constant" : "dynamic") +
                                 ", this optimizer's is not; keeping the configured scaler");
  } else if (saved.scaler.is_object()) {
    try {
      scaler_copy.load_state(saved.scaler);
    } catch (const c10::Error& e) {
      problems.push_back(e.what_without_backtrace());
    }
  }
  if (options.strict) {
    for (const auto& key : saved.report.missing_keys) problems.push_back("missing " + key);
    for (const auto& key : saved.report.unexpected_keys) problems.push_back("unexpected " + key);
  }
  mixprec::detail::check_no_problems(problems, "[mixprec::Float16Optimizer] cannot load the state");

  if (options.dry_run) return std::move(saved.report);
  // Everything checked: apply.
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups().size() && saved.groups.is_array(); ++g) {
    detail::set_group_hyper_params(param_groups()[g].options(), saved.groups[g], algorithm_);
  }
  scaler_ = scaler_copy;
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& slot = *slots_[k];
    auto& p = saved.params[k];
    const ParamInfo& info = info_[k];
    if (info.role == ParamRole::kFrozen) continue;
    // On the parameter's device: a checkpoint is read to the host.
    auto fp32_copy = [&](const at::Tensor& t) {
      return t.detach().to(slot.param.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true)
          .contiguous();
    };
    slot.exp_avg = slot.exp_avg_sq = slot.max_exp_avg_sq = slot.momentum_buffer = at::Tensor();
    slot.step = 0;
    if (!p.moments.empty() || (!p.needs_moments && !p.fresh_ok)) {
      slot.step = p.step;
      for (auto& [kind, t] : p.moments) {
        at::Tensor value = fp32_copy(t);
        if (kind == "exp_avg") slot.exp_avg = value;
        if (kind == "exp_avg_sq") slot.exp_avg_sq = value;
        if (kind == "max_exp_avg_sq") slot.max_exp_avg_sq = value;
        if (kind == "momentum_buffer") slot.momentum_buffer = value;
      }
    }
    if (info.role == ParamRole::kMaster) {
      if (p.fp32.defined()) {
        slot.master.copy_(p.fp32);
      } else {
        slot.master.copy_(slot.param.detach());
        saved.report.notes.push_back("'" + info.fqn + "': main copy re-derived from the " +
                                     c10::toString(slot.param.scalar_type()) + " model parameter");
      }
    } else if (p.fp32.defined()) {
      // Saved with a main copy, now native FP32: the parameter takes the main copy's value.
      slot.param.detach().copy_(p.fp32);
      saved.report.notes.push_back("'" + info.fqn + "' is now native FP32: took its value from " +
                                   p.fp32_source);
    }
  }
  copy_masters_to_model();
  return std::move(saved.report);
}

}  // namespace mixprec::optim
