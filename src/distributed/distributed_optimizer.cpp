#include "mixprec/distributed/distributed_optimizer.h"

#include "detail/name_match.h"
#include "optim/algorithm_traits.h"
#include "optim/offload/offload_pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cmath>
#include <sstream>
#include <typeinfo>
#include <unordered_map>

namespace mixprec::distributed {

using optim::ParamInfo;
using optim::ParamRole;

namespace {

constexpr const char* kWho = "mixprec::distributed::DistributedOptimizer";

// torch::optim::Optimizer's constructor silently replaces group options of another type with
// the defaults; refuse them before it runs (this is evaluated as its `defaults` argument).
std::unique_ptr<torch::optim::OptimizerOptions> checked_defaults(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults) {
  TORCH_CHECK(defaults != nullptr, "[", kWho, "] defaults are null");
  const optim::detail::AlgorithmTraits& expected = optim::detail::traits_for(*defaults, kWho);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].has_options() || expected.owns(groups[g].options())) continue;
    const auto& other = optim::detail::traits_for(groups[g].options(), kWho);
    TORCH_CHECK(false, "[", kWho, "] param group ", g, " has ", other.options_name(),
                " but the defaults are ", expected.options_name(),
                "; all groups must use one algorithm");
  }
  return defaults;
}

std::vector<torch::optim::OptimizerParamGroup> all_parameters(const torch::nn::Module& model) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model.parameters());
  return groups;
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                                           std::vector<torch::optim::OptimizerParamGroup> groups,
                                           std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                                           optim::Float16OptimizerOptions options)
    : torch::optim::Optimizer(groups, checked_defaults(groups, std::move(defaults))),
      reducer_(reducer),
      options_(std::move(options)),
      traits_(&optim::detail::traits_for(this->defaults(), kWho)),
      scaler_(options_.loss_scaler()) {
  TORCH_CHECK(reducer_.options().mode() == ReduceMode::kReduceScatter, "[", kWho,
              "] the GradReducer must use ReduceMode::kReduceScatter (each rank receives only "
              "its shard of the gradients)");
  TORCH_CHECK(options_.clip_grad() >= 0 && std::isfinite(options_.clip_grad()), "[", kWho,
              "] clip_grad must be a finite value >= 0, got ", options_.clip_grad());
  TORCH_CHECK(!options_.master_remainders(), "[", kWho,
              "] master_remainders is not supported by the distributed optimizer; its masters "
              "are FP32");
  if (options_.offload()) optim::detail::OffloadPipeline::check_options(*options_.offload(), kWho);
  build(model);
}

DistributedOptimizer::DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                                           const torch::optim::OptimizerOptions& defaults,
                                           optim::Float16OptimizerOptions options)
    : DistributedOptimizer(reducer, model, all_parameters(model), defaults.clone(),
                           std::move(options)) {}

