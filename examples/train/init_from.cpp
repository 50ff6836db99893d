#include "init_from.h"

#include "config.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/tensor_dtype.h"
#include "mixprec/sharded_state_dict.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>

namespace train {
namespace {

namespace fs = std::filesystem;
namespace ckpt = mixprec::checkpoint;

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

std::string dims(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// A file of the export with the tensors the index (if any) assigns to it.
struct ExportFile {
  fs::path path;
  std::optional<std::vector<std::string>> listed;  // from weight_map; nullopt: no index
};

std::vector<ExportFile> files_of_index(const fs::path& index) {
  const std::string where = "--init-from " + index.string();
  nlohmann::json json;
  try {
    std::ifstream in(index);
    if (!in) throw UsageError(where + ": cannot be read");
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(where + ": not valid JSON (" + e.what() + ")");
  }
  if (!json.is_object() || !json.contains("weight_map") || !json.at("weight_map").is_object()) {
    throw UsageError(where + ": no \"weight_map\" object (not a safetensors index)");
  }
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : json.at("weight_map").items()) {
    const std::string plain = file.is_string() ? file.get<std::string>() : std::string();
    if (plain.empty() || plain.find('/') != std::string::npos || plain.starts_with(".")) {
      throw UsageError(where + ": tensor '" + name + "' is mapped to " + file.dump() +
                       ", not a file name beside the index");
    }
    by_file[plain].push_back(name);
  }
  std::vector<ExportFile> files;
  for (auto& [file, names] : by_file) files.push_back({index.parent_path() / file, names});
  return files;
}

std::vector<ExportFile> export_files(const fs::path& path, std::string& source) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) {
    throw UsageError("--init-from " + path.string() + ": no such file or directory");
  }
  if (!fs::is_directory(status)) {
    source = path.string();
    return {{path, std::nullopt}};
  }
  if (fs::exists(path / kIndexName, ec)) {
    source = (path / kIndexName).string();
    return files_of_index(path / kIndexName);
  }
  if (fs::exists(path / kSingleName, ec)) {
    source = (path / kSingleName).string();
    return {{path / kSingleName, std::nullopt}};
  }
  throw UsageError("--init-from " + path.string() + ": holds neither " + kIndexName + " nor " +
                   kSingleName + " (expected a mixprec-ckpt export or a .safetensors file)");
}

// Where each tensor of the export is.
struct Located {
  size_t file;  // index into the export's files (and their readers)
  const ckpt::TensorEntry* entry;
};

}  // namespace

InitFromResult init_from(torch::nn::Module& model, const fs::path& path) {
  InitFromResult result;
  const std::vector<ExportFile> files = export_files(path, result.source);

  // Every file opened and its header checked; every name placed once.
  std::vector<ckpt::SafetensorsReader> readers;
  std::map<std::string, Located> found;
  try {
    readers.reserve(files.size());
    for (const ExportFile& file : files) readers.emplace_back(fs::weakly_canonical(file.path));
  } catch (const ckpt::FormatError& e) {
    throw UsageError(std::string("--init-from: ") + e.what());
  }
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = "--init-from " + files[i].path.string();
    for (const ckpt::TensorEntry& entry : readers[i].header().tensors) {
      if (!found.emplace(entry.name, Located{i, &entry}).second) {
        throw UsageError(where + ": tensor '" + entry.name + "' is in another file too");
      }
    }
    if (!files[i].listed) continue;
    for (const std::string& name : *files[i].listed) {
      if (readers[i].header().find(name) == nullptr) {
        throw UsageError(where + ": no tensor '" + name + "', which " + result.source +
                         " places there");
      }
    }
    if (files[i].listed->size() != readers[i].header().tensors.size()) {
      for (const ckpt::TensorEntry& entry : readers[i].header().tensors) {
        const auto& listed = *files[i].listed;
        if (std::find(listed.begin(), listed.end(), entry.name) == listed.end()) {
          throw UsageError(where + ": tensor '" + entry.name + "' is not in " + result.source);
        }
      }
    }
  }

  // Names, shapes and dtypes against the model's own tensors, before reading any data.
  const mixprec::ShardedStateDict own = mixprec::model_sharded_state_dict(model);
  for (const auto& [name, tensor] : own.tensors) {
    const at::Tensor& target = tensor.local;
    const auto it = found.find(name);
    if (it == found.end()) {
      throw UsageError("--init-from " + result.source + ": no tensor '" + name +
                       "', which the model has (" + c10::toString(target.scalar_type()) + " " +
                       dims(target.sizes().vec()) + ")");
    }
    const ckpt::TensorEntry& entry = *it->second.entry;
    const std::string where =
        "--init-from " + files[it->second.file].path.string() + ": tensor '" + name + "'";
    if (entry.shape != target.sizes().vec()) {
      throw UsageError(where + " has shape " + dims(entry.shape) + ", the model's is " +
                       dims(target.sizes().vec()) +
                       " (give the model flags of the exported run: its mixprec.config metadata)");
    }
    const c10::ScalarType stored = ckpt::to_scalar_type(entry.dtype);
    if (stored != target.scalar_type() &&
        !(at::isFloatingType(stored) && at::isFloatingType(target.scalar_type()))) {
      throw UsageError(where + " is " + std::string(ckpt::dtype_name(entry.dtype)) +
                       ", the model's is " + c10::toString(target.scalar_type()));
    }
  }
  for (const auto& [name, where] : found) {
    if (!own.contains(name)) {
      throw UsageError("--init-from " + files[where.file].path.string() + ": tensor '" + name +
                       "' is not in the model");
    }
  }

  // Read, then copy in: the library converts floating dtypes and checks again.
  mixprec::ShardedStateDict state;
  try {
    for (const auto& [name, where] : found) {
      at::Tensor value = at::empty(where.entry->shape, ckpt::to_scalar_type(where.entry->dtype));
      readers[where.file].read(name, {static_cast<std::byte*>(value.data_ptr()), value.nbytes()});
      state.tensors.emplace(name, mixprec::ShardedTensor::whole(value));
    }
    mixprec::load_model_sharded_state_dict(model, state);
  } catch (const ckpt::FormatError& e) {
    throw UsageError(std::string("--init-from: ") + e.what());
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    throw UsageError("--init-from " + result.source + ": " + message.substr(0, message.find('\n')));
  }
  result.tensors = found.size();
  return result;
}

}  // namespace train
