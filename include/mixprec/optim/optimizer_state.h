// The optimizer's state in torch's positional form.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>

namespace mixprec::optim {

// Mirrors torch.optim.Optimizer.state_dict(): parameter ids count every parameter of every
// group in order, frozen ones included (they have no state but keep their id).
struct PositionalStateDict {
  // id -> {"step" (0-dim FP32, as torch stores it), "exp_avg", "exp_avg_sq",
  //        "max_exp_avg_sq" (amsgrad), "momentum_buffer" (SGD)}; only ids that have state.
  std::map<int64_t, std::map<std::string, at::Tensor>> state;
  // [{hyper-parameters..., "params": [ids]}], one object per group, in group order.
  nlohmann::json param_groups = nlohmann::json::array();
  // LossScaler::state().
  nlohmann::json scaler = nlohmann::json::object();
  // id -> FP32 main copy, only for parameters that have one.
  std::map<int64_t, at::Tensor> fp32_params;
};

}  // namespace mixprec::optim
