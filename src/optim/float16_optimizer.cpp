// Float16Optimizer: construction, parameter roles, adding groups, and the step.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/offload/offload_pipeline.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>
#include <torch/nn/module.h>

#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace mixprec::optim {

const char* to_string(ParamRole role) {
  switch (role) {
    case ParamRole::kMaster:
      return "fp32 main copy";
    case ParamRole::kNativeFp32:
      return "native fp32";
    case ParamRole::kFrozen:
      return "frozen";
  }
  return "?";
}

namespace {

// Every parameter of `model` once (tied ones under their first name), in named order.
std::vector<std::pair<std::string, at::Tensor>> unique_parameters(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& t = item.value();
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.emplace_back(item.key(), t);
  }
  return out;
}

// The later names of tied parameters, each with the first name it shares a tensor with.
std::map<std::string, std::string> tied_names(const torch::nn::Module& model) {
  std::map<std::string, std::string> out;
  std::unordered_map<const c10::TensorImpl*, std::string> first;
  for (const auto& item : model.named_parameters()) {
    if (!item.value().defined()) continue;
    const auto [it, is_first] = first.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!is_first) out.emplace(item.key(), it->second);
  }
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> all_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> params;
  for (auto& [fqn, t] : unique_parameters(model)) params.push_back(t);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(params));
  return groups;
}

std::string type_name(const torch::optim::OptimizerOptions& options) {
  return c10::demangle(typeid(options).name());
}

}  // namespace

namespace detail {

std::optional<ParamRole> trainable_role(const at::Tensor& param) {
  switch (param.scalar_type()) {
    case at::kFloat:
      return ParamRole::kNativeFp32;
    case at::kBFloat16:
    case at::kHalf:
      return ParamRole::kMaster;
    default:
      return std::nullopt;
  }
}

GroupOptionsCheck::GroupOptionsCheck(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                     const torch::optim::OptimizerOptions* defaults) {
  TORCH_CHECK(defaults != nullptr, "[mixprec::Float16Optimizer] defaults are null");
  const AlgorithmTraits& expected = traits_for(*defaults);
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(!groups[g].has_options() || expected.owns(groups[g].options()),
                "[mixprec::Float16Optimizer] param group ", g, " has ",
                type_name(groups[g].options()), " but the defaults are ", expected.options_name(),
                "; all groups must use one algorithm");
  }
}

}  // namespace detail

Float16Optimizer::Float16Optimizer(const torch::nn::Module& model,
                                   std::vector<torch::optim::OptimizerParamGroup> groups,
                                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                   Float16OptimizerOptions options)
    : Float16Optimizer(model, std::move(groups), std::move(defaults), std::move(options),
                       Sharding(), "mixprec::Float16Optimizer") {}

Float16Optimizer::Float16Optimizer(const torch::nn::Module& model,
                                   std::vector<torch::optim::OptimizerParamGroup> groups,
                                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                   Float16OptimizerOptions options, Sharding sharding,
                                   std::string who)
    : detail::GroupOptionsCheck(groups, defaults.get()),
      torch::optim::Optimizer(groups, std::move(defaults)),
      options_(std::move(options)),
      sharding_(std::move(sharding)),
      who_(std::move(who)),
      traits_(&detail::traits_for(this->defaults(), who_)),
      scaler_(options_.loss_scaler()),
      model_params_(unique_parameters(model)),
      tied_names_(tied_names(model)) {
  TORCH_CHECK(options_.clip_grad() >= 0 && std::isfinite(options_.clip_grad()), "[", who_,
              "] clip_grad must be a finite value >= 0, got ", options_.clip_grad());
  if (options_.offload()) detail::OffloadPipeline::check_options(*options_.offload(), who_.c_str());
  for (size_t g = 0; g < param_groups().size(); ++g) check_group_options(g);
  build_slots(0);
}

Float16Optimizer::Float16Optimizer(const torch::nn::Module& model,
                                   const torch::optim::OptimizerOptions& defaults,
                                   Float16OptimizerOptions options)
    : Float16Optimizer(model, all_parameters(model), defaults.clone(), std::move(options)) {}

Float16Optimizer::~Float16Optimizer() = default;

Algorithm Float16Optimizer::algorithm() const { return traits_->algorithm(); }

void Float16Optimizer::check_group_options(size_t group) const {
  const auto& options = param_groups()[group].options();
  TORCH_CHECK(traits_->owns(options), "[", who_, "] param group ", group, " has ",
              type_name(options), "; the optimizer runs ", traits_->options_name());
  const std::string problem = traits_->range_problem(options);
  TORCH_CHECK(problem.empty(), "[", who_, "] param group ", group, ": ", problem);
}

