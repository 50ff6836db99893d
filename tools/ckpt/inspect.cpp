#include "ckpt/inspect.h"

#include "ckpt/cli.h"
#include "ckpt/saved_optimizer.h"
#include "ckpt/text_table.h"

#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/state_keys.h"

#include <map>
#include <set>
#include <sstream>

namespace mixprec::tools {
namespace {

namespace fs = std::filesystem;
namespace keys = checkpoint::keys;
using checkpoint::KeyEntry;
using checkpoint::Manifest;

std::uint64_t key_elements(const KeyEntry& entry) {
  std::uint64_t n = 1;
  for (std::int64_t d : entry.shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

std::string key_value_list(const nlohmann::json& object) {
  if (!object.is_object()) return short_json(object, 160);
  std::string out;
  for (const auto& [k, v] : object.items())
    out += (out.empty() ? "" : " ") + k + "=" + short_json(v, 60);
  return out.empty() ? "{}" : out;
}

void print_header(const CheckpointArg& checkpoint, const std::string& shown_as,
                  const Manifest& manifest, const nlohmann::json& common,
                  const std::optional<SavedOptimizer>& opt, std::ostream& out) {
  const fs::path& dir = checkpoint.dir;
  out << "checkpoint   " << dir.string();
  // Named through its root: say which root, and which of its checkpoints this is. Not simply
  // "newest" when newer ones were passed over for not verifying.
  if (checkpoint.from_root) {
    out << "   (newest of the root " << shown_as;
    const std::vector<std::string>& skipped = checkpoint.skipped;
    for (std::size_t i = 0; i < skipped.size(); ++i) {
      out << (i == 0 ? " except " : i + 1 == skipped.size() ? " and " : ", ") << skipped[i];
    }
    if (!skipped.empty())
      out << (skipped.size() == 1 ? ", which does" : ", which do") << " not verify";
    out << ")";
  }
  out << "\nformat       " << checkpoint::kManifestFormat << ", version "
      << checkpoint::manifest_version(manifest) << "\nsequence     " << manifest.sequence
      << "\nfiles        ";
  std::set<std::string> files;
  for (const auto& [key, entry] : manifest.keys) {
    for (const auto& chunk : entry.chunks) files.insert(chunk.file);
  }
  if (manifest.common_file) files.insert(manifest.common_file->file);
  files.insert(std::string(checkpoint::kManifestFileName));
  bool first = true;
  for (const auto& file : files) {
    std::error_code ec;
    const auto size = fs::file_size(dir / file, ec);
    out << (first ? "" : ", ") << file << " (" << (ec ? "unreadable" : human_bytes(size)) << ")";
    first = false;
  }
  out << "\n";
  if (opt) {
    out << "optimizer    " << (opt->algorithm.empty() ? "?" : opt->algorithm) << ", step "
        << opt->step << "\nscaler       "
        << (opt->scaler.is_null() ? "none" : key_value_list(opt->scaler)) << "\n";
    for (std::size_t g = 0; g < opt->group_hyper_params.size(); ++g) {
      out << "group " << g << "      " << key_value_list(opt->group_hyper_params[g]) << "\n";
    }
  } else {
    out << "optimizer    none (common state has no \"optimizer\" object)\n";
  }
  const std::string user(keys::kCommonUser);
  if (common.is_object() && common.contains(user))
    out << "user         " << short_json(common.at(user), 160) << "\n";
}

void print_tensors(const Manifest& manifest, std::ostream& out) {
  std::uint64_t total = 0;
  TextTable table({"KEY", "DTYPE", "SHAPE", "BYTES", "CHUNKS"}, {3, 4});
  for (const auto& [key, entry] : manifest.keys) {
    const std::uint64_t bytes = entry.bytes();
    total += bytes;
    table.add_row({key, std::string(checkpoint::dtype_name(entry.dtype)), dims_string(entry.shape),
                   std::to_string(bytes), std::to_string(entry.chunks.size())});
  }
  out << "\ntensors: " << manifest.keys.size() << " keys, " << total << " bytes ("
      << human_bytes(total) << ")\n";
  table.print(out);
}

struct RoleTotals {
  std::size_t params = 0;
  std::uint64_t elements = 0, model_bytes = 0, optimizer_bytes = 0;
};

void print_parameters(const Manifest& manifest, const SavedOptimizer& opt, std::ostream& out) {
  std::map<SavedRole, RoleTotals> totals;
  std::vector<std::string> warnings;
  TextTable table({"PARAMETER", "ROLE", "MODEL DTYPE", "SHAPE", "GROUP", "STEP", "OPTIMIZER STATE"},
                  {4, 5});
  for (const SavedParam& p : opt.params) {
    RoleTotals& t = totals[p.role];
    ++t.params;
    auto model = manifest.keys.find(p.fqn);
    std::string dtype = "-", shape = "-";
    if (model != manifest.keys.end()) {
      dtype = std::string(checkpoint::dtype_name(model->second.dtype));
      shape = dims_string(model->second.shape);
      t.elements += key_elements(model->second);
      t.model_bytes += model->second.bytes();
    } else {
      warnings.push_back(p.fqn + ": no model tensor under this key");
    }
    // State names only ("exp_avg"), the FQN is in the first column; the master first.
    std::vector<std::string> names;
    for (const std::string& key : p.state_keys) {
      const KeyEntry& entry = manifest.keys.at(key);
      t.optimizer_bytes += entry.bytes();
      const std::size_t prefix = keys::kOptimizerStatePrefix.size();
      const std::string name = key.substr(prefix, key.size() - prefix - p.fqn.size() - 1);
      names.insert(name == keys::kFp32Param ? names.begin() : names.end(), name);
      if (name == keys::kFp32Param && entry.dtype != checkpoint::Dtype::F32) {
        warnings.push_back(p.fqn + ": master is " +
                           std::string(checkpoint::dtype_name(entry.dtype)) + ", not F32");
      }
    }
    std::string state;
    for (const std::string& name : names) state += (state.empty() ? "" : " ") + name;
    if (model != manifest.keys.end()) {
      const bool fp32 = model->second.dtype == checkpoint::Dtype::F32;
      if (p.role == SavedRole::kNativeFp32 && !fp32) {
        warnings.push_back(p.fqn + ": trainable " + dtype + " parameter without an FP32 master");
      }
      if (p.role == SavedRole::kMaster && fp32) {
        warnings.push_back(p.fqn + ": FP32 model parameter with a separate FP32 master");
      }
    }
    table.add_row({p.fqn, role_name(p.role), dtype, shape, std::to_string(p.group),
                   p.has_state ? std::to_string(p.step) : "-", state.empty() ? "-" : state});
  }
  out << "\nparameters: " << opt.params.size() << " in " << opt.group_hyper_params.size()
      << " group" << (opt.group_hyper_params.size() == 1 ? "" : "s") << "\n";
  table.print(out);

  TextTable sums({"ROLE", "PARAMS", "ELEMENTS", "MODEL BYTES", "OPTIMIZER BYTES"}, {1, 2, 3, 4});
  RoleTotals all;
  for (SavedRole role : {SavedRole::kMaster, SavedRole::kNativeFp32, SavedRole::kFrozen}) {
    const RoleTotals& t = totals[role];
    sums.add_row({role_name(role), std::to_string(t.params), std::to_string(t.elements),
                  std::to_string(t.model_bytes), std::to_string(t.optimizer_bytes)});
    all.params += t.params;
    all.elements += t.elements;
    all.model_bytes += t.model_bytes;
    all.optimizer_bytes += t.optimizer_bytes;
  }
  sums.add_row({"total", std::to_string(all.params), std::to_string(all.elements),
                std::to_string(all.model_bytes), std::to_string(all.optimizer_bytes)});
  out << "\ntotals per role\n";
  sums.print(out);
  for (const std::string& key : opt.orphan_state_keys) {
    warnings.push_back(key + ": optimizer state for a parameter in no param group");
  }
  for (const std::string& w : warnings) out << "warning: " << w << "\n";
}

// common["precision"]: which plan rule kept each FP32 tensor. Checked before printing; a
// malformed object is an error naming the field.
std::map<std::string, std::string> read_precision(const nlohmann::json& common,
                                                  const std::string& source) {
  std::map<std::string, std::string> out;
  const std::string field(keys::kCommonPrecision);
  if (!common.is_object() || !common.contains(field)) return out;
  const nlohmann::json& precision = common.at(field);
  if (!precision.is_object())
    throw ToolError(kExitUsage, source + ": " + field + ": expected an object");
  for (const auto& [fqn, reason] : precision.items()) {
    if (!reason.is_string())
      throw ToolError(kExitUsage, source + ": " + field + "." + fqn + ": expected a string");
    out.emplace(fqn, reason.get<std::string>());
  }
  return out;
}

void print_precision(const Manifest& manifest, const std::map<std::string, std::string>& kept,
                     std::ostream& out) {
  out << "\nkept fp32 by the precision plan: " << kept.size() << " tensor"
      << (kept.size() == 1 ? "" : "s") << "\n";
  TextTable table({"TENSOR", "DTYPE", "KEPT BY"}, {});
  std::vector<std::string> warnings;
  for (const auto& [fqn, reason] : kept) {
    auto entry = manifest.keys.find(fqn);
    table.add_row({fqn,
                   entry == manifest.keys.end()
                       ? std::string("-")
                       : std::string(checkpoint::dtype_name(entry->second.dtype)),
                   reason});
    if (entry == manifest.keys.end())
      warnings.push_back(fqn + ": kept fp32 but not in the checkpoint");
  }
  table.print(out);
  for (const std::string& w : warnings) out << "warning: " << w << "\n";
}

}  // namespace

int run_inspect(const CheckpointArg& checkpoint, const std::string& shown_as, std::ostream& out) {
  const fs::path& dir = checkpoint.dir;
  const Manifest manifest = checkpoint::read_manifest(dir);
  const nlohmann::json common = checkpoint::read_common(dir, manifest);
  const std::string common_source =
      (dir / (manifest.common_file ? manifest.common_file->file
                                   : std::string(checkpoint::kManifestFileName)))
          .string();
  const std::optional<SavedOptimizer> opt = read_saved_optimizer(common, manifest, common_source);
  const std::map<std::string, std::string> kept = read_precision(common, common_source);

  // Everything is parsed before anything is printed: a failure leaves stdout empty.
  std::ostringstream text;
  print_header(checkpoint, shown_as, manifest, common, opt, text);
  print_tensors(manifest, text);
  if (opt) print_parameters(manifest, *opt, text);
  if (!kept.empty()) print_precision(manifest, kept, text);
  out << text.str();
  return kExitOk;
}

}  // namespace mixprec::tools
