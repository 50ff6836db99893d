// Planning a save: which tensors each rank's data file holds, and whether the ranks' chunks
// together form every key exactly. Pure bookkeeping, no I/O: the synchronous, asynchronous and
// collective (distributed/collective_checkpoint.h) saves all check a state here before writing.
#include "checkpoint/save_pipeline.h"

#include "detail/name_match.h"
#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/tensor_dtype.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <map>

namespace mixprec::checkpoint::detail {

std::string data_file_name(size_t rank) {
  char name[48];
  std::snprintf(name, sizeof(name), "data-%05zu.safetensors", rank);
  return name;
}

std::vector<StoredTensor> stored_tensors(const std::string& key, const ShardedTensor& shard) {
  if (!shard.flat_range) return {{key, Box{shard.global_offset, shard.local.sizes().vec()}, 0}};
  const std::vector<Box> boxes =
      flat_range_boxes(shard.global_shape, shard.flat_range->begin, shard.flat_range->end);
  std::vector<StoredTensor> out;
  int64_t begin = 0;
  for (size_t i = 0; i < boxes.size(); ++i) {
    std::string name = boxes.size() == 1 ? key : key + "/" + std::to_string(i);
    out.push_back({std::move(name), boxes[i], begin});
    begin += static_cast<int64_t>(boxes[i].volume());
  }
  return out;
}

namespace {

// "" if the shard's local tensor, offset or flat range fit its global shape; else why not.
std::string shape_problem(const ShardedTensor& shard) {
  if (shard.flat_range) {
    int64_t numel = 1;
    for (int64_t d : shard.global_shape) numel *= d;
    const FlatRange& r = *shard.flat_range;
    if (shard.local.dim() == 1 && r.begin >= 0 && r.begin <= r.end && r.end <= numel &&
        shard.local.numel() == r.numel() && shard.global_offset.empty()) {
      return {};
    }
    return "flat range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
           ") with a local tensor of shape " + dims_to_string(shard.local.sizes().vec()) +
           " does not fit global shape " + dims_to_string(shard.global_shape) +
           " (the local tensor must be 1-D with the range's length, and no offset given)";
  }
  if (shard.global_offset.size() == shard.global_shape.size() &&
      shard.local.dim() == static_cast<int64_t>(shard.global_shape.size())) {
    return {};
  }
  return "local rank " + std::to_string(shard.local.dim()) + ", global shape " +
         dims_to_string(shard.global_shape) + ", offset " + dims_to_string(shard.global_offset);
}

}  // namespace

RankPlan plan_rank(const ShardedStateDict& state, size_t rank, std::vector<std::string>& problems,
                   bool name_rank) {
  const std::string of_rank = name_rank ? " (rank " + std::to_string(rank) + ")" : "";
  RankPlan plan;
  // A flat slice of key 'a' is stored as tensors 'a/0', 'a/1', … of the rank's data file: a key
  // spelled like one of them would name the same tensor. Refused here, naming both keys, before
  // the file's header is written (which would refuse it as a tensor "declared twice").
  std::map<std::string, std::string> stored_by;  // tensor name in this rank's file → its key
  for (const auto& [key, shard] : state.tensors) {
    const std::string where = "key '" + key + "'" + of_rank;
    if (!shard.local.defined()) {
      problems.push_back(where + ": undefined tensor");
      continue;
    }
    const Dtype dtype = to_checkpoint_dtype(shard.local.scalar_type());
    if (const std::string bad = shape_problem(shard); !bad.empty()) {
      problems.push_back(where + ": " + bad);
      continue;
    }
    RankPlan::Key& entry = plan.keys[key];
    entry.dtype = dtype;
    entry.global_shape = shard.global_shape;
    if (shard.replica_id != 0) continue;  // a replica: written once, by its replica 0
    for (StoredTensor& stored : stored_tensors(key, shard)) {
      if (const auto [it, fresh] = stored_by.try_emplace(stored.name, key); !fresh) {
        problems.push_back("keys '" + it->second + "' and '" + key + "'" + of_rank +
                           " would both be stored as tensor '" + stored.name +
                           "' (a flat slice of '" + (it->second == stored.name ? key : it->second) +
                           "' is stored in pieces named '<key>/<i>'); rename one of them");
        continue;
      }
      Chunk chunk;
      chunk.file = data_file_name(rank);
      chunk.tensor = std::move(stored.name);
      chunk.bytes = stored.box.volume() * element_size(dtype);
      chunk.box = std::move(stored.box);
      entry.chunks.push_back(std::move(chunk));
    }
  }
  return plan;
}

std::map<std::string, KeyEntry> merge_plans(const std::vector<RankPlan>& ranks,
                                            std::vector<std::string> problems) {
  std::map<std::string, KeyEntry> keys;
  std::map<std::string, std::vector<size_t>> chunk_rank;  // per key, parallel to its chunks
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& [key, planned] : ranks[r].keys) {
      auto [it, inserted] =
          keys.try_emplace(key, KeyEntry{planned.dtype, planned.global_shape, {}});
      KeyEntry& entry = it->second;
      if (!inserted && (entry.dtype != planned.dtype || entry.shape != planned.global_shape)) {
        problems.push_back(
            "key '" + key + "' (rank " + std::to_string(r) + "): dtype/global shape " +
            std::string(dtype_name(planned.dtype)) + " " + dims_to_string(planned.global_shape) +
            " disagrees with another rank's " + std::string(dtype_name(entry.dtype)) + " " +
            dims_to_string(entry.shape));
        continue;
      }
      for (const Chunk& chunk : planned.chunks) {
        entry.chunks.push_back(chunk);
        chunk_rank[key].push_back(r);
      }
    }
  }
  for (const auto& [key, entry] : keys) {
    std::vector<Box> boxes;
    for (const auto& c : entry.chunks) boxes.push_back(c.box);
    if (auto problem = check_tiling(boxes, entry.shape)) {
      using Kind = TilingProblem::Kind;
      const std::vector<size_t>& rank_of = chunk_rank[key];
      std::string what =
          problem->kind == Kind::kOverlap
              ? "shards of ranks " + std::to_string(rank_of[problem->first]) + " and " +
                    std::to_string(rank_of[problem->second]) +
                    " overlap (a shard written twice? mark duplicates with replica_id > 0)"
          : problem->kind == Kind::kGap
              ? "replica-0 shards cover " + std::to_string(problem->covered) + " of " +
                    std::to_string(problem->total) + " elements"
              : "shard " + entry.chunks[problem->first].box.to_string() + " lies outside " +
                    dims_to_string(entry.shape);
      problems.push_back("key '" + key + "': " + what);
    }
  }
  mixprec::detail::check_no_problems(problems, "[mixprec::checkpoint::save] cannot save");
  return keys;
}

