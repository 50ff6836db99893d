#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cmath>
#include <limits>
#include <typeinfo>
#include <unordered_map>

namespace mixprec::optim {

const char* to_string(ParamRole role) {
  switch (role) {
    case ParamRole::kMaster: return "fp32 main copy";
    case ParamRole::kNativeFp32: return "native fp32";
    case ParamRole::kFrozen: return "frozen";
  }
  return "?";
}

namespace {

Algorithm algorithm_of(const torch::optim::OptimizerOptions& options) {
  if (dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return Algorithm::kAdamW;
  if (dynamic_cast<const torch::optim::AdamOptions*>(&options)) return Algorithm::kAdam;
  if (dynamic_cast<const torch::optim::SGDOptions*>(&options)) return Algorithm::kSgd;
  TORCH_CHECK(false, "[mixprec::Float16Optimizer] options must be AdamWOptions, AdamOptions or "
              "SGDOptions, got ", typeid(options).name());
}

std::vector<torch::optim::OptimizerParamGroup> all_parameters(const torch::nn::Module& model) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model.parameters());
  return groups;
}

}  // namespace

detail::GroupOptionsCheck::GroupOptionsCheck(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    const torch::optim::OptimizerOptions* defaults) {
  TORCH_CHECK(defaults != nullptr, "[mixprec::Float16Optimizer] defaults are null");
  const Algorithm expected = algorithm_of(*defaults);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].has_options()) continue;
    TORCH_CHECK(typeid(groups[g].options()) == typeid(*defaults),
                "[mixprec::Float16Optimizer] param group ", g, " has ",
                algorithm_name(algorithm_of(groups[g].options())), " options but the defaults are ",
                algorithm_name(expected), "; all groups must use one algorithm");
  }
}

Float16Optimizer::Float16Optimizer(const torch::nn::Module& model,
                                   std::vector<torch::optim::OptimizerParamGroup> groups,
                                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                   Float16OptimizerOptions options)
    : detail::GroupOptionsCheck(groups, defaults.get()),
      torch::optim::Optimizer(groups, std::move(defaults)),
      options_(std::move(options)),
      algorithm_(algorithm_of(this->defaults())),
      scaler_(options_.loss_scaler()) {
  TORCH_CHECK(options_.clip_grad() >= 0 && std::isfinite(options_.clip_grad()),
              "[mixprec::Float16Optimizer] clip_grad must be a finite value >= 0, got ",
              options_.clip_grad());
  build_slots(model);
}

Float16Optimizer::Float16Optimizer(const torch::nn::Module& model,
                                   const torch::optim::OptimizerOptions& defaults,
                                   Float16OptimizerOptions options)
    : Float16Optimizer(model, all_parameters(model), defaults.clone(), std::move(options)) {}

void Float16Optimizer::build_slots(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> fqn_of;
  for (const auto& item : model.named_parameters()) {
    if (item.value().defined()) fqn_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<std::string> problems;
  std::unordered_map<const c10::TensorImpl*, int64_t> first_id;  // a parameter listed twice
  int64_t id = 0;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    const auto& params = param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++id) {
      const at::Tensor& p = params[i];
      auto it = p.defined() ? fqn_of.find(p.unsafeGetTensorImpl()) : fqn_of.end();
      if (it == fqn_of.end()) {
        problems.push_back("param " + std::to_string(i) + " of group " + std::to_string(g) +
                           " (id " + std::to_string(id) + ") is not a parameter of the model");
        continue;
      }
      if (auto [seen, fresh] = first_id.emplace(p.unsafeGetTensorImpl(), id); !fresh) {
        problems.push_back("'" + it->second + "' appears twice (ids " +
                           std::to_string(seen->second) + " and " + std::to_string(id) + ")");
      }
      ParamInfo info{it->second, g, id, ParamRole::kFrozen};
      if (p.requires_grad()) {
        const auto dtype = p.scalar_type();
        if (dtype == at::kFloat) {
          info.role = ParamRole::kNativeFp32;
        } else if (dtype == at::kBFloat16 || dtype == at::kHalf) {
          info.role = ParamRole::kMaster;
        } else {
          problems.push_back("'" + info.fqn + "' is a trainable " + c10::toString(dtype) +
                             " parameter; only Float, BFloat16 and Half can be optimized");
        }
        if (p.is_sparse() || !p.is_contiguous()) {
          problems.push_back("'" + info.fqn + "' must be dense and contiguous");
        }
      }
      info_.push_back(std::move(info));
    }
  }
  mixprec::detail::check_no_problems(problems,
                                     "[mixprec::Float16Optimizer] cannot optimize these parameters");

  at::NoGradGuard no_grad;
  for (const auto& group : param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto slot = std::make_shared<Slot>();
      slot->param = p;
      if (info_[slots_.size()].role == ParamRole::kMaster) {
        slot->master = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      }
      slots_.push_back(std::move(slot));
    }
  }
}

const at::Tensor& Float16Optimizer::main_param(int64_t id) const {
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(slots_.size()),
              "[mixprec::Float16Optimizer::main_param] no parameter id ", id);
  return slots_[id]->master;
}