void DistributedOptimizer::build(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> fqn_of;
  for (const auto& item : model.named_parameters()) {
    if (item.value().defined()) fqn_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  const GradLayout& layout = reducer_.layout();
  std::unordered_map<std::string, size_t> layout_index;
  for (size_t i = 0; i < layout.params.size(); ++i) layout_index.emplace(layout.params[i].fqn, i);

  std::vector<std::string> problems;
  std::unordered_map<const c10::TensorImpl*, int64_t> first_id;
  std::unordered_map<size_t, size_t> info_of_layout;  // layout param → params_info index
  int64_t id = 0;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    const auto& params = param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++id) {
      const at::Tensor& p = params[i];
      auto it = p.defined() ? fqn_of.find(p.unsafeGetTensorImpl()) : fqn_of.end();
      if (it == fqn_of.end()) {
        problems.push_back("param " + std::to_string(i) + " of group " + std::to_string(g) +
                           " (id " + std::to_string(id) + ") is not a parameter of the model");
        continue;
      }
      if (auto [seen, fresh] = first_id.emplace(p.unsafeGetTensorImpl(), id); !fresh) {
        problems.push_back("'" + it->second + "' appears twice (ids " +
                           std::to_string(seen->second) + " and " + std::to_string(id) + ")");
        continue;
      }
      ParamInfo info{it->second, g, id, ParamRole::kFrozen};
      if (p.requires_grad()) {
        auto found = layout_index.find(info.fqn);
        if (found == layout_index.end() || !reducer_.param(found->second).is_same(p)) {
          problems.push_back("'" + info.fqn +
                             "' is trainable but the GradReducer has no gradient buffer for it "
                             "(was it made trainable after the reducer was built?)");
        } else {
          info.role = p.scalar_type() == at::kFloat ? ParamRole::kNativeFp32 : ParamRole::kMaster;
          info_of_layout.emplace(found->second, info_.size());
        }
      }
      shapes_.push_back(p.sizes().vec());
      info_.push_back(std::move(info));
    }
  }
  steps_.assign(info_.size(), 0);
  mixprec::detail::check_no_problems(
      problems, std::string("[") + kWho + "] cannot optimize these parameters");

  at::NoGradGuard no_grad;
  const int rank = reducer_.communicator().rank();
  for (const ParamShard& piece : layout.param_shards(rank)) {
    const at::Tensor& p = reducer_.param(piece.param);
    at::Tensor param_view = p.detach().view({-1}).narrow(0, piece.begin, piece.numel());
    owned_pieces_.emplace_back(piece, param_view);
    auto info = info_of_layout.find(piece.param);
    if (info == info_of_layout.end()) continue;  // reduced, but not in this optimizer's groups
    LocalShard shard;
    shard.shard = piece;
    shard.info = info->second;
    shard.role = info_[info->second].role;
    shard.param = param_view;
    shard.grad = reducer_.grad_buffer(piece.buffer).narrow(0, piece.buffer_begin, piece.numel());
    if (shard.role == ParamRole::kMaster) {
      const c10::Device where = options_.offload() ? c10::Device(c10::kCPU) : param_view.device();
      shard.master = param_view.to(where, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    shard.state.resize(traits_->state_kinds().size());
    shard_of_.emplace(piece.fqn, shards_.size());
    shards_.push_back(std::move(shard));
  }
}

optim::Algorithm DistributedOptimizer::algorithm() const { return traits_->algorithm(); }

std::span<const std::string_view> DistributedOptimizer::state_kinds() const {
  return traits_->state_kinds();
}

const at::Tensor& DistributedOptimizer::state_of(const LocalShard& shard,
                                                 std::string_view kind) const {
  const auto kinds = traits_->state_kinds();
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == kind) return shard.state.at(i);
  }
  TORCH_CHECK(false, "[", kWho, "] ", traits_->name(), " keeps no '", kind, "' state");
}

FlatRange DistributedOptimizer::piece_of(const std::string& fqn) const {
  auto it = shard_of_.find(fqn);
  if (it == shard_of_.end()) return {};
  const ParamShard& piece = shards_[it->second].shard;
  return {piece.begin, piece.end};
}

int64_t DistributedOptimizer::state_bytes(ParamRole role) const {
  int64_t bytes = 0;
  for (const LocalShard& s : shards_) {
    if (s.role != role) continue;
    if (s.master.defined()) bytes += static_cast<int64_t>(s.master.nbytes());
    for (const at::Tensor& t : s.state) {
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  return bytes;
}

std::string DistributedOptimizer::describe() const {
  std::ostringstream os;
  const Communicator& comm = reducer_.communicator();
  os << reducer_.layout().describe();
  os << "rank " << comm.rank() << " of " << comm.size() << " owns " << shards_.size()
     << " piece(s) with optimizer state (" << traits_->name() << ")\n";
  for (const LocalShard& s : shards_) {
    os << "  " << s.shard.fqn << "[" << s.shard.begin << ":" << s.shard.end << "] "
       << optim::to_string(s.role) << ", buffer " << s.shard.buffer << " bucket " << s.shard.bucket
       << " at " << s.shard.buffer_begin << "\n";
  }
  return os.str();
}

at::Tensor DistributedOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  update();
  return loss;
}

void DistributedOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "[", kWho,
              "::save] LibTorch archives key state by pointer and hold one "
              "rank's shard without its layout; use sharded_state_dict() or "
              "distributed::save_training_state (distributed/collective_checkpoint.h)");
}

void DistributedOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "[", kWho,
              "::load] LibTorch archives key state by pointer and hold one "
              "rank's shard without its layout; use check_sharded_state_dict() and apply(), or "
              "distributed::load_training_state (distributed/collective_checkpoint.h)");
}

}  // namespace mixprec::distributed
