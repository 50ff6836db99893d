// Private: what Float16Optimizer keeps per parameter.
#pragma once

#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <functional>

namespace mixprec::optim {

struct Float16Optimizer::Slot {
  at::Tensor param;   // the model's parameter (same TensorImpl)
  at::Tensor master;  // FP32 main copy (kMaster only)
  int64_t step = 0;   // updates applied so far (torch's per-parameter "step")
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer;

  bool has_state() const { return step > 0; }
  // The FP32 tensor the inner algorithm updates: the main copy or the parameter itself.
  at::Tensor fp32_target() const { return master.defined() ? master : param.detach(); }
};

// A state dict parsed against the optimizer's current parameters, before anything is applied.
struct Float16Optimizer::Loaded {
  struct Param {
    int64_t step = 0;
    std::map<std::string, at::Tensor> moments;  // exp_avg, exp_avg_sq, max_exp_avg_sq, ...
    at::Tensor fp32;          // FP32 value for the parameter: a saved main copy, or the model's
    std::string fp32_source;  // FP32 tensor across a plan change; and the key it came from
    bool fresh_ok = false;    // saved without state (frozen or never stepped): may start fresh
    bool needs_moments = true;  // set while checking: SGD without momentum keeps only a step
  };
  std::vector<Param> params;  // parallel to the optimizer's slots
  nlohmann::json groups;      // per group: hyper-parameters
  nlohmann::json scaler;
  LoadReport report;
  std::vector<std::string> problems;  // errors in either mode
};

namespace detail {

// Hyper-parameters of one group, read from torch's option types.
AdamHyperParams adam_hyper_params(const torch::optim::OptimizerOptions& options, Algorithm algo);
SgdHyperParams sgd_hyper_params(const torch::optim::OptimizerOptions& options);

// {hyper-parameter: value} as torch's param_groups spell them (no "params").
nlohmann::json group_hyper_params_json(const torch::optim::OptimizerOptions& options,
                                       Algorithm algo);
// Checks `json` has every hyper-parameter of `algo` with the right type; returns problems.
std::vector<std::string> check_group_hyper_params(const nlohmann::json& json, Algorithm algo,
                                                  size_t group);
// Checks a saved "param_groups" array against the optimizer's groups: the same number of
// groups, each with a "params" list as long as the optimizer's and valid hyper-parameters.
// `entry_problem(group, position, flat_index, entry)` judges each listed parameter (an id or
// a name) and returns "" when it matches. Appends every problem found to `problems`.
void check_saved_groups(
    const nlohmann::json& groups, const std::vector<torch::optim::OptimizerParamGroup>& current,
    Algorithm algo,
    const std::function<std::string(size_t group, size_t position, size_t flat_index,
                                    const nlohmann::json& entry)>& entry_problem,
    std::vector<std::string>& problems);

// Writes checked hyper-parameters into the group's options.
void set_group_hyper_params(torch::optim::OptimizerOptions& options, const nlohmann::json& json,
                            Algorithm algo);

const char* algorithm_name(Algorithm algo);

// Prefix of every optimizer tensor key in a sharded state dict.
inline constexpr const char* kStatePrefix = "optimizer.state.";
// Per-parameter state tensors of each algorithm, by torch's names.
inline const std::vector<std::string> kAdamKeys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
inline const std::vector<std::string> kSgdKeys = {"momentum_buffer"};

// State dicts alias the optimizer's tensors, as torch's do: no copy of the whole state.
inline at::Tensor copy_of(const at::Tensor& t) { return t.detach(); }

}  // namespace detail
}  // namespace mixprec::optim
