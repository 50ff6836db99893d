// The table of inner algorithms: Adam, AdamW (one template, two option types) and SGD.
#include "optim/algorithm_traits.h"

#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/optim/fused_kernels.h"
#include "mixprec/optim/master_remainder.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <array>
#include <typeinfo>

namespace mixprec::optim::detail {
namespace {

namespace keys = mixprec::checkpoint::keys;
using torch::optim::OptimizerOptions;

// Reads a saved group's fields, collecting every missing or mistyped one.
class JsonReader {
 public:
  JsonReader(const nlohmann::json& json, const std::string& where,
             std::vector<std::string>& problems)
      : json_(json), where_(where), problems_(problems), start_(problems.size()) {
    if (!json.is_object()) fail("is not an object");
    if (json.is_object() && json.contains("maximize") && json.at("maximize") != false) {
      fail("maximize must be false (LibTorch's option types have no maximize)");
    }
  }
  double number(const char* key) {
    const nlohmann::json* v = field(key);
    if (v && v->is_number()) return v->get<double>();
    fail(std::string("hyper-parameter '") + key + "' missing or not a number");
    return 0.0;
  }
  bool boolean(const char* key) {
    const nlohmann::json* v = field(key);
    if (v && v->is_boolean()) return v->get<bool>();
    fail(std::string("hyper-parameter '") + key + "' missing or not a boolean");
    return false;
  }
  std::tuple<double, double> number_pair(const char* key) {
    const nlohmann::json* v = field(key);
    if (v && v->is_array() && v->size() == 2 && (*v)[0].is_number() && (*v)[1].is_number()) {
      return {(*v)[0].get<double>(), (*v)[1].get<double>()};
    }
    fail(std::string("hyper-parameter '") + key + "' missing or not two numbers");
    return {0.0, 0.0};
  }
  bool ok() const { return problems_.size() == start_; }

 private:
  const nlohmann::json* field(const char* key) const {
    return json_.is_object() && json_.contains(key) ? &json_.at(key) : nullptr;
  }
  void fail(const std::string& what) { problems_.push_back(where_ + what); }

  const nlohmann::json& json_;
  const std::string& where_;
  std::vector<std::string>& problems_;
  size_t start_;
};

// The tensor state is shaped like: the FP32 target, or the BF16 parameter holding a remainder.
const at::Tensor& shape_of(const StepArgs& a) {
  return a.remainder.defined() ? a.model_param : a.target;
}

// torch.optim.Adam (kDecoupled false) and AdamW (true).
template <typename OptionsT, bool kDecoupled>
struct AdamSpec {
  using Options = OptionsT;
  static constexpr Algorithm kAlgorithm = kDecoupled ? Algorithm::kAdamW : Algorithm::kAdam;
  static constexpr std::string_view kName = kDecoupled ? "adamw" : "adam";
  static constexpr std::string_view kOptionsName = kDecoupled ? "AdamWOptions" : "AdamOptions";
  static constexpr std::array<std::string_view, 3> kStateKinds = {keys::kExpAvg, keys::kExpAvgSq,
                                                                  keys::kMaxExpAvgSq};