int64_t Float16Optimizer::state_bytes(ParamRole role) const {
  int64_t bytes = 0;
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (info_[k].role != role) continue;
    const Slot& s = *slots_[k];
    for (const at::Tensor* t :
         {&s.master, &s.exp_avg, &s.exp_avg_sq, &s.max_exp_avg_sq, &s.momentum_buffer}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

at::Tensor Float16Optimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  update();
  return loss;
}

StepResult Float16Optimizer::update() {
  StepResult result;
  result.loss_scale = scaler_.scale();
  const double inv_scale = scaler_.inv_scale();

  // One read-only pass over every gradient: global norm and overflow check.
  std::vector<size_t> active;
  double sum_of_squares = 0.0;
  const ParamInfo* first_non_finite = nullptr;
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (info_[k].role == ParamRole::kFrozen) continue;
    const at::Tensor& grad = slots_[k]->param.grad();
    if (!grad.defined()) continue;
    TORCH_CHECK(!grad.is_sparse() && grad.sizes() == slots_[k]->param.sizes(),
                "[mixprec::Float16Optimizer::update] gradient of '", info_[k].fqn,
                "' must be dense with the parameter's shape ", slots_[k]->param.sizes(), ", got ",
                grad.sizes());
    TORCH_CHECK(grad.device() == slots_[k]->param.device(),
                "[mixprec::Float16Optimizer::update] gradient of '", info_[k].fqn, "' is on ",
                grad.device(), ", the parameter on ", slots_[k]->param.device());
    const GradStats stats = grad_stats(grad.contiguous(), inv_scale);
    sum_of_squares += stats.sum_of_squares;
    if (!stats.all_finite && !first_non_finite) first_non_finite = &info_[k];
    active.push_back(k);
  }
  result.grad_norm = std::sqrt(sum_of_squares);

  if (first_non_finite) {
    TORCH_CHECK(scaler_.is_dynamic() || options_.non_finite_grads() != NonFiniteGrads::kError,
                "[mixprec::Float16Optimizer::update] non-finite gradient in parameter '",
                first_non_finite->fqn, "' (no dynamic loss scaler); the step was not taken");
    result.grad_norm = std::numeric_limits<double>::infinity();
    scaler_.update(/*found_inf=*/true);
    last_result_ = result;
    return result;
  }

  // Hyper-parameters are checked for every group before any parameter is stepped, so a bad
  // value (e.g. a scheduler that drove lr negative) fails the whole step, not half of it.
  for (size_t k : active) {
    const auto& options = param_groups()[info_[k].group].options();
    if (algorithm_ == Algorithm::kSgd) {
      check_hyper_params(detail::sgd_hyper_params(options));
    } else {
      check_hyper_params(detail::adam_hyper_params(options, algorithm_));
    }
  }

  double multiplier = inv_scale;
  if (options_.clip_grad() > 0 && result.grad_norm > options_.clip_grad()) {
    multiplier *= options_.clip_grad() / (result.grad_norm + 1e-6);
  }
  for (size_t k : active) step_slot(k, multiplier);
  scaler_.update(/*found_inf=*/false);
  result.success = true;
  result.params_stepped = static_cast<int64_t>(active.size());
  last_result_ = result;
  return result;
}

void Float16Optimizer::step_slot(size_t index, double grad_multiplier) {
  Slot& slot = *slots_[index];
  const auto& options = param_groups()[info_[index].group].options();
  const at::Tensor target = slot.fp32_target();
  const at::Tensor grad = slot.param.grad().contiguous();
  const at::Tensor model_param = slot.master.defined() ? slot.param.detach() : at::Tensor();
  const auto fp32 = target.options().dtype(at::kFloat);

  // State is committed only after the kernel has run: a throwing kernel leaves none behind.
  if (algorithm_ == Algorithm::kSgd) {
    const SgdHyperParams hp = detail::sgd_hyper_params(options);
    const bool first = !slot.momentum_buffer.defined();
    at::Tensor buffer = slot.momentum_buffer;
    if (hp.momentum != 0 && first) buffer = at::empty_like(target, fp32);
    fused_sgd_step(target, grad, hp.momentum != 0 ? buffer : at::Tensor(), model_param, first, hp,
                   grad_multiplier);
    slot.momentum_buffer = hp.momentum != 0 ? buffer : slot.momentum_buffer;
    ++slot.step;
    return;
  }
  const AdamHyperParams hp = detail::adam_hyper_params(options, algorithm_);
  at::Tensor exp_avg = slot.exp_avg, exp_avg_sq = slot.exp_avg_sq, max_sq = slot.max_exp_avg_sq;
  if (!exp_avg.defined()) {
    exp_avg = at::zeros_like(target, fp32);
    exp_avg_sq = at::zeros_like(target, fp32);
  }
  if (hp.amsgrad && !max_sq.defined()) max_sq = at::zeros_like(target, fp32);
  fused_adam_step(target, grad, exp_avg, exp_avg_sq, hp.amsgrad ? max_sq : at::Tensor(),
                  model_param, slot.step + 1, hp, grad_multiplier);
  slot.exp_avg = exp_avg;
  slot.exp_avg_sq = exp_avg_sq;
  slot.max_exp_avg_sq = max_sq;
  ++slot.step;
}

void Float16Optimizer::copy_masters_to_model() {
  at::NoGradGuard no_grad;
  for (const auto& slot : slots_) {
    if (slot->master.defined()) copy_master_to_model(slot->master, slot->param.detach());
  }
}

}  // namespace mixprec::optim
