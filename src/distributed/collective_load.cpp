// distributed::load_training_state: every rank reads its part, checks everything, then all agree
// before anything changes (collective_checkpoint.h).
#include "mixprec/distributed/collective_checkpoint.h"

#include "checkpoint/rng_state.h"
#include "distributed/agreement.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/state_keys.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <optional>

namespace mixprec::distributed {

namespace ckpt = mixprec::checkpoint;
namespace keys = mixprec::checkpoint::keys;

namespace {

constexpr const char* kLoadOp = "mixprec::distributed::load_training_state";

// "optimizer.state.<kind>.<fqn>" → "<fqn>" (kinds hold no '.'); "" for other optimizer keys.
std::string fqn_of_state_key(const std::string& key) {
  if (!key.starts_with(keys::kOptimizerStatePrefix)) return {};
  const size_t dot = key.find('.', keys::kOptimizerStatePrefix.size());
  return dot == std::string::npos ? std::string() : key.substr(dot + 1);
}

// The RNG states this rank read (its own "rng.rank.<rank>.*", or a single-process save's
// "rng.*"), under the keys check_rng knows.
std::map<std::string, at::Tensor> rng_for_rank(const std::map<std::string, at::Tensor>& read,
                                               int rank) {
  const std::string mine = keys::rng_rank_key(rank, "");
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, state] : read) {
    out.emplace(key.starts_with(mine) ? "rng." + key.substr(mine.size()) : key, state);
  }
  return out;
}

}  // namespace

ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 DistributedOptimizer& optimizer, const LoadOptions& options) {
  Communicator& comm = optimizer.communicator();
  const int rank = comm.rank();
  ResumeResult result;

  // Which checkpoint: rank 0's answer, so that every rank loads the same one even if `latest`
  // moves meanwhile. Given a root, rank 0 verifies each checkpoint newer than `latest` (a crash
  // between commit and pointer update), which may take longer than the group's timeout: the
  // other ranks wait for it in slices of a quarter of it.
  const std::string found = detail::agree_on_one_ranks_part(comm, kLoadOp, /*worker=*/0, [&] {
    const ckpt::ResolvedCheckpoint resolved = ckpt::find_checkpoint(path);
    return nlohmann::json{{"dir", resolved.dir.string()}, {"note", resolved.note}}.dump();
  });
  const nlohmann::json where = nlohmann::json::parse(found);
  result.dir = where.at("dir").get<std::string>();
  result.note = where.at("note").get<std::string>();

  // Read and check on every rank; change nothing yet.
  std::optional<CheckedModelState> checked_model;
  std::optional<optim::CheckedOptimizerState> checked_optimizer;
  std::optional<ckpt::detail::CheckedRng> checked_rng;
  detail::agree(comm, kLoadOp, [&]() -> std::string {
    const ckpt::Manifest manifest = ckpt::read_manifest(result.dir);
    ckpt::ReadOptions pieces, whole;
    const std::string my_rng = keys::rng_rank_key(rank, "");
    bool per_rank_rng = false;
    for (const auto& [key, entry] : manifest.keys) {
      per_rank_rng |= key.starts_with(keys::kRngRankPrefix);
      if (keys::is_optimizer_key(key)) {
        pieces.keys.insert(key);
      } else if (!keys::is_rng_key(key) || key.starts_with(my_rng)) {
        whole.keys.insert(key);
      }
    }
    for (const auto& [key, entry] : manifest.keys) {  // a single-process save's generators
      if (!per_rank_rng && keys::is_rng_key(key)) whole.keys.insert(key);
    }
    // Each optimizer key: this rank's piece of its parameter; nothing (an empty range, the
    // key still listed) where it owns none, or where the range does not fit the saved shape:
    // the optimizer's check then names the shape.
    pieces.flat_range = [&](const std::string& key, const std::vector<int64_t>& shape) {
      const FlatRange piece = optimizer.piece_of(fqn_of_state_key(key));
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      return std::optional<FlatRange>(piece.end <= numel ? piece : FlatRange{});
    };
    pieces.stats = &result.optimizer_reads;
    whole.stats = &result.model_reads;
    ShardedStateDict state = ckpt::read_checkpoint(result.dir, whole);
    if (!pieces.keys.empty()) {
      ShardedStateDict optimizer_state = ckpt::read_checkpoint(result.dir, pieces);
      for (auto& [key, t] : optimizer_state.tensors) state.tensors.emplace(key, std::move(t));
    }
    ckpt::TrainingStateParts parts = ckpt::split_training_state(std::move(state));
    try {  // the errors say which checkpoint, as one process's load does
      checked_model = check_model_sharded_state_dict(model, parts.model, options);
      ShardedStateDict optimizer_view = parts.optimizer;
      for (const auto& [key, t] : parts.model.tensors) optimizer_view.tensors.emplace(key, t);
      checked_optimizer = optimizer.check_sharded_state_dict(optimizer_view, options);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "[mixprec::distributed::load_training_state] ", result.dir.string(), ": ",
                  e.msg());
    }
    if (per_rank_rng && parts.rng.empty()) {
      result.rng.notes.push_back("the checkpoint holds no RNG state for rank " +
                                 std::to_string(rank) +
                                 " (fewer ranks saved it): its generators are left as they are");
    } else {
      checked_rng = ckpt::detail::check_rng(rng_for_rank(parts.rng, rank), result.dir);
      if (!per_rank_rng && rank > 0) {
        checked_rng->report.notes.push_back(
            "a single-process checkpoint: every rank takes its one process's RNG states");
      }
    }
    result.user = std::move(parts.user);
    return {};
  });

  // Every rank's check passed: apply everywhere (the optimizer's apply is collective). Nothing
  // here fails on the state's content; if it fails anyway (a rank lost in the gather), ranks
  // hold partial states that no later step may build on: the group is marked failed.
  try {
    result.model = apply_model_state(model, std::move(*checked_model));
    result.optimizer = optimizer.apply(std::move(*checked_optimizer));
    if (checked_rng) {
      ckpt::detail::apply_rng(*checked_rng);
      result.rng = checked_rng->report;
    }
  } catch (const std::exception& e) {
    comm.fail(std::string("applying a checked training state failed after every rank agreed: ") +
              e.what());
    throw;
  }
  return result;
}

}  // namespace mixprec::distributed
