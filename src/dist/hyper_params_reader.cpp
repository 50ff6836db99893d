#include "dist/hyper_params_reader.h"

#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <typeinfo>

namespace mixprec::dist::detail {

using optim::Algorithm;

optim::Algorithm algorithm_of(const torch::optim::OptimizerOptions& options, const char* who) {
  if (dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return Algorithm::kAdamW;
  if (dynamic_cast<const torch::optim::AdamOptions*>(&options)) return Algorithm::kAdam;
  if (dynamic_cast<const torch::optim::SGDOptions*>(&options)) return Algorithm::kSgd;
  TORCH_CHECK(false, "[", who, "] options must be AdamWOptions, AdamOptions or SGDOptions, got ",
              typeid(options).name());
}

optim::AdamHyperParams adam_hyper_params(const torch::optim::OptimizerOptions& options,
                                         Algorithm algorithm) {
  optim::AdamHyperParams hp;
  auto fill = [&hp](const auto& o) {
    hp.lr = o.lr();
    hp.beta1 = std::get<0>(o.betas());
    hp.beta2 = std::get<1>(o.betas());
    hp.eps = o.eps();
    hp.weight_decay = o.weight_decay();
    hp.amsgrad = o.amsgrad();
  };
  if (algorithm == Algorithm::kAdamW) {
    fill(static_cast<const torch::optim::AdamWOptions&>(options));
    hp.decoupled_weight_decay = true;
  } else {
    fill(static_cast<const torch::optim::AdamOptions&>(options));
    hp.decoupled_weight_decay = false;
  }
  return hp;
}

optim::SgdHyperParams sgd_hyper_params(const torch::optim::OptimizerOptions& options) {
  const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
  optim::SgdHyperParams hp;
  hp.lr = o.lr();
  hp.momentum = o.momentum();
  hp.dampening = o.dampening();
  hp.weight_decay = o.weight_decay();
  hp.nesterov = o.nesterov();
  return hp;
}

const char* algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAdam:
      return "adam";
    case Algorithm::kAdamW:
      return "adamw";
    case Algorithm::kSgd:
      return "sgd";
  }
  return "?";
}

}  // namespace mixprec::dist::detail
