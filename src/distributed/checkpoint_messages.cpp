#include "distributed/checkpoint_messages.h"

#include <c10/util/Exception.h>

namespace mixprec::distributed::detail {

using checkpoint::Chunk;
using checkpoint::WrittenTensor;
using checkpoint::detail::RankPlan;

nlohmann::json plan_to_json(const RankPlan& plan) {
  nlohmann::json keys = nlohmann::json::object();
  for (const auto& [key, entry] : plan.keys) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const Chunk& c : entry.chunks) {
      chunks.push_back({{"file", c.file},
                        {"tensor", c.tensor},
                        {"offset", c.box.offset},
                        {"shape", c.box.shape},
                        {"bytes", c.bytes}});
    }
    keys[key] = {{"dtype", std::string(checkpoint::dtype_name(entry.dtype))},
                 {"shape", entry.global_shape},
                 {"chunks", std::move(chunks)}};
  }
  return keys;
}

RankPlan plan_from_json(const nlohmann::json& json) {
  RankPlan plan;
  for (const auto& [key, entry] : json.items()) {
    const auto dtype = checkpoint::parse_dtype(entry.at("dtype").get<std::string>());
    TORCH_INTERNAL_ASSERT(dtype, "a rank sent an unknown dtype for '", key, "'");
    RankPlan::Key& k = plan.keys[key];
    k.dtype = *dtype;
    k.global_shape = entry.at("shape").get<std::vector<int64_t>>();
    for (const auto& c : entry.at("chunks")) {
      Chunk chunk;
      chunk.file = c.at("file").get<std::string>();
      chunk.tensor = c.at("tensor").get<std::string>();
      chunk.box.offset = c.at("offset").get<std::vector<int64_t>>();
      chunk.box.shape = c.at("shape").get<std::vector<int64_t>>();
      chunk.bytes = c.at("bytes").get<uint64_t>();
      k.chunks.push_back(std::move(chunk));
    }
  }
  return plan;
}

nlohmann::json written_to_json(const std::map<std::string, WrittenTensor>& written) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, w] : written) {
    out[name] = {{"bytes", w.byte_size}, {"xxh3", w.checksum}, {"blocks", w.block_checksums}};
  }
  return out;
}

std::map<std::string, WrittenTensor> written_from_json(const nlohmann::json& json) {
  std::map<std::string, WrittenTensor> out;
  for (const auto& [name, w] : json.items()) {
    out[name] = WrittenTensor{name, w.at("bytes").get<uint64_t>(), w.at("xxh3").get<uint64_t>(),
                              w.at("blocks").get<std::vector<uint64_t>>()};
  }
  return out;
}

nlohmann::json options_to_json(const checkpoint::SaveOptions& options) {
  return {{"update_latest", options.update_latest()},
          {"keep_last", options.keep_last()},
          {"in_use", options.in_use()},
          {"lock_timeout", std::to_string(options.lock_timeout().count()) + " ms"},
          {"stale_staging_timeout", std::to_string(options.stale_staging_timeout().count()) + " s"},
          {"checksum_block_bytes", options.checksum_block_bytes()}};
}

nlohmann::json result_to_json(const checkpoint::SaveResult& r) {
  return {{"dir", r.dir.string()},
          {"tensor_bytes", r.tensor_bytes},
          {"files", r.files},
          {"deleted", r.deleted},
          {"cleaned_staging", r.cleaned_staging},
          {"repaired_latest", r.repaired_latest ? nlohmann::json(*r.repaired_latest) : nullptr},
          {"warnings", r.warnings}};
}

checkpoint::SaveResult result_from_json(const nlohmann::json& json) {
  checkpoint::SaveResult r;
  r.dir = json.at("dir").get<std::string>();
  r.tensor_bytes = json.at("tensor_bytes").get<uint64_t>();
  r.files = json.at("files").get<size_t>();
  r.deleted = json.at("deleted").get<std::vector<std::string>>();
  r.cleaned_staging = json.at("cleaned_staging").get<std::vector<std::string>>();
  if (!json.at("repaired_latest").is_null()) {
    r.repaired_latest = json.at("repaired_latest").get<std::string>();
  }
  r.warnings = json.at("warnings").get<std::vector<std::string>>();
  return r;
}

}  // namespace mixprec::distributed::detail