std::vector<std::string> Float16Optimizer::new_param_problems(size_t first_group) const {
  std::unordered_map<const c10::TensorImpl*, const std::string*> fqn_of;
  for (const auto& [fqn, t] : model_params_) fqn_of.emplace(t.unsafeGetTensorImpl(), &fqn);
  std::unordered_map<const c10::TensorImpl*, int64_t> first_id;  // a parameter listed twice
  for (const auto& info : info_)
    first_id.emplace(slots_[info.id]->param.unsafeGetTensorImpl(), info.id);
  std::vector<std::string> problems;
  int64_t id = static_cast<int64_t>(info_.size());
  for (size_t g = first_group; g < param_groups().size(); ++g) {
    const auto& params = param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++id) {
      const at::Tensor& p = params[i];
      auto it = p.defined() ? fqn_of.find(p.unsafeGetTensorImpl()) : fqn_of.end();
      if (it == fqn_of.end()) {
        // Unnamed here, so described by what it is. A group added later may hold a parameter
        // registered since construction: the optimizer knows only the model it was built on.
        std::string what = "param " + std::to_string(i) + " of group " + std::to_string(g) +
                           " (id " + std::to_string(id);
        if (p.defined()) what += c10::str(", ", p.scalar_type(), " ", p.sizes());
        problems.push_back(what + ") " +
                           (first_group == 0
                                ? std::string("is not a parameter of the model")
                                : std::string("was not a parameter of the model when the optimizer "
                                              "was built (a parameter registered since cannot be "
                                              "added: build the optimizer once the model is "
                                              "complete)")));
        continue;
      }
      const std::string& fqn = *it->second;
      if (auto [seen, fresh] = first_id.emplace(p.unsafeGetTensorImpl(), id); !fresh) {
        problems.push_back("'" + fqn + "' appears twice (ids " + std::to_string(seen->second) +
                           " and " + std::to_string(id) + ")");
      }
      if (!p.requires_grad()) continue;
      if (!detail::trainable_role(p)) {
        problems.push_back("'" + fqn + "' is a trainable " + c10::toString(p.scalar_type()) +
                           " parameter; only Float, BFloat16 and Half can be optimized");
      }
      if (p.is_sparse() || !p.is_contiguous()) {
        problems.push_back("'" + fqn + "' must be dense and contiguous");
      }
    }
  }
  return problems;
}

void Float16Optimizer::build_slots(size_t first_group) {
  mixprec::detail::check_no_problems(new_param_problems(first_group),
                                     "[" + who_ + "] cannot optimize these parameters");
  std::unordered_map<const c10::TensorImpl*, const std::string*> fqn_of;
  for (const auto& [fqn, t] : model_params_) fqn_of.emplace(t.unsafeGetTensorImpl(), &fqn);
  at::NoGradGuard no_grad;
  for (size_t g = first_group; g < param_groups().size(); ++g) {
    for (const at::Tensor& p : param_groups()[g].params()) {
      ParamInfo info{*fqn_of.at(p.unsafeGetTensorImpl()), g, static_cast<int64_t>(info_.size()),
                     p.requires_grad() ? *detail::trainable_role(p) : ParamRole::kFrozen};
      auto slot = std::make_shared<Slot>();
      slot->param = p;
      slot->end = p.numel();
      if (sharded()) {
        const FlatRange piece = sharding_.piece_of(p);
        TORCH_INTERNAL_ASSERT(0 <= piece.begin && piece.begin <= piece.end &&
                              piece.end <= p.numel());
        slot->whole = false;
        slot->begin = piece.begin;
        slot->end = piece.end;
      }
      slot->state.resize(traits_->state_kinds().size());
      if (info.role == ParamRole::kMaster) slot->hold_master(at::Tensor(), master_policy());
      slot->record();
      info_.push_back(std::move(info));
      slots_.push_back(std::move(slot));
    }
    group_sizes_.push_back(param_groups()[g].params().size());
  }
}

void Float16Optimizer::add_param_group(const torch::optim::OptimizerParamGroup& group) {
  // The groups as they are must be the ones the optimizer knows before one is added.
  (void)plan_sync(detail::SyncPurpose::kLoad);
  TORCH_CHECK(!group.has_options() || traits_->owns(group.options()),
              "[mixprec::Float16Optimizer::add_param_group] the group has ",
              type_name(group.options()), "; the optimizer runs ", traits_->options_name());
  const size_t g = param_groups().size();
  torch::optim::Optimizer::add_param_group(group);  // checks leaves; merges options
  std::vector<std::string> problems = new_param_problems(g);
  if (const std::string bad = traits_->range_problem(param_groups()[g].options()); !bad.empty()) {
    problems.push_back("the group's options: " + bad);
  }
  if (!problems.empty()) {
    param_groups().pop_back();  // as it was
    mixprec::detail::check_no_problems(
        problems, "[mixprec::Float16Optimizer::add_param_group] cannot add the group");
  }
  build_slots(g);
}

