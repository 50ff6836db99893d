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
  // id -> {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad), "momentum_buffer"
  //        (SGD)}; only ids that have state. "step" is a 0-dim FP64, for every algorithm: exact
  //        to 2^53 steps where torch's FP32 is exact to 2^24 (loads take any numeric scalar;
  //        torch's SGD keeps none and ignores it).
  std::map<int64_t, std::map<std::string, at::Tensor>> state;
  // [{hyper-parameters..., "params": [ids]}], one object per group, in group order.
  nlohmann::json param_groups = nlohmann::json::array();
  // LossScaler::state().
  nlohmann::json scaler = nlohmann::json::object();
  // id -> FP32 main copy, only for parameters that have one.
  std::map<int64_t, at::Tensor> fp32_params;
};

}  // namespace mixprec::optim
