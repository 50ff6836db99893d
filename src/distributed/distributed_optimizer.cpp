// DistributedOptimizer: Float16Optimizer with each rank's pieces and the collectives of a step.
#include "mixprec/distributed/distributed_optimizer.h"

#include "optim/algorithm_traits.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace mixprec::distributed {

using optim::ParamRole;

namespace {

constexpr const char* kWho = "mixprec::distributed::DistributedOptimizer";

std::vector<torch::optim::OptimizerParamGroup> all_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;  // tied weights are one parameter
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& t = item.value();
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) params.push_back(t);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::move(params));
  return groups;
}

// Every parameter of `model` of a dtype the reducer reduces must be one it serves: one it does
// not has no piece on any rank, so it would never be stepped, without a word. (Other dtypes are
// frozen: the reducer only broadcasts them, and the optimizer leaves them alone.)
void check_reducer_serves(const GradReducer& reducer, const torch::nn::Module& model) {
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !GradReducer::reduces(p.scalar_type())) continue;
    TORCH_CHECK(reducer.index_of(p) != GradReducer::kNoParam, "[", kWho, "] '", item.key(),
                "' is not a parameter of the GradReducer's model: build the optimizer and the "
                "reducer from the same model");
  }
}

}  // namespace

// The pieces a rank steps: its part of each parameter in the reducer's layout.
optim::Float16Optimizer::Sharding DistributedOptimizer::sharding_of(GradReducer& reducer) {
  TORCH_CHECK(reducer.options().mode() == ReduceMode::kReduceScatter, "[", kWho,
              "] the GradReducer must use ReduceMode::kReduceScatter (each rank receives only "
              "its shard of the gradients)");
  reducer.communicator().check_usable(kWho);
  optim::Float16Optimizer::Sharding sharding;
  sharding.rank = reducer.communicator().rank();
  sharding.piece_of = [&reducer](const at::Tensor& param) -> FlatRange {
    const size_t i = reducer.index_of(param);
    return i == GradReducer::kNoParam ? FlatRange{} : reducer.piece_of(i);
  };
  return sharding;
}

DistributedOptimizer::DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                                           std::vector<torch::optim::OptimizerParamGroup> groups,
                                           std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                           optim::Float16OptimizerOptions options)
    : optim::Float16Optimizer(
          model, std::move(groups), std::move(defaults),
          [&] {
            check_reducer_serves(reducer, model);
            TORCH_CHECK(!options.master_remainders(), "[", kWho,
                        "] master_remainders is not supported by the "
                        "distributed optimizer; its masters are FP32");
            return std::move(options);
          }(),
          sharding_of(reducer), kWho),
      reducer_(reducer) {}

DistributedOptimizer::DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                                           const torch::optim::OptimizerOptions& defaults,
                                           optim::Float16OptimizerOptions options)
    : DistributedOptimizer(reducer, model, all_parameters(model), defaults.clone(),
                           std::move(options)) {}

void DistributedOptimizer::before_update() {
  reducer_.communicator().check_usable(kWho);
  reducer_.wait_param_gather();
  reducer_.reseat_params();
}

void DistributedOptimizer::reduce_gradients() { reducer_.finish(); }

at::Tensor DistributedOptimizer::piece_gradient(size_t index, bool& arrived) const {
  const Slot& slot = *slots_[index];
  const size_t i = reducer_.index_of(slot.param);
  arrived = i != GradReducer::kNoParam && reducer_.got_gradient(i);
  if (i == GradReducer::kNoParam) return {};
  // The piece of the reduced gradient, whether or not a gradient arrived here: other ranks'
  // may have.
  return reducer_.reduced_gradient(i).narrow(0, slot.begin, slot.end - slot.begin);
}