  static AdamHyperParams hyper_params(const Options& o) {
    AdamHyperParams hp;
    hp.lr = o.lr();
    hp.beta1 = std::get<0>(o.betas());
    hp.beta2 = std::get<1>(o.betas());
    hp.eps = o.eps();
    hp.weight_decay = o.weight_decay();
    hp.decoupled_weight_decay = kDecoupled;
    hp.amsgrad = o.amsgrad();
    return hp;
  }
  static nlohmann::json to_json(const Options& o) {
    return {{"lr", o.lr()},           {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
            {"eps", o.eps()},         {"weight_decay", o.weight_decay()},
            {"amsgrad", o.amsgrad()}, {"maximize", false}};
  }
  static void read_json(JsonReader& in, Options& o) {
    o.lr(in.number("lr"));
    o.betas(in.number_pair("betas"));
    o.eps(in.number("eps"));
    o.weight_decay(in.number("weight_decay"));
    o.amsgrad(in.boolean("amsgrad"));
  }
  static bool holds(const Options& o, size_t kind) { return kind < 2 || o.amsgrad(); }
  // amsgrad switched on after the last step: the step starts max_exp_avg_sq at zeros.
  static constexpr std::array<bool, 3> kRequiredState = {true, true, false};
  static void step(const Options& o, const StepArgs& a, std::vector<at::Tensor>& state) {
    const AdamHyperParams hp = hyper_params(o);
    const at::Tensor& like = shape_of(a);
    const auto fp32 = like.options().dtype(at::kFloat);
    at::Tensor exp_avg = state[0], exp_avg_sq = state[1], max_sq = state[2];
    if (!exp_avg.defined()) {
      exp_avg = at::zeros_like(like, fp32);
      exp_avg_sq = at::zeros_like(like, fp32);
    }
    if (hp.amsgrad && !max_sq.defined()) max_sq = at::zeros_like(like, fp32);
    const at::Tensor max_arg = hp.amsgrad ? max_sq : at::Tensor();
    if (a.remainder.defined()) {
      fused_adam_step_remainder(a.model_param, a.remainder, a.grad, exp_avg, exp_avg_sq, max_arg,
                                a.steps_before + 1, hp, a.grad_multiplier);
    } else {
      fused_adam_step(a.target, a.grad, exp_avg, exp_avg_sq, max_arg, a.model_param,
                      a.steps_before + 1, hp, a.grad_multiplier);
    }
    state = {exp_avg, exp_avg_sq, max_sq};
  }
};

// torch.optim.SGD.
struct SgdSpec {
  using Options = torch::optim::SGDOptions;
  static constexpr Algorithm kAlgorithm = Algorithm::kSgd;
  static constexpr std::string_view kName = "sgd";
  static constexpr std::string_view kOptionsName = "SGDOptions";
  static constexpr std::array<std::string_view, 1> kStateKinds = {keys::kMomentumBuffer};

  static SgdHyperParams hyper_params(const Options& o) {
    SgdHyperParams hp;
    hp.lr = o.lr();
    hp.momentum = o.momentum();
    hp.dampening = o.dampening();
    hp.weight_decay = o.weight_decay();
    hp.nesterov = o.nesterov();
    return hp;
  }
  static nlohmann::json to_json(const Options& o) {
    return {{"lr", o.lr()},
            {"momentum", o.momentum()},
            {"dampening", o.dampening()},
            {"weight_decay", o.weight_decay()},
            {"nesterov", o.nesterov()},
            {"maximize", false}};
  }
  static void read_json(JsonReader& in, Options& o) {
    o.lr(in.number("lr"));
    o.momentum(in.number("momentum"));
    o.dampening(in.number("dampening"));
    o.weight_decay(in.number("weight_decay"));
    o.nesterov(in.boolean("nesterov"));
  }
  static bool holds(const Options& o, size_t /*kind*/) { return o.momentum() != 0; }
  // Momentum switched on after the last step: the step starts the buffer from the gradient.
  static constexpr std::array<bool, 1> kRequiredState = {false};
  static void step(const Options& o, const StepArgs& a, std::vector<at::Tensor>& state) {
    const SgdHyperParams hp = hyper_params(o);
    // torch creates the buffer on the first step with momentum, filled with the gradient.
    const bool first = !state[0].defined() || (!a.fresh.empty() && a.fresh[0]);
    at::Tensor buffer = state[0];
    const at::Tensor& like = shape_of(a);
    if (hp.momentum != 0 && !buffer.defined())
      buffer = at::empty_like(like, like.options().dtype(at::kFloat));
    const at::Tensor buffer_arg = hp.momentum != 0 ? buffer : at::Tensor();
    if (a.remainder.defined()) {
      fused_sgd_step_remainder(a.model_param, a.remainder, a.grad, buffer_arg, first, hp,
                               a.grad_multiplier);
    } else {
      fused_sgd_step(a.target, a.grad, buffer_arg, a.model_param, first, hp, a.grad_multiplier);
    }
    if (hp.momentum != 0) state[0] = buffer;
  }
};

template <typename Spec>
class Traits final : public AlgorithmTraits {
  using Options = typename Spec::Options;