at::Tensor Float16Optimizer::main_param(const std::string& fqn) const {
  // A tied parameter's later name reaches the one parameter, held under its first name.
  const auto tied = tied_names_.find(fqn);
  const std::string& held = tied == tied_names_.end() ? fqn : tied->second;
  std::vector<std::string> names;
  for (size_t k = 0; k < info_.size(); ++k) {
    if (info_[k].fqn == held) return slots_[k]->master_value();
    names.push_back(info_[k].fqn);
  }
  for (const auto& [name, first] : tied_names_) names.push_back(name);
  const auto near = mixprec::detail::close_matches(fqn, names);
  TORCH_CHECK(false, "[mixprec::Float16Optimizer::main_param] the optimizer holds no parameter '",
              fqn, "'", near.empty() ? "" : " (close: " + mixprec::detail::join(near) + ")");
}

int64_t Float16Optimizer::state_bytes(ParamRole role) const {
  int64_t bytes = 0;
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (info_[k].role != role) continue;
    const Slot& s = *slots_[k];
    if (s.master.defined()) bytes += static_cast<int64_t>(s.master.nbytes());
    if (s.remainder.defined()) bytes += static_cast<int64_t>(s.remainder.nbytes());
    for (const at::Tensor& t : s.state) {
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  return bytes;
}

int64_t Float16Optimizer::state_bytes_when_stepped() const {
  int64_t bytes = 0;
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (info_[k].role == ParamRole::kFrozen) continue;
    const Slot& s = *slots_[k];
    const int64_t numel = s.end - s.begin;
    if (s.master.defined()) bytes += numel * 4;
    if (s.remainder.defined()) bytes += numel * 2;
    const std::vector<bool> held = traits_->held_state(param_groups()[info_[k].group].options());
    for (bool h : held) bytes += h ? numel * 4 : 0;
  }
  return bytes;
}

std::vector<int64_t> Float16Optimizer::state_tensor_bytes_to_come() const {
  std::vector<int64_t> out;
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    // (A rank that holds no piece of a parameter never makes state for it.)
    if (info_[k].role == ParamRole::kFrozen || s.begin == s.end) continue;
    const std::vector<bool> held = traits_->held_state(param_groups()[info_[k].group].options());
    // A step allocates exactly these (AlgorithmTraits::allocate_state), FP32, piece-sized.
    for (size_t i = 0; i < held.size(); ++i) {
      if (held[i] && !s.state[i].defined()) out.push_back((s.end - s.begin) * 4);
    }
  }
  return out;
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

at::Tensor Float16Optimizer::piece_gradient(size_t index, bool& arrived) const {
  const Slot& slot = *slots_[index];
  const at::Tensor& param = slot.param;
  const at::Tensor& grad = param.grad();
  arrived = grad.defined();
  if (!grad.defined()) return grad;
  TORCH_CHECK(!grad.is_sparse() && grad.sizes() == param.sizes(), "[", who_,
              "::update] gradient of '", info_[index].fqn,
              "' must be dense with the parameter's shape ", param.sizes(), ", got ", grad.sizes());
  TORCH_CHECK(grad.device() == param.device(), "[", who_, "::update] gradient of '",
              info_[index].fqn, "' is on ", grad.device(), ", the parameter on ", param.device());
  const auto dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "[", who_,
              "::update] gradient of '", info_[index].fqn, "' is ", dtype,
              "; gradients must be Float, BFloat16 or Half");
  return grad.contiguous();
}

