// DistributedOptimizer with offloading: this rank's pieces step through the shared offloading
// pipeline (optim/offload.h), with their masters and moments on the host. What steps and with
// which multiplier is decided by update() as without offloading.
#include "mixprec/distributed/distributed_optimizer.h"

#include "optim/algorithm_traits.h"
#include "optim/offload/offload_pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace mixprec::distributed {

void DistributedOptimizer::step_offloaded(double grad_multiplier) {
  TORCH_INTERNAL_ASSERT(options_.offload());
  offload_stats_ = optim::OffloadStats();
  if (shards_.empty()) return;
  const optim::detail::AlgorithmTraits& traits = *traits_;
  const c10::Device device = shards_.front().param.device();  // the reducer's buffers' device
  if (!offload_) {
    offload_ = std::make_shared<optim::detail::OffloadPipeline>(
        *options_.offload(), device, "mixprec::distributed::DistributedOptimizer");
  }
  std::vector<optim::detail::OffloadItem> items;
  std::vector<std::vector<at::Tensor>> whole_state;  // committed once every chunk is done
  for (LocalShard& s : shards_) {
    const auto& options = param_groups()[info_[s.info].group].options();
    optim::detail::OffloadItem item;
    item.grad = s.grad;  // 1-D views: contiguous
    item.param = s.param;
    item.param_down = !s.master.defined();  // native FP32: stepped in place
    item.master = s.master;
    std::vector<at::Tensor> state = s.state;
    item.fresh = traits.allocate_state(options, s.param.sizes(), c10::kCPU, state);
    item.state = state;
    item.options = &options;
    item.steps_before = steps_[s.info];  // update() counts the step once every piece is done
    items.push_back(std::move(item));
    whole_state.push_back(std::move(state));
  }
  offload_stats_ = offload_->run(traits, items, grad_multiplier);
  for (size_t i = 0; i < shards_.size(); ++i) shards_[i].state = std::move(whole_state[i]);
}

}  // namespace mixprec::distributed