void fill_checksums(std::map<std::string, KeyEntry>& keys,
                    std::map<std::string, std::map<std::string, WrittenTensor>>& written) {
  for (auto& [key, entry] : keys) {
    for (Chunk& chunk : entry.chunks) {
      WrittenTensor& w = written.at(chunk.file).at(chunk.tensor);
      TORCH_INTERNAL_ASSERT(w.byte_size == chunk.bytes, "chunk '", chunk.tensor, "' of ",
                            chunk.file, ": ", w.byte_size, " bytes written, ", chunk.bytes,
                            " planned");
      chunk.checksum = w.checksum;
      chunk.block_checksums = std::move(w.block_checksums);
    }
  }
}

namespace {

bool is_valid_utf8(const std::string& text) {
  try {
    (void)nlohmann::json(text).dump();  // nlohmann's strict error handler throws on bad UTF-8
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

// `value` at JSON pointer `at`, nested `depth` deep: what a reader would refuse, or what JSON
// cannot hold, into `problems`.
void check_json(const nlohmann::json& value, const std::string& at, int depth,
                std::vector<std::string>& problems) {
  constexpr size_t kEnough = 8;  // a list of problems, not a flood
  if (problems.size() >= kEnough) return;
  const std::string where = at.empty() ? "the common state" : "'" + at + "'";
  if (value.is_structured() && depth > kMaxJsonDepth) {
    problems.push_back(where + ": nested deeper than " + std::to_string(kMaxJsonDepth) +
                       " levels, which no reader accepts");
    return;
  }
  if (value.is_object()) {
    for (const auto& [key, item] : value.items()) {
      if (!is_valid_utf8(key)) {
        problems.push_back(where + ": a key that is not valid UTF-8 (JSON text is UTF-8)");
        continue;
      }
      check_json(item, at + "/" + key, depth + 1, problems);
    }
  } else if (value.is_array()) {
    for (size_t i = 0; i < value.size(); ++i) {
      check_json(value[i], at + "/" + std::to_string(i), depth + 1, problems);
    }
  } else if (value.is_string() && !is_valid_utf8(value.get_ref<const std::string&>())) {
    problems.push_back(where + ": a string that is not valid UTF-8 (JSON text is UTF-8)");
  } else if (value.is_number_float() && !std::isfinite(value.get<double>())) {
    problems.push_back(where + ": " + std::to_string(value.get<double>()) +
                       ", which JSON cannot hold (it would be saved as null)");
  }
}

}  // namespace

void check_common_state(const nlohmann::json& common) {
  std::vector<std::string> problems;
  check_json(common, "", 1, problems);
  if (problems.empty()) return;
  std::string list;
  for (const auto& problem : problems) list += "\n  " + problem;
  TORCH_CHECK(false, "[mixprec::checkpoint::save] the common state cannot be saved as JSON:", list);
}

void check_savable(const std::vector<const ShardedStateDict*>& ranks) {
  TORCH_CHECK(!ranks.empty(), "[mixprec::checkpoint::save] no state to save");
  for (size_t r = 0; r < ranks.size(); ++r) {
    TORCH_CHECK(ranks[r] != nullptr, "[mixprec::checkpoint::save] rank ", r, " state is null");
  }
  check_unchanged(ranks, "since the state dict was built");
  check_common_state(ranks[0]->common);  // rank 0's is the one written
  std::vector<std::string> problems;
  std::vector<RankPlan> plans;
  for (size_t r = 0; r < ranks.size(); ++r) plans.push_back(plan_rank(*ranks[r], r, problems));
  merge_plans(plans, std::move(problems));
}

}  // namespace mixprec::checkpoint::detail