StepResult Float16Optimizer::update() {
  RECORD_USER_SCOPE("mixprec::optimizer_update");  // a named range in profiler traces
  before_update();
  // Everything is checked before anything changes: the model's parameters (the roles they ask
  // for), every group's hyper-parameters (a scheduler may have driven lr negative), every
  // gradient's shape and device.
  const detail::SyncPlan plan = plan_sync(detail::SyncPurpose::kUse);
  for (size_t g = 0; g < param_groups().size(); ++g) check_group_options(g);
  reduce_gradients();

  StepResult result;
  result.loss_scale = scaler_.scale();
  const double inv_scale = scaler_.inv_scale();
  // One read-only pass over every gradient (piece): norm and overflow check, then what every
  // rank agrees on (nothing to agree on in one process).
  GradientAgreement& agreement = agreement_;
  agreement.sum_of_squares.assign(slots_.size(), 0.0);
  agreement.has_gradient.assign(slots_.size(), 0);
  agreement.non_finite.assign(slots_.size(), 0);
  std::vector<at::Tensor>& grads = step_grads_;
  grads.resize(slots_.size());
  step_state_.resize(slots_.size());
  step_fresh_.resize(slots_.size());
  // However update() ends (a skipped step, an error), it holds on to no gradient — zero_grad()
  // must be able to free them before the next backward — and to no state it did not adopt.
  struct ForgetStepLists {
    Float16Optimizer& self;
    ~ForgetStepLists() {
      for (at::Tensor& grad : self.step_grads_) grad = at::Tensor();
      for (size_t k : self.active_) {
        self.step_state_[k].clear();
        self.step_fresh_[k].clear();
      }
    }
  } forget_step_lists{*this};
  for (size_t k = 0; k < slots_.size(); ++k) {
    grads[k] = at::Tensor();
    if (plan.slots[k].role == ParamRole::kFrozen) continue;
    bool arrived = false;
    grads[k] = piece_gradient(k, arrived);
    agreement.has_gradient[k] = arrived ? 1 : 0;
    if (!grads[k].defined()) continue;
    const GradStats stats = grad_stats(grads[k], inv_scale);
    agreement.sum_of_squares[k] = stats.sum_of_squares;
    agreement.non_finite[k] = stats.all_finite ? 0 : 1;
  }
  agree(agreement);
  double sum_of_squares = 0.0;
  const std::string* first_non_finite = nullptr;
  std::vector<size_t>& active = active_;
  active.clear();
  for (size_t k = 0; k < slots_.size(); ++k) {
    if (plan.slots[k].role == ParamRole::kFrozen || !agreement.has_gradient[k]) continue;
    sum_of_squares += agreement.sum_of_squares[k];
    if (agreement.non_finite[k] && !first_non_finite) first_non_finite = &info_[k].fqn;
    active.push_back(k);
  }
  TORCH_CHECK(!first_non_finite || scaler_.is_dynamic() ||
                  options_.non_finite_grads() != NonFiniteGrads::kError,
              "[", who_, "::update] non-finite gradient in parameter '",
              first_non_finite ? *first_non_finite : "", "' (no dynamic loss scaler); the step ",
              sharded() ? "was not taken on any rank" : "was not taken");

  apply_sync(plan);
  result.grad_norm = std::sqrt(sum_of_squares);
  if (first_non_finite) {
    result.grad_norm = std::numeric_limits<double>::infinity();
    scaler_.update(/*found_inf=*/true);
    last_result_ = result;
    return result;
  }
  double multiplier = inv_scale;
  if (options_.clip_grad() > 0 && result.grad_norm > options_.clip_grad()) {
    multiplier *= options_.clip_grad() / (result.grad_norm + 1e-6);
  }
  if (options_.offload()) {
    step_offloaded(active, multiplier);
  } else {
    // Every state tensor the steps create (the first step's moments), created before any
    // parameter steps, as torch's _init_group does: running out of memory for them leaves
    // every parameter, its state and its step count as they were, so the step can be retried.
    for (size_t k : active) create_step_state(k);
    for (size_t k : active) step_slot(k, multiplier);
  }
  publish_params();
  record_params();  // the write-back is ours: not an outside change
  scaler_.update(/*found_inf=*/false);
  result.success = true;
  result.params_stepped = static_cast<int64_t>(active.size());
  last_result_ = result;
  return result;
}

void Float16Optimizer::create_step_state(size_t index) {
  const Slot& slot = *slots_[index];
  if (slot.begin == slot.end) return;
  const auto& options = param_groups()[info_[index].group].options();
  if (!traits_->lacks_state(options, slot.state)) return;  // every step but the first
  // Where the step keeps it: beside the FP32 main copy, else beside the parameter.
  const c10::Device device = !slot.remainder.defined() && slot.master.defined()
                                 ? slot.master.device()
                                 : slot.param.device();
  std::vector<at::Tensor> state = slot.state;
  step_fresh_[index] = traits_->allocate_state(options, slot.piece_sizes(), device, state);
  step_state_[index] = std::move(state);
}

void Float16Optimizer::step_slot(size_t index, double grad_multiplier) {
  Slot& slot = *slots_[index];
  if (slot.begin != slot.end) {
    const at::Tensor param = slot.piece();
    const at::Tensor& grad = step_grads_[index];
    // The FP32 value stepped: the main copy, the native FP32 parameter, or (remainder) none.
    const at::Tensor target =
        slot.remainder.defined() ? at::Tensor() : (slot.master.defined() ? slot.master : param);
    const at::Tensor model_param = slot.has_master() ? param : at::Tensor();
    // A first step runs with the state create_step_state() made, adopted once it succeeded.
    const std::vector<bool>& fresh = step_fresh_[index];
    std::vector<at::Tensor>& state = fresh.empty() ? slot.state : step_state_[index];
    traits_->step(param_groups()[info_[index].group].options(),
                  {target, grad, model_param, slot.step, grad_multiplier, slot.remainder, fresh},
                  state);
    if (!fresh.empty()) slot.state = std::move(state);
  }
  // Every rank counts the step of a parameter it was taken for, whatever piece it holds.
  ++slot.step;
}

}  // namespace mixprec::optim