 public:
  Algorithm algorithm() const override { return Spec::kAlgorithm; }
  std::string_view name() const override { return Spec::kName; }
  std::span<const std::string_view> state_kinds() const override { return Spec::kStateKinds; }
  std::string_view options_name() const override { return Spec::kOptionsName; }
  bool owns(const OptimizerOptions& options) const override {
    return typeid(options) == typeid(Options);
  }
  nlohmann::json to_json(const OptimizerOptions& options) const override {
    return Spec::to_json(cast(options));
  }
  std::string range_problem(const OptimizerOptions& options) const override {
    try {
      check_hyper_params(Spec::hyper_params(cast(options)));
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return {};
  }
  std::unique_ptr<OptimizerOptions> from_json(const OptimizerOptions& current,
                                              const nlohmann::json& saved, const std::string& where,
                                              std::vector<std::string>& problems) const override {
    auto out = std::make_unique<Options>(cast(current));
    JsonReader in(saved, where, problems);
    if (in.ok()) Spec::read_json(in, *out);
    if (!in.ok()) return nullptr;
    return out;
  }
  void assign(OptimizerOptions& to, const OptimizerOptions& from) const override {
    cast(to) = cast(from);
  }
  std::vector<bool> held_state(const OptimizerOptions& options) const override {
    std::vector<bool> held(Spec::kStateKinds.size());
    for (size_t i = 0; i < held.size(); ++i) held[i] = Spec::holds(cast(options), i);
    return held;
  }
  bool lacks_state(const OptimizerOptions& options,
                   const std::vector<at::Tensor>& state) const override {
    TORCH_INTERNAL_ASSERT(state.size() == Spec::kStateKinds.size());
    for (size_t i = 0; i < state.size(); ++i) {
      if (!state[i].defined() && Spec::holds(cast(options), i)) return true;
    }
    return false;
  }
  std::vector<bool> required_state() const override {
    return std::vector<bool>(Spec::kRequiredState.begin(), Spec::kRequiredState.end());
  }
  void step(const OptimizerOptions& options, const StepArgs& args,
            std::vector<at::Tensor>& state) const override {
    TORCH_INTERNAL_ASSERT(state.size() == Spec::kStateKinds.size());
    Spec::step(cast(options), args, state);
  }

 private:
  // Callers establish the type first (owns(), checked for every group before use).
  static const Options& cast(const OptimizerOptions& options) {
    TORCH_INTERNAL_ASSERT(typeid(options) == typeid(Options), "options are not ",
                          Spec::kOptionsName);
    return static_cast<const Options&>(options);
  }
  static Options& cast(OptimizerOptions& options) {
    return const_cast<Options&>(cast(static_cast<const OptimizerOptions&>(options)));
  }
};

}  // namespace

std::vector<bool> AlgorithmTraits::allocate_state(const OptimizerOptions& options,
                                                  at::IntArrayRef sizes, c10::Device device,
                                                  std::vector<at::Tensor>& state) const {
  const std::vector<bool> held = held_state(options);
  TORCH_INTERNAL_ASSERT(state.size() == held.size());
  std::vector<bool> fresh(held.size(), false);
  for (size_t i = 0; i < held.size(); ++i) {
    if (!held[i] || state[i].defined()) continue;
    state[i] = at::zeros(sizes, at::TensorOptions().dtype(at::kFloat).device(device));
    fresh[i] = true;
  }
  return fresh;
}

const AlgorithmTraits& traits_for(const OptimizerOptions& options, std::string_view who) {
  static const Traits<AdamSpec<torch::optim::AdamWOptions, true>> adamw;
  static const Traits<AdamSpec<torch::optim::AdamOptions, false>> adam;
  static const Traits<SgdSpec> sgd;
  static const std::array<const AlgorithmTraits*, 3> table = {&adamw, &adam, &sgd};
  std::string known;
  for (const AlgorithmTraits* traits : table) {
    if (traits->owns(options)) return *traits;
    known += (known.empty() ? "" : ", ") + std::string(traits->options_name());
  }
  TORCH_CHECK(false, "[", who, "] options must be one of ", known, ", got ",
              typeid(options).name());
}

}  // namespace mixprec::optim::detail
