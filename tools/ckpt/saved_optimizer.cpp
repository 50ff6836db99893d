#include "ckpt/saved_optimizer.h"

#include "ckpt/cli.h"

#include "mixprec/checkpoint/format/state_keys.h"

#include <map>
#include <set>

namespace mixprec::tools {
namespace {

namespace keys = checkpoint::keys;

// The reserved names of state_keys.h as JSON member names.
std::string field(std::string_view name) { return std::string(name); }

// Every malformed-field error names the file and the JSON path, e.g.
// ".../common.json: optimizer.param_groups[1].params[3]: expected a string".
[[noreturn]] void malformed(const std::string& source, const std::string& path,
                            const std::string& what) {
  throw ToolError(kExitUsage,
                  source + ": " + field(keys::kCommonOptimizer) + "." + path + ": " + what);
}

std::vector<std::string> string_list(const nlohmann::json& parent, std::string_view name,
                                     const std::string& path, const std::string& source) {
  std::vector<std::string> out;
  if (!parent.contains(field(name))) return out;
  const nlohmann::json& list = parent.at(field(name));
  if (!list.is_array()) malformed(source, path, "expected an array of FQNs");
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string())
      malformed(source, path + "[" + std::to_string(i) + "]", "expected a string");
    out.push_back(list[i].get<std::string>());
  }
  return out;
}

}  // namespace

const char* role_name(SavedRole role) {
  switch (role) {
    case SavedRole::kMaster:
      return "fp32 master";
    case SavedRole::kNativeFp32:
      return "native fp32";
    case SavedRole::kFrozen:
      return "frozen";
  }
  return "?";
}

std::optional<SavedOptimizer> read_saved_optimizer(const nlohmann::json& common,
                                                   const checkpoint::Manifest& manifest,
                                                   const std::string& source) {
  if (!common.is_object() || !common.contains(field(keys::kCommonOptimizer))) return std::nullopt;
  const nlohmann::json& opt = common.at(field(keys::kCommonOptimizer));
  if (!opt.is_object()) {
    throw ToolError(kExitUsage,
                    source + ": " + field(keys::kCommonOptimizer) + ": expected an object");
  }

  SavedOptimizer out;
  const std::string algorithm = field(keys::kAlgorithm), step = field(keys::kStep);
  if (opt.contains(algorithm)) {
    if (!opt.at(algorithm).is_string()) malformed(source, algorithm, "expected a string");
    out.algorithm = opt.at(algorithm).get<std::string>();
  }
  if (!opt.contains(step) || !opt.at(step).is_number_integer() ||
      opt.at(step).get<std::int64_t>() < 0) {
    malformed(source, step, "missing or not a non-negative integer");
  }
  out.step = opt.at(step).get<std::int64_t>();
  const std::string scaler = field(keys::kScaler);
  out.scaler = opt.contains(scaler) ? opt.at(scaler) : nlohmann::json();

  std::map<std::string, std::int64_t> steps;
  const std::string steps_field = field(keys::kSteps);
  if (opt.contains(steps_field)) {
    if (!opt.at(steps_field).is_object()) malformed(source, steps_field, "expected an object");
    for (const auto& [fqn, s] : opt.at(steps_field).items()) {
      if (!s.is_number_integer()) malformed(source, steps_field + "." + fqn, "expected an integer");
      steps[fqn] = s.get<std::int64_t>();
    }
  }
  const std::vector<std::string> frozen_list =
      string_list(opt, keys::kFrozen, field(keys::kFrozen), source);
  const std::vector<std::string> without_list =
      string_list(opt, keys::kWithoutState, field(keys::kWithoutState), source);
  const std::set<std::string> frozen(frozen_list.begin(), frozen_list.end());
  const std::set<std::string> without_state(without_list.begin(), without_list.end());

  // State keys by FQN. State names (exp_avg, fp32_param, …) hold no '.', FQNs may.
  std::map<std::string, std::vector<std::string>> state_keys;
  for (const auto& [key, entry] : manifest.keys) {
    if (!key.starts_with(keys::kOptimizerStatePrefix)) continue;
    const std::string rest = key.substr(keys::kOptimizerStatePrefix.size());
    const auto dot = rest.find('.');
    state_keys[dot == std::string::npos ? std::string() : rest.substr(dot + 1)].push_back(key);
  }

  const std::string param_groups = field(keys::kParamGroups), params = field(keys::kParams);
  if (!opt.contains(param_groups) || !opt.at(param_groups).is_array()) {
    malformed(source, param_groups, "missing or not an array");
  }
  const nlohmann::json& groups = opt.at(param_groups);
  std::set<std::string> seen;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string where = param_groups + "[" + std::to_string(g) + "]";
    if (!groups[g].is_object()) malformed(source, where, "expected an object");
    nlohmann::json hyper = groups[g];
    hyper.erase(params);
    out.group_hyper_params.push_back(std::move(hyper));
    for (const std::string& fqn :
         string_list(groups[g], keys::kParams, where + "." + params, source)) {
      if (!seen.insert(fqn).second)
        malformed(source, where + "." + params, "'" + fqn + "' listed twice");
      SavedParam p;
      p.fqn = fqn;
      p.group = g;
      auto keys = state_keys.find(fqn);
      if (keys != state_keys.end()) p.state_keys = keys->second;
      const bool has_master =
          manifest.keys.count(keys::optimizer_state_key(keys::kFp32Param, fqn)) != 0;
      p.role = frozen.count(fqn) ? SavedRole::kFrozen
               : has_master      ? SavedRole::kMaster
                                 : SavedRole::kNativeFp32;
      p.has_state = p.role != SavedRole::kFrozen && !without_state.count(fqn);
      auto s = steps.find(fqn);
      p.step = s != steps.end() ? s->second : (p.has_state ? out.step : 0);
      out.params.push_back(std::move(p));
    }
  }
  for (const auto& [fqn, keys] : state_keys) {
    if (!seen.count(fqn))
      out.orphan_state_keys.insert(out.orphan_state_keys.end(), keys.begin(), keys.end());
  }
  return out;
}

}  // namespace mixprec::tools
