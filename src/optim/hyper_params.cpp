#include "optim/optimizer_slot.h"

#include <c10/util/Exception.h>

namespace mixprec::optim::detail {

using torch::optim::AdamOptions;
using torch::optim::AdamWOptions;
using torch::optim::SGDOptions;

const char* algorithm_name(Algorithm algo) {
  switch (algo) {
    case Algorithm::kAdam: return "adam";
    case Algorithm::kAdamW: return "adamw";
    case Algorithm::kSgd: return "sgd";
  }
  return "?";
}

AdamHyperParams adam_hyper_params(const torch::optim::OptimizerOptions& options, Algorithm algo) {
  AdamHyperParams hp;
  auto fill = [&hp](const auto& o) {
    hp.lr = o.lr();
    hp.beta1 = std::get<0>(o.betas());
    hp.beta2 = std::get<1>(o.betas());
    hp.eps = o.eps();
    hp.weight_decay = o.weight_decay();
    hp.amsgrad = o.amsgrad();
  };
  if (algo == Algorithm::kAdamW) {
    fill(static_cast<const AdamWOptions&>(options));
    hp.decoupled_weight_decay = true;
  } else {
    fill(static_cast<const AdamOptions&>(options));
    hp.decoupled_weight_decay = false;
  }
  return hp;
}

SgdHyperParams sgd_hyper_params(const torch::optim::OptimizerOptions& options) {
  const auto& o = static_cast<const SGDOptions&>(options);
  SgdHyperParams hp;
  hp.lr = o.lr();
  hp.momentum = o.momentum();
  hp.dampening = o.dampening();
  hp.weight_decay = o.weight_decay();
  hp.nesterov = o.nesterov();
  return hp;
}

nlohmann::json group_hyper_params_json(const torch::optim::OptimizerOptions& options,
                                       Algorithm algo) {
  if (algo == Algorithm::kSgd) {
    const SgdHyperParams hp = sgd_hyper_params(options);
    return {{"lr", hp.lr},
            {"momentum", hp.momentum},
            {"dampening", hp.dampening},
            {"weight_decay", hp.weight_decay},
            {"nesterov", hp.nesterov},
            {"maximize", false}};
  }
  const AdamHyperParams hp = adam_hyper_params(options, algo);
  return {{"lr", hp.lr},
          {"betas", {hp.beta1, hp.beta2}},
          {"eps", hp.eps},
          {"weight_decay", hp.weight_decay},
          {"amsgrad", hp.amsgrad},
          {"maximize", false}};
}

std::vector<std::string> check_group_hyper_params(const nlohmann::json& json, Algorithm algo,
                                                  size_t group) {
  std::vector<std::string> problems;
  const std::string where = "param group " + std::to_string(group) + ": ";
  if (!json.is_object()) return {where + "is not an object"};
  auto number = [&](const char* key) {
    if (!json.contains(key) || !json.at(key).is_number()) {
      problems.push_back(where + "hyper-parameter '" + key + "' missing or not a number");
    }
  };
  auto boolean = [&](const char* key) {
    if (!json.contains(key) || !json.at(key).is_boolean()) {
      problems.push_back(where + "hyper-parameter '" + key + "' missing or not a boolean");
    }
  };
  number("lr");
  number("weight_decay");
  if (algo == Algorithm::kSgd) {
    number("momentum");
    number("dampening");
    boolean("nesterov");
  } else {
    number("eps");
    boolean("amsgrad");
    const auto& betas = json.contains("betas") ? json.at("betas") : nlohmann::json();
    if (!betas.is_array() || betas.size() != 2 || !betas[0].is_number() || !betas[1].is_number()) {
      problems.push_back(where + "hyper-parameter 'betas' missing or not two numbers");
    }
  }
  if (json.contains("maximize") && json.at("maximize") == true) {
    problems.push_back(where + "maximize=true is not supported by LibTorch's option types");
  }
  return problems;
}

void check_saved_groups(
    const nlohmann::json& groups, const std::vector<torch::optim::OptimizerParamGroup>& current,
    Algorithm algo,
    const std::function<std::string(size_t, size_t, size_t, const nlohmann::json&)>& entry_problem,
    std::vector<std::string>& problems) {
  if (!groups.is_array() || groups.size() != current.size()) {
    problems.push_back("the state has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                       " param groups, the optimizer has " + std::to_string(current.size()));
    return;
  }
  size_t flat = 0;  // the optimizer's flat parameter index (torch's id) of the group's first
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& listed = groups[g].contains("params") ? groups[g]["params"] : nlohmann::json();
    const size_t want = current[g].params().size();
    if (!listed.is_array() || listed.size() != want) {
      problems.push_back("param group " + std::to_string(g) + " has " +
                         std::to_string(listed.is_array() ? listed.size() : 0) +
                         " params in the state, " + std::to_string(want) + " in the optimizer");
    } else {
      for (size_t i = 0; i < want; ++i) {
        std::string problem = entry_problem(g, i, flat + i, listed[i]);
        if (!problem.empty()) {
          problems.push_back("param group " + std::to_string(g) + " position " +
                             std::to_string(i) + ": " + problem);
        }
      }
    }
    flat += want;
    auto hp = check_group_hyper_params(groups[g], algo, g);
    problems.insert(problems.end(), hp.begin(), hp.end());
  }
}

void set_group_hyper_params(torch::optim::OptimizerOptions& options, const nlohmann::json& json,
                            Algorithm algo) {
  if (algo == Algorithm::kSgd) {
    auto& o = static_cast<SGDOptions&>(options);
    o.lr(json.at("lr").get<double>());
    o.momentum(json.at("momentum").get<double>());
    o.dampening(json.at("dampening").get<double>());
    o.weight_decay(json.at("weight_decay").get<double>());
    o.nesterov(json.at("nesterov").get<bool>());
    return;
  }
  auto set = [&](auto& o) {
    o.lr(json.at("lr").get<double>());
    o.betas({json.at("betas")[0].get<double>(), json.at("betas")[1].get<double>()});
    o.eps(json.at("eps").get<double>());
    o.weight_decay(json.at("weight_decay").get<double>());
    o.amsgrad(json.at("amsgrad").get<bool>());
  };
  if (algo == Algorithm::kAdamW) {
    set(static_cast<AdamWOptions&>(options));
  } else {
    set(static_cast<AdamOptions&>(options));
  }
}

}  // namespace mixprec::optim::detail