// One FP64 all-reduce: per parameter, the sum of squares of its pieces, how many ranks got a
// gradient, how many saw a non-finite one.
void DistributedOptimizer::agree(GradientAgreement& agreement) {
  Communicator& comm = reducer_.communicator();
  const int64_t n = static_cast<int64_t>(agreement.sum_of_squares.size());
  if (agreement_buffer_.numel() != 3 * n) agreement_buffer_ = at::empty({3 * n}, at::kDouble);
  double* values = agreement_buffer_.mutable_data_ptr<double>();
  for (int64_t k = 0; k < n; ++k) {
    values[k] = agreement.sum_of_squares[k];
    values[n + k] = agreement.has_gradient[k];
    values[2 * n + k] = agreement.non_finite[k];
  }
  comm.all_reduce_sum(agreement_buffer_).wait();
  for (int64_t k = 0; k < n; ++k) {
    agreement.sum_of_squares[k] = values[k];
    agreement.has_gradient[k] = values[n + k] > 0 ? 1 : 0;
    agreement.non_finite[k] = values[2 * n + k] > 0 ? 1 : 0;
  }
}

void DistributedOptimizer::publish_params() { reducer_.start_param_gather(); }

void DistributedOptimizer::agree_to_load(const std::exception_ptr& failed) {
  at::Tensor refused = at::full({1}, failed ? 1.0f : 0.0f, at::kFloat);
  reducer_.communicator().all_reduce_sum(refused).wait();
  if (failed) std::rethrow_exception(failed);
  const int others = static_cast<int>(refused.item<float>());
  TORCH_CHECK(others == 0, "[", kWho, "] cannot load the state: ", others, " other rank",
              others == 1 ? "" : "s",
              " refused its part (its error says why); nothing was changed on any rank");
}

std::span<const std::string_view> DistributedOptimizer::state_kinds() const {
  return optim::detail::traits_for(defaults(), kWho).state_kinds();
}

int64_t DistributedOptimizer::param_step(size_t info) const {
  TORCH_CHECK(info < slots_.size(), "[", kWho, "::param_step] index ", info,
              " is not a parameter: the optimizer holds ", slots_.size(), " (params_info())");
  return slots_[info]->step;
}

std::vector<DistributedOptimizer::LocalShard> DistributedOptimizer::local_shards() const {
  std::unordered_map<size_t, ParamShard> owned;  // layout index → this rank's piece
  for (ParamShard& piece : reducer_.layout().param_shards(reducer_.communicator().rank())) {
    owned.emplace(piece.param, std::move(piece));
  }
  std::vector<LocalShard> out;
  const auto& info = params_info();
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    if (info[k].role == ParamRole::kFrozen || s.begin == s.end) continue;
    auto piece = owned.find(reducer_.index_of(s.param));
    TORCH_INTERNAL_ASSERT(piece != owned.end() && piece->second.begin == s.begin);
    out.push_back(LocalShard{piece->second, k, info[k].role, s.piece(), s.master, s.state});
  }
  return out;
}

at::Tensor DistributedOptimizer::state_of(const LocalShard& shard, std::string_view kind) const {
  const auto kinds = state_kinds();
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == kind) return shard.state.at(i);
  }
  TORCH_CHECK(false, "[", kWho, "] the optimizer keeps no '", kind, "' state");
}

FlatRange DistributedOptimizer::piece_of(const std::string& fqn) const {
  const auto& info = params_info();
  for (size_t k = 0; k < info.size(); ++k) {
    if (info[k].fqn == fqn) return FlatRange{slots_[k]->begin, slots_[k]->end};
  }
  return {};
}

std::string DistributedOptimizer::describe() const {
  std::ostringstream os;
  const Communicator& comm = reducer_.communicator();
  os << reducer_.layout().describe();
  const std::vector<LocalShard> shards = local_shards();
  os << "rank " << comm.rank() << " of " << comm.size() << " owns " << shards.size()
     << " piece(s) with optimizer state\n";
  for (const LocalShard& s : shards) {
    os << "  " << s.shard.fqn << "[" << s.shard.begin << ":" << s.shard.end << "] "
       << optim::to_string(s.role) << "\n";
  }
  return os.str();
}

}  // namespace mixprec::distributed
